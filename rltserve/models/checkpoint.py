"""Synthetic weights for ``make_model``: values shaped like a trained looped model, and a streaming
safetensors writer.

Value scheme (why): random Gaussian weights make every loop scramble the state, so depth-dependent
features (adaptive exit, self-speculation, KV policies) would be meaningless. Instead:

- **Attractor MLPs.** Every layer's gate/up rows are noisy copies of one shared set of unit
  "pattern" directions ``P`` ([I, H]) and ``down = P^T``. ``down(silu(P x) * (P x))`` pushes the
  state toward the patterns it already resembles most, so each loop moves the state less than the
  one before (logits converge with depth, as in a trained model) while different tokens settle on
  different patterns (varied outputs).
- **Small residual branches.** Ouro's post-sublayer norms (``*_2``) and Nanbeige's output
  projections are scaled so a whole loop is a modest step; ``model.norm`` keeps the scale.
  Attention (near-uniform, small) mixes in context.
- **Ouro gate.** A "confidence" direction ``m``, orthogonal to the patterns and to the
  ``lm_head`` rows, receives a positive share of every MLP output, so the post-norm state's
  ``cos(h, m)`` builds up over loops without touching the logits. The gate reads it
  (``GATE_SCALE * cos + GATE_BIAS`` plus a random direction for per-token variation), so
  ``λ = sigmoid(gate)`` rises with depth and exit depths spread over 1..T for thresholds 0.3-0.8.
- **Peaked, varied outputs.** ``lm_head`` row ``v`` leans toward pattern ``v mod I``: a settled
  state gives a peaked distribution, different inputs settle differently. Byte and special
  tokens get weaker rows so greedy text is made of word tokens.
- **Huginn.** The adapter contracts the state (``0.6 s``) and injects a rotated copy of the
  prelude output, so the recurrence converges to a token-dependent fixed point; the rotation
  keeps the tied head from predicting the input token.

Each tensor draws from its own generator seeded by ``(seed, name)``; shared directions from
``(seed, "shared:<what>")``. Values are therefore independent of write order and identical for a
given seed on a given machine and torch build (float reductions are not promised to match bit
for bit across BLAS builds). Tensors are produced and written one at a time, so multi-GB presets
never sit in memory twice. All knobs below are in dimension-free units (rms, cosines, per-loop
totals split over the layers), so the tiny, small and real-shape presets behave alike.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
# Ouro / Nanbeige knobs (see module docstring); fractions are per loop, split over the layers.
ATTN_STEP = 0.3  # Ouro: total input_layernorm_2 weight per loop
QK_SCALE = 0.5  # q/k projection gain: attention logits ~ N(0, QK_SCALE^4 * head_dim)-ish
MLP_STEP = 0.6  # Ouro: total post_attention_layernorm_2 weight per loop
PATTERN_GAIN = 3.0  # gate/up = gain * pattern: z ~ N(0, gain^2) for an unrelated state
PATTERN_NOISE = 0.35  # per-layer deviation of gate/up/down rows from the shared patterns
CONFIDENCE = 4.0  # Ouro: share of every MLP output written along m
LM_ALIGN = 2.0  # lm_head row v leans toward pattern v mod I
GATE_SCALE, GATE_BIAS, GATE_NOISE = 5.0, -2.8, 1.0  # Ouro gate = scale*cos(h, m) + bias + noise
LM_SCALE = 2.0  # logit std for a unit-rms state
OTHER_ROWS = 0.5  # head row scale of byte and special tokens (see Draws.head_rows)
HUGINN_WTE = 4.0  # Huginn tied embedding/head: logit std for a unit-rms state
HUGINN_KEEP, HUGINN_INJECT = 0.6, 0.5  # Huginn adapter: state contraction, injection gain


def tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class Draws:
    """Per-name Gaussian draws (order-independent), cached shared directions, and ``words``: a
    [V] bool mask of the tokenizer's multi-byte "word" tokens (None: all ids)."""

    def __init__(self, seed: int, words: torch.Tensor | None = None) -> None:
        self.seed = seed
        self.words = words
        self._shared: dict[str, torch.Tensor] = {}

    def word_mask(self, vocab: int) -> torch.Tensor:
        """[V] bool: rows of output heads that may lean toward the patterns. Other ids (raw
        bytes, specials) get weaker rows (``OTHER_ROWS``), so they rarely win the argmax and
        generated text reads like words."""
        if self.words is None:
            return torch.ones(vocab, dtype=torch.bool)
        if self.words.shape != (vocab,):
            raise ValueError(f"words mask has shape {tuple(self.words.shape)}, want ({vocab},)")
        return self.words

    def head_rows(self, vocab: int) -> torch.Tensor:
        """[V, 1] row scale of an output head (see ``word_mask``)."""
        return torch.where(self.word_mask(vocab), 1.0, OTHER_ROWS)[:, None]

    def randn(self, name: str, *shape: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(tensor_seed(self.seed, name))
        return torch.randn(*shape, generator=gen, dtype=torch.float32)

    def shared(self, what: str, make: Callable[[torch.Tensor], torch.Tensor], *shape: int):
        if what not in self._shared:
            self._shared[what] = make(self.randn("shared:" + what, *shape))
        return self._shared[what]


def _unit_rows(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def _patterns(d: Draws, inter: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(P [I, H] unit rows orthogonal to m, m [H] unit: the "confidence" direction)."""
    m = d.shared("confidence", lambda r: r / r.norm(), hidden)

    def make(r: torch.Tensor) -> torch.Tensor:
        return _unit_rows(r - (r @ m)[:, None] * m[None, :])

    return d.shared("patterns", make, inter, hidden), m


def _noisy(d: Draws, name: str, base: torch.Tensor) -> torch.Tensor:
    noise = d.randn(name, *base.shape) / math.sqrt(base.shape[-1])
    return _unit_rows(base + PATTERN_NOISE * noise)


def _norm_weight(d: Draws, name: str, size: int, mean: float, rel: float = 0.05) -> torch.Tensor:
    return mean * (1 + rel * d.randn(name, size))


def llama_value(d: Draws, cfg: dict, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """One Ouro or Nanbeige tensor (the two share names and layer shapes)."""
    ouro = cfg["model_type"] == "ouro"
    hidden, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    base = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name
    if name == "model.embed_tokens.weight":
        return d.randn(name, *shape)
    if name == "lm_head.weight":
        p, m = _patterns(d, inter, hidden)
        # Row v leans toward pattern v mod I (word tokens only) and ignores m, so a settled
        # state gives a peaked distribution and the confidence direction leaves logits alone.
        own = p[torch.arange(shape[0]) % inter] * (LM_ALIGN * math.sqrt(hidden))
        own *= d.word_mask(shape[0])[:, None]
        w = (d.randn(name, *shape) + own) * d.head_rows(shape[0])
        del own
        w -= (w @ m)[:, None] * m[None, :]
        return w * (LM_SCALE / math.sqrt(hidden))
    if name == "model.early_exit_gate.weight":
        _, m = _patterns(d, inter, hidden)
        noise = d.randn(name, hidden) * (GATE_NOISE / math.sqrt(hidden))
        return ((GATE_SCALE / math.sqrt(hidden)) * m + noise)[None, :]
    if name == "model.early_exit_gate.bias":
        return torch.tensor([GATE_BIAS])
    if base in ("input_layernorm", "post_attention_layernorm", "norm"):
        return _norm_weight(d, name, hidden, 1.0)
    if base == "input_layernorm_2":
        return _norm_weight(d, name, hidden, ATTN_STEP / layers, 0.1)
    if base == "post_attention_layernorm_2":
        return _norm_weight(d, name, hidden, MLP_STEP / layers, 0.1)
    if base in ("q_proj", "k_proj"):
        return d.randn(name, *shape) * (QK_SCALE / math.sqrt(shape[1]))
    if base == "v_proj":
        return d.randn(name, *shape) / math.sqrt(shape[1])
    if base == "o_proj":
        # Nanbeige has no post-norm: the projection itself sets the branch size.
        scale = 1.0 if ouro else ATTN_STEP / layers
        return d.randn(name, *shape) * (scale / math.sqrt(shape[1]))
    p, _ = _patterns(d, inter, hidden)
    if base in ("gate_proj", "up_proj"):
        return PATTERN_GAIN * _noisy(d, name, p)
    if base == "down_proj":
        scale = 1.0 / math.sqrt(inter) if ouro else MLP_STEP / (layers * math.sqrt(inter))
        w = _noisy(d, name, p).T
        if ouro:  # every MLP output also points along m by an amount that is always positive
            _, m = _patterns(d, inter, hidden)
            w = w + (CONFIDENCE / math.sqrt(inter)) * m[:, None]
        return w.contiguous() * scale
    raise KeyError(f"no value rule for {name}")


def huginn_value(d: Draws, cfg: dict, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """One Huginn tensor: contracting adapter, near-identity sandwich blocks, tied head."""
    e = cfg["n_embd"]
    out_std = cfg["init_values"]["out_proj"]
    if name in ("transformer.wte.weight", "lm_head.weight"):  # tied: same draw for both
        rows = d.head_rows(shape[0])
        return d.randn("transformer.wte.weight", *shape) * rows * (HUGINN_WTE / math.sqrt(e))
    if name == "freqs_cis":
        hd, base = cfg["head_dim"], float(cfg["rope_base"])
        inv = 1.0 / (base ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        f = torch.outer(torch.arange(cfg["block_size"], dtype=torch.float32), inv)
        return torch.stack([f.cos(), f.sin()], dim=-1)[None, :, None].contiguous()
    if name == "transformer.adapter.weight":  # s' = KEEP s + INJECT R e (+ small noise)
        rot = d.shared("rotation", lambda r: torch.linalg.qr(r)[0], e, e)
        keep = HUGINN_KEEP * torch.eye(e) + d.randn(name + ":state", e, e) * (0.1 / math.sqrt(e))
        return torch.cat([keep, HUGINN_INJECT * rot], dim=1)
    base = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
    if base.startswith("norm_") or base == "ln_f":
        return _norm_weight(d, name, e, 1.0)
    if base == "qk_bias":
        return 0.1 * d.randn(name, *shape)
    if base == "Wqkv":
        return d.randn(name, *shape) * (0.7 / math.sqrt(e))
    if base == "fc":
        return d.randn(name, *shape) / math.sqrt(e)
    if base == "proj":
        return d.randn(name, *shape) * (out_std * 4)
    raise KeyError(f"no value rule for {name}")


def synth_tensors(
    cfg: dict,
    shapes: dict[str, tuple[int, ...]],
    seed: int,
    words: torch.Tensor | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, fp32 tensor) for every checkpoint tensor, in sorted name order (see ``Draws``)."""
    value = huginn_value if cfg["model_type"] == "huginn_raven" else llama_value
    d = Draws(seed, words)
    for name in sorted(shapes):
        t = value(d, cfg, name, shapes[name])
        if tuple(t.shape) != tuple(shapes[name]):
            raise AssertionError(f"{name}: built {tuple(t.shape)}, want {shapes[name]}")
        yield name, t


def write_safetensors(
    path: Path,
    shapes: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    tensors: Iterator[tuple[str, torch.Tensor]],
) -> None:
    """Streams ``tensors`` (in sorted name order, one at a time) into a safetensors file.

    The header is computed from ``shapes`` up front; each tensor is cast to ``dtype`` and written
    immediately. Output bytes depend only on names, shapes, dtype and values.
    """
    size = torch.empty((), dtype=dtype).element_size()
    names = sorted(shapes)
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        nbytes = math.prod(shapes[name]) * size
        entry = {"dtype": ST_DTYPES[dtype], "shape": list(shapes[name])}
        header[name] = {**entry, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for want, (name, t) in zip(names, tensors, strict=True):
            if name != want:
                raise AssertionError(f"tensor order: got {name}, want {want}")
            flat = t.to(dtype).contiguous().reshape(-1).view(torch.uint8)
            f.write(flat.numpy().data)
    os.replace(tmp, path)
