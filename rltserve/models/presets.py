"""Synthetic checkpoint presets and ``make_model``, which writes a complete checkpoint directory.

A written directory looks like a real one of its family: ``config.json`` with the real key names
(MODELS.md §1.2, §2.1, §3), ``model.safetensors`` with the real tensor names (from the family's
``tensor_shapes``), and a locally trained tokenizer (``tokenizer.json``, ``tokenizer_config.json``
with a chat template, ``special_tokens_map.json``) whose special tokens sit at the family's ids,
scaled to the preset's vocabulary. Weights are synthetic (``checkpoint`` explains the scheme);
nothing is downloaded.

Special ids: Ouro ``<|endoftext|>``=0, ``<|im_start|>``=1, ``<|im_end|>``=2, ``<think>``=3,
``</think>``=4, config bos=eos=0 as upstream (§1.7). Huginn: the 32 specials occupy the last 32
ids (``<|begin_text|>`` = V-32, as 65504 = 65536-32). Nanbeige: pad=0 (``<unk>``), bos=V-44,
eos=V-43 (as 166100/166101 of 166144); which strings sit there upstream is not verified, so
``<|im_start|>``/``<|im_end|>`` are used.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rltserve.models import toktrain
from rltserve.models.preset_configs import (
    huginn_config,
    huginn_layout,
    nanbeige_config,
    nanbeige_layout,
    ouro_config,
    ouro_layout,
)

if TYPE_CHECKING:
    import torch

# The presets' weight dtypes. Listing them by name keeps this module (imported by the command
# line to list the presets) free of torch; ``make_model`` imports it.
DTYPES = ("float32", "bfloat16")
# What make_model replaces in its directory: a checkpoint's files (a stale shard index or
# tokenizer left beside new weights would change what loads). Nothing else there is touched.
CHECKPOINT_FILES = (
    "config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
SHARD_PATTERN = "model-*-of-*.safetensors"


@dataclass(frozen=True)
class PresetSpec:
    """A named checkpoint recipe. The config is kept as JSON text so the spec stays immutable;
    ``config()`` returns a fresh dict."""

    name: str
    description: str
    config_json: str
    layout: toktrain.TokenizerLayout

    def __post_init__(self) -> None:
        cfg = self.config()
        if cfg.get("torch_dtype") not in DTYPES:
            raise ValueError(f"preset {self.name}: torch_dtype must be one of {sorted(DTYPES)}")
        vocab = cfg.get("padded_vocab_size", cfg.get("vocab_size"))
        if vocab != self.layout.vocab_size:
            raise ValueError(f"preset {self.name}: tokenizer size != vocab {vocab}")
        max_pos = cfg.get("max_position_embeddings", cfg.get("block_size"))
        if max_pos != self.layout.model_max_length:
            raise ValueError(f"preset {self.name}: tokenizer model_max_length != {max_pos}")

    def config(self) -> dict[str, Any]:
        return json.loads(self.config_json)

    @property
    def family(self) -> str:
        return str(self.config()["model_type"])

    @property
    def dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.config()["torch_dtype"])

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        from rltserve.models.registry import get_family

        fam = get_family(self.family)
        return dict(fam.tensor_shapes(fam.parse_config(self.config())))

    def num_parameters(self) -> int:
        """Parameters as a model card counts them (no tied copy, no RoPE buffer)."""
        from rltserve.models.registry import get_family

        fam = get_family(self.family)
        skip = set(fam.tied) | set(fam.buffers)
        shapes = self.tensor_shapes()
        return sum(_numel(s) for n, s in shapes.items() if n not in skip)


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _preset(name: str, description: str, cfg: dict[str, Any], layout) -> PresetSpec:
    return PresetSpec(name, description, json.dumps(cfg), layout)


PRESETS: dict[str, PresetSpec] = {
    p.name: p
    for p in (
        _preset(
            "ouro-tiny",
            "tests: hidden 64, 2 layers, GQA 4/2, vocab 512, 4 loops (fp32)",
            ouro_config(64, 2, 4, 2, 16, 160, 512, max_pos=2048, dtype="float32"),
            ouro_layout(512, 2048),
        ),
        _preset(
            "ouro-demo",
            "built-in demo: hidden 128, 4 layers, GQA 4/2, vocab 4096, 4 loops (fp32, ~7 MB)",
            ouro_config(128, 4, 4, 2, 32, 352, 4096, max_pos=4096, dtype="float32"),
            ouro_layout(4096, 4096),
        ),
        _preset(
            "ouro-small",
            "CPU benchmarks: hidden 512, 8 layers, 8 heads, vocab 8192, 4 loops (fp32)",
            ouro_config(512, 8, 8, 8, 64, 1408, 8192, max_pos=4096, dtype="float32"),
            ouro_layout(8192, 4096),
        ),
        _preset(
            "ouro-1.4b",
            "real Ouro-1.4B shapes (1,434,652,673 params, bf16, ~2.9 GB)",
            ouro_config(2048, 24, 16, 16, 128, 5632, 49152, max_pos=65536, dtype="bfloat16"),
            ouro_layout(49152, 65536),
        ),
        _preset(
            "ouro-2.6b",
            "real Ouro-2.6B shapes (2,667,974,657 params, bf16, ~5.3 GB)",
            ouro_config(2048, 48, 16, 16, 128, 5632, 49152, max_pos=65536, dtype="bfloat16"),
            ouro_layout(49152, 65536),
        ),
        _preset(
            "huginn-tiny",
            "tests: n_embd 64, 4 heads, prelude/core/coda 2/2/2, vocab 512, 4 loops (fp32)",
            huginn_config(64, 4, 16, 160, 512, (2, 2, 2), mean_recurrence=4, block_size=1024),
            huginn_layout(512, 1024),
        ),
        _preset(
            "nanbeige-tiny",
            "tests: hidden 64, 2 layers, GQA 4/2, head_dim 32, vocab 512, 2 loops (fp32)",
            nanbeige_config(64, 2, 4, 2, 32, 224, 512, num_loops=2),
            nanbeige_layout(512, 4096),
        ),
    )
}


def get_preset(name: str) -> PresetSpec:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from: {', '.join(PRESETS)}")
    return PRESETS[name]


def make_model(
    preset: str | PresetSpec, out_dir: str | Path, seed: int = 0, tokenizer: bool = True
) -> Path:
    """Writes the checkpoint directory for ``preset`` into ``out_dir`` and returns its path.

    Deterministic: the same preset and seed give byte-identical files. ``tokenizer=False`` writes
    weights and config only (a checkpoint that must run on token-id prompts). A checkpoint
    already in ``out_dir`` is replaced (``CHECKPOINT_FILES`` and shards), once the arguments are
    checked; other files there are left alone.
    """
    import torch

    from rltserve.models.checkpoint import synth_tensors, write_safetensors

    spec = get_preset(preset) if isinstance(preset, str) else preset
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in [*(out / name for name in CHECKPOINT_FILES), *out.glob(SHARD_PATTERN)]:
        if old.is_file():
            old.unlink()
    cfg = spec.config()
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    shapes = spec.tensor_shapes()
    words = torch.zeros(spec.layout.vocab_size, dtype=torch.bool)
    words[spec.layout.word_ids()] = True
    tensors = synth_tensors(cfg, shapes, seed, words)
    write_safetensors(out / "model.safetensors", shapes, spec.dtype, tensors)
    if tokenizer:
        toktrain.write_tokenizer(spec.layout, out)
    return out


def add_make_model_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``rltserve make-model``."""
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS), help="model preset")
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument("--no-tokenizer", action="store_true", help="write no tokenizer files")
    parser.add_argument(
        "--force",
        action="store_true",
        help="write into a non-empty --out (a checkpoint there is replaced, other files kept)",
    )


def run_make_model(args: argparse.Namespace) -> int:
    """Runs ``make-model``; returns the process exit code."""
    out: Path = args.out
    if out.exists() and any(out.iterdir()) and not args.force:
        print(f"error: {out} is not empty (use --force to write into it)")
        return 2
    path = make_model(args.preset, out, seed=args.seed, tokenizer=not args.no_tokenizer)
    spec = get_preset(args.preset)
    print(f"wrote {spec.name} ({spec.num_parameters():,} parameters) to {path}")
    return 0
