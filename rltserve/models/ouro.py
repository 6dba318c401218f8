"""ByteDance Ouro (``model_type: "ouro"``): a sandwich-norm decoder looped ``total_ut_steps`` times.

Forward (MODELS.md §1.4): ``h = embed[ids]`` (no scale); each loop runs every layer as
``h += norm_in2(attn(norm_in(h)))``, ``h += norm_post2(mlp(norm_post(h)))`` and then ``model.norm``;
that normed state feeds the next loop, the exit gate ``Linear(H -> 1) + bias`` and ``lm_head``.
The prelude is the embedding and the coda is the identity, so ``state_size == hidden_size``.
RoPE is rotate-half over the full head_dim with the same positions in every loop.

Module parameters mirror checkpoint names except that q/k/v are fused into ``qkv_proj`` and
gate/up into ``gate_up_proj`` (``param_sources`` says which checkpoint tensors feed which).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rltserve.models import hfconfig as hc
from rltserve.models.base import AttentionFn, LoopedModel, LoopedSpec
from rltserve.models.layers import (
    BiasedLinear,
    Embedding,
    GatedMLP,
    Linear,
    RMSNorm,
    RotaryAttention,
    fused_projection_sources,
    rope_cos_sin,
)

FAMILY = "ouro"
# <|endoftext|> and <|im_end|>: the upstream config says eos=0 but chat ends with 2 (§1.7).
CHAT_STOP_IDS = (0, 2)
_POSITIVE_INTS = (
    "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads"
    " num_key_value_heads head_dim max_position_embeddings total_ut_steps"
)
_FIXED = {
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "early_exit_step": None,
}
NORMS = (
    "input_layernorm",
    "input_layernorm_2",
    "post_attention_layernorm",
    "post_attention_layernorm_2",
)
log = logging.getLogger(__name__)
_warned_thresholds: set[float] = set()  # early_exit_threshold values already warned about


@dataclass(frozen=True)
class OuroConfig:
    """The config.json fields Ouro uses. Unsupported variants are rejected in ``from_dict``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    total_ut_steps: int
    # Hugging Face's forward defaults its exit threshold to this; rltserve's requests do not
    # (``warn_unapplied_threshold``). Every real checkpoint has 1.0 (full depth).
    early_exit_threshold: float = 1.0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        hc.check_ints(self, FAMILY, _POSITIVE_INTS)
        hc.check_positives(self, FAMILY, "rms_norm_eps rope_theta early_exit_threshold")
        hc.check_decoder(self, FAMILY)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> OuroConfig:
        def get(key: str, default: Any = hc._MISSING) -> Any:
            return hc.read(raw, FAMILY, key, default)

        hc.check_model_type(raw, FAMILY)
        hc.check_fixed(raw, FAMILY, _FIXED)
        hidden, heads = get("hidden_size"), get("num_attention_heads")
        layers = get("num_hidden_layers")
        hc.check_full_attention(FAMILY, raw.get("layer_types"), layers)
        head_dim = get("head_dim", None)
        if head_dim is None and isinstance(hidden, int) and isinstance(heads, int) and heads:
            head_dim = hidden // heads
        return cls(
            vocab_size=get("vocab_size"),
            hidden_size=hidden,
            intermediate_size=get("intermediate_size"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=get("num_key_value_heads", heads),
            head_dim=head_dim,
            max_position_embeddings=get("max_position_embeddings"),
            rms_norm_eps=get("rms_norm_eps"),
            rope_theta=hc.read_rope_base(raw, FAMILY),
            total_ut_steps=get("total_ut_steps"),
            early_exit_threshold=get("early_exit_threshold", 1.0),
            bos_token_id=get("bos_token_id", None),
            eos_token_ids=hc.read_ids(raw, FAMILY, "eos_token_id"),
            pad_token_id=get("pad_token_id", None),
        )


def warn_unapplied_threshold(c: OuroConfig) -> None:
    """Warn (once per value and process) that config.json's ``early_exit_threshold`` < 1 is not
    the requests' default. Hugging Face's forward uses it when a call passes no threshold
    (MODELS.md §1.5); rltserve's ``exit_threshold`` default stays 1.0 (full depth) wherever a
    request leaves it out, as its adaptive exit is not Hugging Face's (a token stops looping
    and its deeper KV follows ``kv_policy``; HF runs every loop and only picks the output),
    so depth stays each request's explicit choice. A value >= 1 means full depth in both."""
    value = c.early_exit_threshold
    if value >= 1.0 or value in _warned_thresholds:
        return
    _warned_thresholds.add(value)
    log.warning(
        "config.json early_exit_threshold=%s is not applied: requests run full depth unless they "
        "set exit_threshold (e.g. SamplingParams(exit_threshold=%s) or the HTTP field)",
        value,
        value,
    )


def _as_config(cfg: OuroConfig | dict[str, Any]) -> OuroConfig:
    return cfg if isinstance(cfg, OuroConfig) else OuroConfig.from_dict(cfg)


def tensor_shapes(cfg: OuroConfig | dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Exact checkpoint tensor names and shapes (MODELS.md §1.3)."""
    c = _as_config(cfg)
    h, inter, vocab = c.hidden_size, c.intermediate_size, c.vocab_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, h),
        "model.norm.weight": (h,),
        "model.early_exit_gate.weight": (1, h),
        "model.early_exit_gate.bias": (1,),
        "lm_head.weight": (vocab, h),
    }
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
        for norm in NORMS:
            shapes[p + norm + ".weight"] = (h,)
    return shapes


def param_sources(cfg: OuroConfig | dict[str, Any]) -> dict[str, tuple[str, ...]]:
    """Module parameter name -> checkpoint tensors concatenated along dim 0 to form it."""
    return fused_projection_sources(list(tensor_shapes(cfg)))


class OuroDecoderLayer(nn.Module):
    """Sandwich layer: the post-norms act on the sublayer output before the residual add."""

    def __init__(self, c: OuroConfig) -> None:
        super().__init__()
        h, eps = c.hidden_size, c.rms_norm_eps
        self.self_attn = RotaryAttention(
            h, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        )
        self.mlp = GatedMLP(h, c.intermediate_size)
        self.input_layernorm = RMSNorm(h, eps)
        self.input_layernorm_2 = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm_2 = RMSNorm(h, eps)

    def forward(
        self,
        h: torch.Tensor,  # [N, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionFn,
        layer: int,
    ) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(h), cos, sin, attn, layer)
        h = h + self.input_layernorm_2(a)
        m = self.mlp(self.post_attention_layernorm(h))
        return h + self.post_attention_layernorm_2(m)  # [N, hidden]


class OuroBody(nn.Module):
    """The ``model.`` prefix of the checkpoint."""

    def __init__(self, c: OuroConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(OuroDecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.early_exit_gate = BiasedLinear(c.hidden_size, 1)


class OuroModel(LoopedModel):
    def __init__(self, config: OuroConfig) -> None:
        super().__init__()
        c = self.config = config
        warn_unapplied_threshold(c)
        self.model = OuroBody(c)
        self.lm_head = Linear(c.hidden_size, c.vocab_size)
        eos = CHAT_STOP_IDS + tuple(t for t in c.eos_token_ids if t not in CHAT_STOP_IDS)
        self.spec = LoopedSpec(
            family=FAMILY,
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            state_size=c.hidden_size,
            num_loops=c.total_ut_steps,
            # total_ut_steps is a runtime knob (T=1..8 was evaluated); allow up to twice it.
            max_loops=2 * c.total_ut_steps,
            num_core_layers=c.num_hidden_layers,
            num_boundary_layers=0,
            num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            max_position=c.max_position_embeddings,
            has_gate=True,
            needs_noise=False,
            bos_token_id=c.bos_token_id,
            eos_token_ids=tuple(t for t in eos if t < c.vocab_size),
            pad_token_id=c.pad_token_id,
        )

    def prelude(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn | None
    ) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)  # [N, hidden]

    def initial_state(self, e: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        return e

    def loop(
        self, state: torch.Tensor, e: torch.Tensor, positions: torch.Tensor, attn: AttentionFn
    ) -> torch.Tensor:
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        h = state  # [N, hidden]
        for i, layer in enumerate(self.model.layers):
            h = layer(h, cos, sin, attn, i)
        return self.model.norm(h)  # [N, hidden]: next loop's input, gate and lm_head input

    def exit_logit(self, state: torch.Tensor) -> torch.Tensor:
        return self.model.early_exit_gate(state).float().squeeze(-1)  # [N] fp32

    def coda(
        self, state: torch.Tensor, positions: torch.Tensor, attn: AttentionFn | None
    ) -> torch.Tensor:
        return state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # [N, vocab]
