"""Huginn-0125 (``model_type: "huginn_raven"``): prelude -> recurrent core -> coda (MODELS.md §2).

    e     = prelude_blocks(wte[ids] * embed_scale)           boundary layers 0..P-1
    s     = trunc_normal(σ, ±3σ) * embed_scale  (or zeros)  draw_noise / initial_state
    loop: s = core_blocks(adapter(cat[s, e]))                core layers 0..C-1
    h     = ln_f(coda_blocks(ln_f(s)))                       boundary layers P..P+K-1
    logits = h @ wte^T                                       tied head

Every block is a SandwichBlock whose norms act on the residual *sum*:
``x = norm_2(attn(norm_1(x)) + x); x = norm_4(mlp(norm_3(x)) + x)``. Attention is MHA with
``qk_bias`` added to q and k before the interleaved (complex-pair) RoPE, which is computed in fp32.
The checkpoint also stores ``lm_head.weight`` (a copy of ``wte``) and the ``freqs_cis`` buffer;
the loader checks the copy and ties it, and RoPE is recomputed from positions (``freqs_cis`` is
that table), so neither is a parameter and a checkpoint may leave either out (``tie_embeddings``
is always true here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rltserve.models import hfconfig as hc
from rltserve.models.base import AttentionFn, LoopedModel, LoopedSpec, noise_generator
from rltserve.models.layers import (
    Embedding,
    Linear,
    RMSNorm,
    apply_rope_interleaved,
    linear,
    rope_cos_sin,
    silu_and_mul,
    split_qkv,
)

FAMILY = "huginn_raven"
# Loops are unbounded in principle (quality saturates near 64); 256 bounds the KV planes.
MAX_LOOPS = 256
# The real tokenizer (65536 entries) ends text with <|end_text|> and chat turns with <|end_turn|>;
# the reference's generate (``_get_stops``) also stops at a new <|begin_text|>.
REAL_VOCAB = 65536
REAL_STOP_IDS = (65505, 65508, 65504)
# checkpoint-only tensors: the tied copy of the embedding and the precomputed RoPE table.
TIED = {"lm_head.weight": "transformer.wte.weight"}
BUFFERS = ("freqs_cis",)
_POSITIVE_INTS = (
    "padded_vocab_size n_embd n_heads head_dim intermediate_size block_size"
    " n_layers_in_recurrent_block mean_recurrence"
)
_FIXED = {  # config values other variants would use; only these are implemented
    "bias": False,
    "qk_bias": True,
    "tie_embeddings": True,
    "injection_type": "linear",
    "block_class_name": "SandwichBlock",
    "mlp_class_name": "GatedMLP",
    "nonlin_name": "SiLU",
    "norm_class_name": "RMSNorm_llama",
    "state_init": "like-init",
}


@dataclass(frozen=True)
class HuginnConfig:
    padded_vocab_size: int
    n_embd: int
    n_heads: int
    head_dim: int
    intermediate_size: int
    block_size: int
    n_layers_in_prelude: int
    n_layers_in_recurrent_block: int
    n_layers_in_coda: int
    mean_recurrence: int
    rope_base: float
    norm_eps: float
    embed_scale: float
    init_std: float
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        hc.check_ints(self, FAMILY, _POSITIVE_INTS)
        hc.check_ints(self, FAMILY, "n_layers_in_prelude n_layers_in_coda", minimum=0)
        hc.check_positives(self, FAMILY, "rope_base norm_eps embed_scale")
        if self.init_std != 0:  # 0 is allowed: the zero initial state
            hc.check_positive(self, FAMILY, "init_std")
        if self.n_heads * self.head_dim != self.n_embd:
            raise hc.bad(
                FAMILY, "head_dim", self.head_dim, f"n_heads * head_dim must equal {self.n_embd}"
            )
        if self.head_dim % 2:
            raise hc.bad(FAMILY, "head_dim", self.head_dim, "must be even (RoPE)")
        hc.check_token(self, FAMILY, "bos_token_id", self.padded_vocab_size)
        hc.check_token(self, FAMILY, "pad_token_id", self.padded_vocab_size)
        hc.check_tokens(self, FAMILY, "eos_token_ids", self.padded_vocab_size)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> HuginnConfig:
        def get(key: str, default: Any = hc._MISSING) -> Any:
            return hc.read(raw, FAMILY, key, default)

        hc.check_model_type(raw, FAMILY)
        hc.check_fixed(raw, FAMILY, _FIXED)
        if raw.get("test_time_noise"):
            raise hc.bad(FAMILY, "test_time_noise", raw["test_time_noise"], "must be 0")
        heads = get("n_heads")
        kv_heads = get("num_key_value_heads", heads)
        if kv_heads != heads:
            raise hc.bad(FAMILY, "num_key_value_heads", kv_heads, f"must equal n_heads={heads}")
        init = get("init_values")
        if not isinstance(init, dict) or "embed_scale" not in init or "std" not in init:
            raise hc.bad(FAMILY, "init_values", init, "needs 'embed_scale' and 'std'")
        counts = [get(f"n_layers_in_{g}") for g in ("prelude", "recurrent_block", "coda")]
        n_layers = get("n_layers", None)
        ints = all(isinstance(n, int) for n in counts)
        if n_layers is not None and ints and n_layers != sum(counts):
            raise hc.bad(FAMILY, "n_layers", n_layers, f"must equal {sum(counts)} (sum)")
        embd = get("n_embd")
        head_dim = get("head_dim", None)
        if head_dim is None and isinstance(embd, int) and isinstance(heads, int) and heads:
            head_dim = embd // heads
        return cls(
            padded_vocab_size=get("padded_vocab_size"),
            n_embd=embd,
            n_heads=heads,
            head_dim=head_dim,
            intermediate_size=get("intermediate_size"),
            block_size=get("block_size"),
            n_layers_in_prelude=counts[0],
            n_layers_in_recurrent_block=counts[1],
            n_layers_in_coda=counts[2],
            mean_recurrence=get("mean_recurrence"),
            rope_base=hc.read_rope_base(raw, FAMILY, "rope_base"),
            norm_eps=get("norm_eps"),
            embed_scale=init["embed_scale"],
            init_std=init["std"],
            bos_token_id=get("bos_token_id", None),
            eos_token_ids=hc.read_ids(raw, FAMILY, "eos_token_id"),
            pad_token_id=get("pad_token_id", None),
        )


def _as_config(cfg: HuginnConfig | dict[str, Any]) -> HuginnConfig:
    return cfg if isinstance(cfg, HuginnConfig) else HuginnConfig.from_dict(cfg)


def _group_sizes(c: HuginnConfig) -> dict[str, int]:
    """Checkpoint block groups in forward order -> number of blocks."""
    counts = (c.n_layers_in_prelude, c.n_layers_in_recurrent_block, c.n_layers_in_coda)
    return dict(zip(("prelude", "core_block", "coda"), counts))


def tensor_shapes(cfg: HuginnConfig | dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Exact checkpoint tensor names and shapes (MODELS.md §2.2), incl. the tied copy and buffer."""
    c = _as_config(cfg)
    e, inter, vocab, hd = c.n_embd, c.intermediate_size, c.padded_vocab_size, c.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "transformer.wte.weight": (vocab, e),
        "transformer.adapter.weight": (e, 2 * e),
        "transformer.ln_f.weight": (e,),
        "lm_head.weight": (vocab, e),
        "freqs_cis": (1, c.block_size, 1, hd // 2, 2),
    }
    for group, count in _group_sizes(c).items():
        for i in range(count):
            p = f"transformer.{group}.{i}."
            for norm in ("norm_1", "norm_2", "norm_3", "norm_4"):
                shapes[p + norm + ".weight"] = (e,)
            shapes[p + "attn.Wqkv.weight"] = (3 * e, e)
            shapes[p + "attn.qk_bias"] = (2, 1, c.n_heads, hd)
            shapes[p + "attn.proj.weight"] = (e, e)
            shapes[p + "mlp.fc.weight"] = (2 * inter, e)
            shapes[p + "mlp.proj.weight"] = (e, inter)
    return shapes


