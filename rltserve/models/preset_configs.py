"""config.json contents and tokenizer layouts of the ``make_model`` presets, per family.

Key sets follow the real checkpoints: Ouro exactly the keys its config.json uses (MODELS.md
§1.2, incl. ``auto_map``), Huginn the §2.1 listing plus bos/eos/pad, Nanbeige the §3 table plus
the upstream feature switches with their disabled values. Special ids are scaled to the preset's
vocabulary the way the real ones sit in theirs (see ``presets`` module docstring).
"""

from __future__ import annotations

import math
from typing import Any

from rltserve.models.toktrain import CHATML_TEMPLATE, HUGINN_TEMPLATE, TokenizerLayout

HUGINN_SPECIALS = (
    "<|begin_text|>",
    "<|end_text|>",
    "<|begin_header|>",
    "<|end_header|>",
    "<|end_turn|>",
    "<|pad|>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
) + tuple(f"<|c_{i}|>" for i in range(22))  # 32 in all, the last 32 ids of the vocabulary
NANBEIGE_TAIL = 44  # bos = vocab - 44, eos = vocab - 43 (166100 / 166101 of 166144)


def ouro_config(
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    inter: int,
    vocab: int,
    *,
    max_pos: int,
    dtype: str,
    loops: int = 4,
) -> dict[str, Any]:
    return {
        "architectures": ["OuroForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_ouro.OuroConfig",
            "AutoModel": "modeling_ouro.OuroModel",
            "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM",
        },
        "model_type": "ouro",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_pos,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": layers,
        "layer_types": ["full_attention"] * layers,
        "attention_dropout": 0.0,
        "total_ut_steps": loops,
        "early_exit_threshold": 1.0,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "torch_dtype": dtype,
        "transformers_version": "4.54.1",
    }


def ouro_layout(vocab: int, max_len: int) -> TokenizerLayout:
    specials = (
        (0, "<|endoftext|>", True),
        (1, "<|im_start|>", True),
        (2, "<|im_end|>", True),
        (3, "<think>", False),
        (4, "</think>", False),
    )
    eot = "<|endoftext|>"
    return TokenizerLayout(
        vocab,
        specials,
        bos=eot,
        eos=eot,
        pad=eot,
        unk=eot,
        chat_template=CHATML_TEMPLATE,
        tokenizer_class="GPT2Tokenizer",
        model_max_length=max_len,
    )


def huginn_config(
    embd: int,
    heads: int,
    head_dim: int,
    inter: int,
    vocab: int,
    groups: tuple[int, int, int],
    *,
    mean_recurrence: int,
    block_size: int,
) -> dict[str, Any]:
    prelude, core, coda = groups
    depth = prelude + core * mean_recurrence + coda
    std = math.sqrt(2 / (5 * embd))
    first = vocab - len(HUGINN_SPECIALS)
    return {
        "activation_checkpoint_impl": "per-iteration",
        "architecture_class_name": "RecurrentGPT",
        "architectures": ["RavenForCausalLM"],
        "auto_map": {
            "AutoConfig": "raven_config_minimal.RavenConfig",
            "AutoModelForCausalLM": "raven_modeling_minimal.RavenForCausalLM",
        },
        "bias": False,
        "block_class_name": "SandwichBlock",
        "block_size": block_size,
        "effective_expected_depth": depth,
        "head_dim": head_dim,
        "init_orthogonal": False,
        "init_strategy": "takase",
        "init_values": {
            "embed_scale": math.sqrt(embd),
            "embedding": std,
            "out_proj": std / math.sqrt(2 * depth),
            "std": std,
        },
        "injection_type": "linear",
        "intermediate_size": inter,
        "mean_backprop_depth": 8,
        "mean_recurrence": mean_recurrence,
        "mlp_class_name": "GatedMLP",
        "model_type": "huginn_raven",
        "n_embd": embd,
        "n_heads": heads,
        "n_layers": prelude + core + coda,
        "n_layers_in_coda": coda,
        "n_layers_in_prelude": prelude,
        "n_layers_in_recurrent_block": core,
        "nonlin_name": "SiLU",
        "norm_class_name": "RMSNorm_llama",
        "norm_eps": 1e-06,
        "num_key_value_heads": heads,
        "padded_vocab_size": vocab,
        "padding_multiple": 128,
        "qk_bias": True,
        "rope_base": 50000,
        "sampling_scheme": "poisson-lognormal-filling",
        "state_init": "like-init",
        "tie_embeddings": True,
        "torch_dtype": "float32",
        "transformers_version": "4.44.2",
        "vocab_size": vocab,
        "bos_token_id": first,
        "eos_token_id": first + 1,
        "pad_token_id": first + 5,
    }


def huginn_layout(vocab: int, max_len: int) -> TokenizerLayout:
    first = vocab - len(HUGINN_SPECIALS)
    specials = tuple((first + i, s, True) for i, s in enumerate(HUGINN_SPECIALS))
    return TokenizerLayout(
        vocab,
        specials,
        bos="<|begin_text|>",
        eos="<|end_text|>",
        pad="<|pad|>",
        unk=None,
        chat_template=HUGINN_TEMPLATE,
        wrap_bos_eos=True,
        model_max_length=max_len,
    )


def nanbeige_config(
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    inter: int,
    vocab: int,
    *,
    num_loops: int,
    max_pos: int = 4096,
) -> dict[str, Any]:
    return {
        "architectures": ["NanbeigeForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_nanbeige.NanbeigeConfig",
            "AutoModelForCausalLM": "modeling_nanbeige.NanbeigeForCausalLM",
        },
        "model_type": "nanbeige",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_pos,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-05,
        "rope_theta": 70000000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "num_loops": num_loops,
        "skip_loop_final_norm": False,
        "loop_loss_weights": [],
        "loop_share_kv": False,
        "enable_double_loop_split": False,
        "loop_middle_layers": None,
        "enable_hyper_connection": False,
        "enable_mhc": False,
        "enable_h_res_identity": False,
        "enable_depth_attention": False,
        "qk_layernorm": False,
        "emb_neighbor_num": 0,
        "insert_ngram_layer_idx": None,
        "ngram_insert_all_layers": False,
        "layer_types": ["full_attention"] * layers,
        "bos_token_id": vocab - NANBEIGE_TAIL,
        "eos_token_id": vocab - NANBEIGE_TAIL + 1,
        "pad_token_id": 0,
        "use_cache": True,
        "torch_dtype": "float32",
        "transformers_version": "4.57.1",
    }


def nanbeige_layout(vocab: int, max_len: int) -> TokenizerLayout:
    first = vocab - NANBEIGE_TAIL
    specials = (
        (0, "<unk>", True),
        (first, "<|im_start|>", True),
        (first + 1, "<|im_end|>", True),
        (first + 2, "<think>", False),
        (first + 3, "</think>", False),
    ) + tuple((first + 4 + i, f"<|reserved_{i}|>", True) for i in range(NANBEIGE_TAIL - 4))
    return TokenizerLayout(
        vocab,
        specials,
        bos="<|im_start|>",
        eos="<|im_end|>",
        pad="<unk>",
        unk="<unk>",
        chat_template=CHATML_TEMPLATE,
        model_max_length=max_len,
    )
