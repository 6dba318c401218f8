"""Tiny checkpoint builders shared by the model and loader tests.

The Ouro and Huginn "rv1" checkpoints come from ``recipe.py`` (fixed by the Hugging Face
vectors); this module adds a tiny Nanbeige with the real tensor names, generic writers (single
file or sharded with an index) and the real configs of every family for layout checks.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from recipe import NANBEIGE_TINY, load_vectors
from safetensors.torch import save_file

from rltserve.models import get_family

# Real configs (MODELS.md tables), for name/shape/parameter-count checks only.
OURO_1_4B: dict[str, Any] = {
    "model_type": "ouro",
    "hidden_size": 2048,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "intermediate_size": 5632,
    "vocab_size": 49152,
    "hidden_act": "silu",
    "max_position_embeddings": 65536,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "total_ut_steps": 4,
    "early_exit_threshold": 1.0,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
OURO_2_6B: dict[str, Any] = {**OURO_1_4B, "num_hidden_layers": 48, "head_dim": 128}
HUGINN_0125: dict[str, Any] = {
    "model_type": "huginn_raven",
    "bias": False,
    "block_size": 4096,
    "head_dim": 96,
    "init_values": {"embed_scale": 72.6636084983398, "std": 0.008703882797784892},
    "injection_type": "linear",
    "intermediate_size": 17920,
    "mean_recurrence": 32,
    "n_embd": 5280,
    "n_heads": 55,
    "n_layers": 8,
    "n_layers_in_coda": 2,
    "n_layers_in_prelude": 2,
    "n_layers_in_recurrent_block": 4,
    "norm_eps": 1e-06,
    "num_key_value_heads": 55,
    "padded_vocab_size": 65536,
    "qk_bias": True,
    "rope_base": 50000,
    "tie_embeddings": True,
    "vocab_size": 65536,
    "bos_token_id": 65504,
    "eos_token_id": 65505,
    "pad_token_id": 65509,
}
NANBEIGE_4_2_3B: dict[str, Any] = {
    **NANBEIGE_TINY,
    "hidden_size": 3072,
    "num_hidden_layers": 22,
    "num_attention_heads": 48,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 10752,
    "vocab_size": 166144,
    "max_position_embeddings": 262144,
    "bos_token_id": 166100,
    "eos_token_id": 166101,
    "layer_types": ["full_attention"] * 22,
}


def random_tensors(cfg: dict[str, Any], seed: int = 7) -> dict[str, torch.Tensor]:
    """Random float32 values for every tensor of ``cfg``'s family (norms near 1, matrices scaled
    by 1/sqrt(in)); tied copies equal their source."""
    family = get_family(cfg["model_type"])
    shapes = family.tensor_shapes(cfg)
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        r = torch.randn(shapes[name], generator=g)
        if r.dim() == 1:
            out[name] = 1 + 0.1 * r
        elif name.endswith(("embed_tokens.weight", "wte.weight", "freqs_cis")):
            out[name] = r
        elif name.endswith("qk_bias"):
            out[name] = 0.3 * r
        else:
            out[name] = r / math.sqrt(r.shape[-1])
    for copy, source in family.tied.items():
        out[copy] = out[source].clone()
    return out


def write_checkpoint(
    out_dir: Path, cfg: dict[str, Any], tensors: dict[str, torch.Tensor], shards: int = 1
) -> Path:
    """config.json plus ``model.safetensors`` (shards=1) or N shards with an index."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if shards == 1:
        save_file(tensors, str(out_dir / "model.safetensors"))
        return out_dir
    names = sorted(tensors)
    weight_map: dict[str, str] = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({k: tensors[k] for k in part}, str(out_dir / fname))
        weight_map.update({k: fname for k in part})
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    return out_dir


def build_nanbeige_tiny(out_dir: Path, shards: int = 1) -> Path:
    return write_checkpoint(out_dir, NANBEIGE_TINY, random_tensors(NANBEIGE_TINY), shards)


def real_spec(raw: dict):
    """The ``LoopedSpec`` of a real config (``OURO_1_4B``, ...), built on the meta device."""
    family = get_family(raw["model_type"])
    with torch.device("meta"):
        return family.model_cls(family.parse_config(raw)).spec


# The tiny configs of every family (the rv1 recipes' and Nanbeige's), by name.
TINY_CONFIGS = {
    "ouro": load_vectors()["configs"]["ouro"],
    "huginn_raven": load_vectors()["configs"]["huginn"],
    "nanbeige": NANBEIGE_TINY,
}


def build_tiny(tmp_path: Path, family: str, name: str = "ckpt", **kw) -> Path:
    """A checkpoint of ``TINY_CONFIGS[family]`` with random values (``write_checkpoint``'s
    keywords: shards, dtype, ...)."""
    cfg = TINY_CONFIGS[family]
    return write_checkpoint(tmp_path / name, cfg, random_tensors(cfg), **kw)