def freqs_cis(cfg: HuginnConfig | dict[str, Any]) -> torch.Tensor:
    """The checkpoint's ``freqs_cis`` buffer, [1, block_size, 1, head_dim // 2, 2] fp32 (cos, sin),
    from the config: the RoPE the forward computes (``rope_cos_sin``) at every position."""
    c = _as_config(cfg)
    cos, sin = rope_cos_sin(torch.arange(c.block_size), c.head_dim, c.rope_base)
    return torch.stack((cos, sin), dim=-1)[None, :, None]


def param_sources(cfg: HuginnConfig | dict[str, Any]) -> dict[str, tuple[str, ...]]:
    """Module parameter name -> checkpoint tensor (names match; the tied copy and the RoPE buffer
    are checkpoint-only, see ``TIED`` and ``BUFFERS``)."""
    skip = set(TIED) | set(BUFFERS)
    return {name: (name,) for name in tensor_shapes(cfg) if name not in skip}


class HuginnAttention(nn.Module):
    def __init__(self, c: HuginnConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = c.n_heads, c.head_dim
        self.Wqkv = Linear(c.n_embd, 3 * c.n_embd)
        self.qk_bias = nn.Parameter(torch.zeros(2, 1, c.n_heads, c.head_dim))
        self.proj = Linear(c.n_embd, c.n_embd)

    def forward(
        self,
        x: torch.Tensor,  # [N, E]
        cos: torch.Tensor,  # [N, head_dim // 2] fp32
        sin: torch.Tensor,
        attn: AttentionFn,
        layer: int,
    ) -> torch.Tensor:
        q, k, v = split_qkv(self.Wqkv(x), self.n_heads, self.n_heads, self.head_dim)
        q = apply_rope_interleaved(q + self.qk_bias[0], cos, sin)  # [N, heads, head_dim]
        k = apply_rope_interleaved(k + self.qk_bias[1], cos, sin)
        return self.proj(attn(layer, q, k, v).flatten(-2))  # [N, E]


class HuginnMLP(nn.Module):
    def __init__(self, c: HuginnConfig) -> None:
        super().__init__()
        self.fc = Linear(c.n_embd, 2 * c.intermediate_size)  # [gate; up]
        self.proj = Linear(c.intermediate_size, c.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(silu_and_mul(self.fc(x)))


class SandwichBlock(nn.Module):
    def __init__(self, c: HuginnConfig) -> None:
        super().__init__()
        self.norm_1 = RMSNorm(c.n_embd, c.norm_eps)
        self.attn = HuginnAttention(c)
        self.norm_2 = RMSNorm(c.n_embd, c.norm_eps)
        self.norm_3 = RMSNorm(c.n_embd, c.norm_eps)
        self.mlp = HuginnMLP(c)
        self.norm_4 = RMSNorm(c.n_embd, c.norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn, layer: int
    ) -> torch.Tensor:
        x = self.norm_2(self.attn(self.norm_1(x), cos, sin, attn, layer) + x)
        return self.norm_4(self.mlp(self.norm_3(x)) + x)  # [N, E]


class HuginnTransformer(nn.Module):
    """The ``transformer.`` prefix of the checkpoint."""

    def __init__(self, c: HuginnConfig) -> None:
        super().__init__()
        sizes = _group_sizes(c)
        self.wte = Embedding(c.padded_vocab_size, c.n_embd)
        self.prelude = nn.ModuleList(SandwichBlock(c) for _ in range(sizes["prelude"]))
        self.adapter = Linear(2 * c.n_embd, c.n_embd)
        self.core_block = nn.ModuleList(SandwichBlock(c) for _ in range(sizes["core_block"]))
        self.coda = nn.ModuleList(SandwichBlock(c) for _ in range(sizes["coda"]))
        self.ln_f = RMSNorm(c.n_embd, c.norm_eps)


class HuginnModel(LoopedModel):
    def __init__(self, config: HuginnConfig) -> None:
        super().__init__()
        c = self.config = config
        self.transformer = HuginnTransformer(c)
        eos = c.eos_token_ids
        if c.padded_vocab_size == REAL_VOCAB:
            eos += tuple(t for t in REAL_STOP_IDS if t not in eos)
        self.spec = LoopedSpec(
            family=FAMILY,
            vocab_size=c.padded_vocab_size,
            hidden_size=c.n_embd,
            state_size=c.n_embd,
            num_loops=c.mean_recurrence,
            max_loops=max(MAX_LOOPS, c.mean_recurrence),
            num_core_layers=c.n_layers_in_recurrent_block,
            num_boundary_layers=c.n_layers_in_prelude + c.n_layers_in_coda,
            num_heads=c.n_heads,
            num_kv_heads=c.n_heads,
            head_dim=c.head_dim,
            max_position=c.block_size,
            has_gate=False,
            needs_noise=True,
            bos_token_id=c.bos_token_id,
            eos_token_ids=eos,
            pad_token_id=c.pad_token_id,
        )

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_base)

    def prelude(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn | None
    ) -> torch.Tensor:
        x = self.transformer.wte(input_ids) * self.config.embed_scale  # [N, E]
        if len(self.transformer.prelude):
            assert attn is not None, "Huginn's prelude has attention layers"
            cos, sin = self._rope(positions)
            for i, block in enumerate(self.transformer.prelude):
                x = block(x, cos, sin, attn, i)
        return x

    def draw_noise(self, seed: int | None, positions: list[int]) -> torch.Tensor:
        """Trunc-normal(0, σ, ±3σ) * embed_scale per position, each from its own generator."""
        out = torch.zeros(len(positions), self.spec.state_size, dtype=torch.float32)  # [N, S]
        std = self.config.init_std
        if seed is None or std == 0:
            return out
        for row, pos in zip(out, positions):
            gen = noise_generator(seed, pos)
            nn.init.trunc_normal_(row, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=gen)
        return out * self.config.embed_scale

    def initial_state(self, e: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        if noise is None:
            return torch.zeros_like(e)
        return noise.to(device=e.device, dtype=e.dtype)  # [N, S]

    def loop(
        self, state: torch.Tensor, e: torch.Tensor, positions: torch.Tensor, attn: AttentionFn
    ) -> torch.Tensor:
        cos, sin = self._rope(positions)
        x = self.transformer.adapter(torch.cat((state, e), dim=-1))  # [N, 2E] -> [N, E]
        for i, block in enumerate(self.transformer.core_block):
            x = block(x, cos, sin, attn, i)
        return x

    def coda(
        self, state: torch.Tensor, positions: torch.Tensor, attn: AttentionFn | None
    ) -> torch.Tensor:
        x = self.transformer.ln_f(state)
        if len(self.transformer.coda):
            assert attn is not None, "Huginn's coda has attention layers"
            cos, sin = self._rope(positions)
            first = self.config.n_layers_in_prelude
            for i, block in enumerate(self.transformer.coda):
                x = block(x, cos, sin, attn, first + i)
        return self.transformer.ln_f(x)  # [N, E]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.transformer.wte.weight).float()  # [N, vocab]
