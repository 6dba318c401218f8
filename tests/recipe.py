"""Builds the "rv1" checkpoints on which the Hugging Face reference vectors were computed.

The recipe (tensor names, draw order and scales) is fixed by the vectors in
``tests/data/hf_vectors.json``; ``tensor_sums`` there checks a build. Test-only code: it shares
nothing with the engine.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

VECTORS_PATH = Path(__file__).parent / "data" / "hf_vectors.json"
SEED = 20261130


# The tiny Nanbeige config; tests/builders.py takes it from here (one source for the config,
# while the tensor layout below stays written independently of the engine).
NANBEIGE_TINY: dict = {
    "architectures": ["NanbeigeForCausalLM"],
    "model_type": "nanbeige",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # != hidden / heads on purpose
    "intermediate_size": 96,
    "vocab_size": 384,
    "max_position_embeddings": 512,
    "rope_theta": 70000000.0,
    "rope_scaling": None,
    "rms_norm_eps": 1e-05,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "num_loops": 2,
    "skip_loop_final_norm": False,
    "bos_token_id": 380,
    "eos_token_id": 381,
    "pad_token_id": 0,
    "layer_types": ["full_attention", "full_attention"],
    "torch_dtype": "float32",
}


def load_vectors() -> dict:
    return json.loads(VECTORS_PATH.read_text())


def llama_block_shapes(p: str, h: int, q: int, kv: int, inter: int) -> dict[str, tuple[int, ...]]:
    """The attention and MLP weights of one Llama-style layer (Ouro and Nanbeige alike)."""
    return {
        p + "self_attn.q_proj.weight": (q, h),
        p + "self_attn.k_proj.weight": (kv, h),
        p + "self_attn.v_proj.weight": (kv, h),
        p + "self_attn.o_proj.weight": (h, q),
        p + "mlp.gate_proj.weight": (inter, h),
        p + "mlp.up_proj.weight": (inter, h),
        p + "mlp.down_proj.weight": (h, inter),
    }


def ouro_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, h),
        "model.norm.weight": (h,),
        "model.early_exit_gate.weight": (1, h),
        "model.early_exit_gate.bias": (1,),
        "lm_head.weight": (vocab, h),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                **llama_block_shapes(p, h, q, kv, inter),
                p + "input_layernorm.weight": (h,),
                p + "input_layernorm_2.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "post_attention_layernorm_2.weight": (h,),
            }
        )
    return shapes


def huginn_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    e, inter, vocab = cfg["n_embd"], cfg["intermediate_size"], cfg["padded_vocab_size"]
    heads, hd = cfg["n_heads"], cfg["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {
        "transformer.wte.weight": (vocab, e),
        "transformer.adapter.weight": (e, 2 * e),
        "transformer.ln_f.weight": (e,),
        "lm_head.weight": (vocab, e),
        "freqs_cis": (1, cfg["block_size"], 1, hd // 2, 2),
    }
    groups = {
        "prelude": cfg["n_layers_in_prelude"],
        "core_block": cfg["n_layers_in_recurrent_block"],
        "coda": cfg["n_layers_in_coda"],
    }
    for group, count in groups.items():
        for i in range(count):
            p = f"transformer.{group}.{i}."
            shapes.update(
                {
                    p + "norm_1.weight": (e,),
                    p + "norm_2.weight": (e,),
                    p + "norm_3.weight": (e,),
                    p + "norm_4.weight": (e,),
                    p + "attn.Wqkv.weight": (3 * e, e),
                    p + "attn.qk_bias": (2, 1, heads, hd),
                    p + "attn.proj.weight": (e, e),
                    p + "mlp.fc.weight": (2 * inter, e),
                    p + "mlp.proj.weight": (e, inter),
                }
            )
    return shapes


def _draw(shapes: dict[str, tuple[int, ...]], skip: set[str]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    out: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        if name in skip:
            continue
        if name == "model.early_exit_gate.bias":
            out[name] = torch.tensor([-1.0])
            continue
        shape = shapes[name]
        r = torch.randn(shape, generator=g, dtype=torch.float32)
        if len(shape) == 1:
            out[name] = 1 + 0.1 * r
        elif name == "model.early_exit_gate.weight":
            out[name] = 0.25 * r
        elif name.endswith("attn.qk_bias"):
            out[name] = 0.3 * r
        elif name in ("model.embed_tokens.weight", "transformer.wte.weight"):
            out[name] = r
        else:
            out[name] = r / math.sqrt(shape[-1])
    return out


def build_ouro_rv1(out_dir: Path) -> Path:
    cfg = load_vectors()["configs"]["ouro"]
    tensors = _draw(ouro_shapes(cfg), skip=set())
    return _write(out_dir, cfg, tensors)


def build_huginn_rv1(out_dir: Path) -> Path:
    cfg = load_vectors()["configs"]["huginn"]
    shapes = huginn_shapes(cfg)
    tensors = _draw(shapes, skip={"lm_head.weight", "freqs_cis"})
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"].clone()
    hd = cfg["head_dim"]
    inv = 1.0 / (cfg["rope_base"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    f = torch.outer(torch.arange(cfg["block_size"], dtype=torch.float32), inv)
    tensors["freqs_cis"] = torch.stack([f.cos(), f.sin()], dim=-1)[None, :, None].contiguous()
    return _write(out_dir, cfg, tensors)


def build_nanbeige(out_dir: Path) -> Path:
    """A tiny Nanbeige checkpoint with the real key names (MODELS.md's table), sharded in two
    files. Written independently of the engine's layout table, which it checks."""
    cfg = NANBEIGE_TINY
    h, inter, vocab, hd = 64, 96, 384, 32
    q, kv = 4 * hd, 2 * hd
    shapes = {
        "model.embed_tokens.weight": (vocab, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (vocab, h),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                **llama_block_shapes(p, h, q, kv, inter),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
    g = torch.Generator().manual_seed(7)
    tensors = {}
    for name in sorted(shapes):
        r = torch.randn(shapes[name], generator=g)
        if len(r.shape) == 1:
            tensors[name] = 1 + 0.1 * r
        elif name == "model.embed_tokens.weight":
            tensors[name] = r
        else:
            tensors[name] = r / math.sqrt(r.shape[-1])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True)
    (out_dir / "config.json").write_text(json.dumps(cfg))
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: tensors[k].contiguous() for k in keys}, str(out_dir / fname))
        weight_map.update({k: fname for k in keys})
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    return out_dir


def _write(out_dir: Path, cfg: dict, tensors: dict[str, torch.Tensor]) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"))
    return out_dir


def tensor_sums(path: Path) -> dict[str, float]:
    from safetensors.torch import load_file

    return {
        k: float(v.double().sum()) for k, v in load_file(str(path / "model.safetensors")).items()
    }
