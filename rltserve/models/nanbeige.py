"""Nanbeige4.2 (``model_type: "nanbeige"``): a plain pre-norm Llama decoder looped ``num_loops``
times with shared weights (MODELS.md §3).

Each loop runs every layer as ``h += attn(norm_in(h))``, ``h += mlp(norm_post(h))`` and then
``model.norm`` (``skip_loop_final_norm`` is false), whose output feeds the next loop and
``lm_head``. No exit gate, no embedding scale, rotate-half RoPE over the full head_dim, GQA, and a
``head_dim`` that is not ``hidden / heads`` (read ``head_dim`` or ``kv_channels``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rltserve.models import hfconfig as hc
from rltserve.models.base import AttentionFn, LoopedModel, LoopedSpec
from rltserve.models.layers import (
    Embedding,
    GatedMLP,
    Linear,
    RMSNorm,
    RotaryAttention,
    fused_projection_sources,
    rope_cos_sin,
)

FAMILY = "nanbeige"
_POSITIVE_INTS = (
    "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads"
    " num_key_value_heads head_dim max_position_embeddings num_loops"
)
_FIXED = {
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "skip_loop_final_norm": False,
    "use_sliding_window": False,  # (``sliding_window`` alone is inert, as in transformers)
}
# Upstream features that change the math; all are off in Nanbeige4.2-3B and rejected when on.
_BOOL_FEATURES = (
    "loop_share_kv",
    "enable_double_loop_split",
    "enable_hyper_connection",
    "enable_mhc",
    "enable_h_res_identity",
    "enable_depth_attention",
    "qk_layernorm",
    "ngram_insert_all_layers",
)


@dataclass(frozen=True)
class NanbeigeConfig:
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
    num_loops: int
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        hc.check_ints(self, FAMILY, _POSITIVE_INTS)
        hc.check_positives(self, FAMILY, "rms_norm_eps rope_theta")
        hc.check_decoder(self, FAMILY)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> NanbeigeConfig:
        def get(key: str, default: Any = hc._MISSING) -> Any:
            return hc.read(raw, FAMILY, key, default)

        hc.check_model_type(raw, FAMILY)
        hc.check_fixed(raw, FAMILY, _FIXED)
        for key in _BOOL_FEATURES:
            if raw.get(key):
                raise hc.bad(FAMILY, key, raw[key], "this feature is not supported")
        neighbors = raw.get("emb_neighbor_num")
        if isinstance(neighbors, int) and neighbors > 0:
            raise hc.bad(FAMILY, "emb_neighbor_num", neighbors, "this feature is not supported")
        ngram = raw.get("insert_ngram_layer_idx")
        if (isinstance(ngram, int) and ngram >= 0) or (isinstance(ngram, list) and ngram):
            raise hc.bad(FAMILY, "insert_ngram_layer_idx", ngram, "this feature is not supported")
        if raw.get("loop_middle_layers"):
            value = raw["loop_middle_layers"]
            raise hc.bad(FAMILY, "loop_middle_layers", value, "this feature is not supported")
        hidden, heads = get("hidden_size"), get("num_attention_heads")
        layers = get("num_hidden_layers")
        hc.check_full_attention(FAMILY, raw.get("layer_types"), layers)
        head_dim = raw.get("head_dim")
        channels = raw.get("kv_channels")
        if head_dim is None:
            head_dim = channels
        elif channels is not None and channels != head_dim:  # (one would be used silently)
            raise ValueError(
                f"{FAMILY} config: head_dim={head_dim!r} and kv_channels={channels!r} disagree"
            )
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
            num_loops=get("num_loops"),
            bos_token_id=get("bos_token_id", None),
            eos_token_ids=hc.read_ids(raw, FAMILY, "eos_token_id"),
            pad_token_id=get("pad_token_id", None),
        )


def _as_config(cfg: NanbeigeConfig | dict[str, Any]) -> NanbeigeConfig:
    return cfg if isinstance(cfg, NanbeigeConfig) else NanbeigeConfig.from_dict(cfg)


def tensor_shapes(cfg: NanbeigeConfig | dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Exact checkpoint tensor names and shapes (MODELS.md §3)."""
    c = _as_config(cfg)
    h, inter, vocab = c.hidden_size, c.intermediate_size, c.vocab_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, h),
        "model.norm.weight": (h,),
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
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    return shapes


def param_sources(cfg: NanbeigeConfig | dict[str, Any]) -> dict[str, tuple[str, ...]]:
    """Module parameter name -> checkpoint tensors concatenated along dim 0 to form it."""
    return fused_projection_sources(list(tensor_shapes(cfg)))


class NanbeigeDecoderLayer(nn.Module):
    def __init__(self, c: NanbeigeConfig) -> None:
        super().__init__()
        h, eps = c.hidden_size, c.rms_norm_eps
        self.self_attn = RotaryAttention(
            h, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        )
        self.mlp = GatedMLP(h, c.intermediate_size)
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)

    def forward(
        self,
        h: torch.Tensor,  # [N, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionFn,
        layer: int,
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, attn, layer)
        return h + self.mlp(self.post_attention_layernorm(h))  # [N, hidden]


class NanbeigeBody(nn.Module):
    """The ``model.`` prefix of the checkpoint."""

    def __init__(self, c: NanbeigeConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(NanbeigeDecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class NanbeigeModel(LoopedModel):
    def __init__(self, config: NanbeigeConfig) -> None:
        super().__init__()
        c = self.config = config
        self.model = NanbeigeBody(c)
        self.lm_head = Linear(c.hidden_size, c.vocab_size)
        self.spec = LoopedSpec(
            family=FAMILY,
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            state_size=c.hidden_size,
            num_loops=c.num_loops,
            max_loops=2 * c.num_loops,  # extrapolating past the trained depth is allowed, a bit
            num_core_layers=c.num_hidden_layers,
            num_boundary_layers=0,
            num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            max_position=c.max_position_embeddings,
            has_gate=False,
            needs_noise=False,
            bos_token_id=c.bos_token_id,
            eos_token_ids=c.eos_token_ids,
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
        return self.model.norm(h)  # [N, hidden]

    def coda(
        self, state: torch.Tensor, positions: torch.Tensor, attn: AttentionFn | None
    ) -> torch.Tensor:
        return state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # [N, vocab]
