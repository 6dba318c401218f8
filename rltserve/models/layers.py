"""Building blocks shared by the model families: RMSNorm, RoPE, the gated SiLU MLP, attention
projections.

Numerics follow the Hugging Face reference code bit for bit where it matters (MODELS.md §4.14):
- RMSNorm normalises in fp32, casts back to the model dtype, *then* multiplies by the weight.
- RoPE angles are ``position * inv_freq`` in fp32, computed on the fly (no cached table).
  The rotate-half form (Ouro, Nanbeige) casts cos/sin to the model dtype and rotates in that
  dtype; the interleaved form (Huginn) rotates in fp32 and casts the result back, as each
  reference does.
Everything here works on flattened token rows: ``[num_tokens, ...]``.
"""

from __future__ import annotations

import torch
from torch import nn

from rltserve import native as _native
from rltserve.models.base import AttentionFn

# On the CPU, MKL runs ``W @ X^T`` much faster than ``X @ W^T`` for the row counts of decode
# steps (1.3-8x at 2-256 rows on the ouro-small shapes; the lm_head is the extreme), and a single
# row is faster duplicated than through the matrix-vector path when the matrix is large.
_CPU_FAST_ROWS = 512
_CPU_GEMV_MAX_OUT = 4096


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for x: [M, K], weight: [N, K] -> [M, N] (no bias). Agrees with
    ``F.linear`` to rounding, not bit for bit, on the CPU fast path."""
    rows = x.shape[0]
    if x.device.type != "cpu" or x.dim() != 2 or not 0 < rows <= _CPU_FAST_ROWS:
        return torch.nn.functional.linear(x, weight)
    if rows == 1:
        if weight.shape[0] <= _CPU_GEMV_MAX_OUT:
            return torch.nn.functional.linear(x, weight)
        return torch.mm(weight, x.expand(2, -1).t())[:, :1].t().contiguous()
    return torch.mm(weight, x.t()).t().contiguous()  # [M, N]


class Linear(nn.Linear):
    """A bias-free ``nn.Linear`` (same parameter name, ``weight``) that uses ``linear``.
    Uninitialised, like every layer here (see ``Embedding``)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)

    def reset_parameters(self) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class BiasedLinear(nn.Linear):
    """``nn.Linear`` with a bias, uninitialised (see ``Embedding``)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=True)

    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    """``nn.Embedding`` without its random initialisation.

    Why: models are only ever built on the meta device and then filled from a checkpoint
    (``load_state_dict(assign=True)``), so an initialisation would be thrown away; worse, torch
    runs ``normal_`` on meta tensors through its Python reference ops, whose first use imports
    ``torch._dynamo`` (about 3 s of start-up). Invariant: every parameter is assigned from the
    checkpoint before the model is used.
    """

    def reset_parameters(self) -> None:
        pass


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)``."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_angles(positions: torch.Tensor, head_dim: int, base: float) -> torch.Tensor:
    """positions [N] int -> angles [N, head_dim // 2] fp32: ``pos * base^(-2i/head_dim)``."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device)
    inv_freq = 1.0 / (base ** (exponent / head_dim))  # [head_dim // 2]
    return positions.to(torch.float32)[:, None] * inv_freq[None, :]


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, base: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin of the RoPE angles: two [N, head_dim // 2] tensors."""
    angles = rope_angles(positions, head_dim, base)
    return angles.cos(), angles.sin()


def apply_rope_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX (non-interleaved) RoPE: ``x*cos + rotate_half(x)*sin`` with cos/sin in x's dtype.

    x: [N, heads, head_dim]; cos, sin: [N, head_dim // 2] fp32 (duplicated to full width here).
    """
    cos_full = torch.cat((cos, cos), dim=-1).to(x.dtype)[:, None, :]  # [N, 1, head_dim]
    sin_full = torch.cat((sin, sin), dim=-1).to(x.dtype)[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [N, heads, head_dim]
    return (x * cos_full) + (rotated * sin_full)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Complex-style RoPE on adjacent pairs (2i, 2i+1), computed in fp32, cast back to x's dtype.

    x: [N, heads, head_dim]; cos, sin: [N, head_dim // 2] fp32.
    """
    pairs = x.float().unflatten(-1, (-1, 2))  # [N, heads, head_dim // 2, 2]
    x0, x1 = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]  # [N, 1, head_dim // 2]
    out = torch.stack((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1)
    return out.flatten(-2).to(x.dtype)  # [N, heads, head_dim]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Gated SiLU on a fused input: [..., 2I] (gate first, then up) -> [..., I].

    Kept as one function so that a native kernel can replace it without touching model code:
    rltserve.native runs the fused extension when built, else ``F.silu(gate) * up`` (same bits).
    """
    return _native.silu_and_mul(x)


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one [2I, H] projection."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate)
        self.down_proj = Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


def split_qkv(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused projection [N, (heads + 2 * kv_heads) * head_dim] -> q [N, heads, head_dim],
    k and v [N, kv_heads, head_dim] (rows ordered q, k, v as in the checkpoints)."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
    return (
        q.unflatten(-1, (num_heads, head_dim)),
        k.unflatten(-1, (num_kv_heads, head_dim)),
        v.unflatten(-1, (num_kv_heads, head_dim)),
    )


class RotaryAttention(nn.Module):
    """Llama-style attention (Ouro, Nanbeige): fused bias-free q/k/v, rotate-half RoPE, GQA.

    The KV cache is not owned here: ``attn(layer, q, k, v)`` stores and attends (base.AttentionFn).
    """

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of {num_kv_heads=}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        qkv_out = (num_heads + 2 * num_kv_heads) * head_dim
        self.qkv_proj = Linear(hidden, qkv_out)
        self.o_proj = Linear(num_heads * head_dim, hidden)

    def forward(
        self,
        x: torch.Tensor,  # [N, hidden]
        cos: torch.Tensor,  # [N, head_dim // 2] fp32
        sin: torch.Tensor,
        attn: AttentionFn,
        layer: int,
    ) -> torch.Tensor:
        q, k, v = split_qkv(self.qkv_proj(x), self.num_heads, self.num_kv_heads, self.head_dim)
        q = apply_rope_rotate_half(q, cos, sin)  # [N, heads, head_dim]
        k = apply_rope_rotate_half(k, cos, sin)  # [N, kv_heads, head_dim]
        out = attn(layer, q, k, v)  # [N, heads, head_dim]
        return self.o_proj(out.flatten(-2))  # [N, hidden]


def fused_projection_sources(checkpoint_names: list[str]) -> dict[str, tuple[str, ...]]:
    """Module parameter name -> checkpoint tensors (concatenated along dim 0) for Llama-style
    checkpoints: ``q/k/v_proj`` feed ``qkv_proj`` and ``gate/up_proj`` feed ``gate_up_proj``
    (the fused parameters of ``RotaryAttention`` and ``GatedMLP``); other names map to themselves.
    """
    out: dict[str, tuple[str, ...]] = {}
    for name in checkpoint_names:
        if name.endswith(("k_proj.weight", "v_proj.weight", "up_proj.weight")):
            continue
        if name.endswith("q_proj.weight"):
            p = name[: -len("q_proj.weight")]
            out[p + "qkv_proj.weight"] = tuple(p + f"{x}_proj.weight" for x in "qkv")
        elif name.endswith("gate_proj.weight"):
            p = name[: -len("gate_proj.weight")]
            out[p + "gate_up_proj.weight"] = (p + "gate_proj.weight", p + "up_proj.weight")
        else:
            out[name] = (name,)
    return out
