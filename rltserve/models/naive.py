"""A plain per-request greedy generate loop over a dense KV cache: the benchmarks' naive baseline
and a direct check of the model code against the Hugging Face vectors.

Semantics (KV policy ``full``, DESIGN §4-5):
- ``D_r = max(D, cap)`` for gate models and ``cap`` otherwise, with ``cap = max_loops or D``.
- Every token, prompt or decode, runs all ``D_r`` loops; loop ``d`` reads and writes plane ``d``.
  The prompt goes through each loop in one call; decode is one token per call.
- The exit depth of the output position is the first ``d >= min_loops`` whose gate CDF reaches
  ``exit_threshold`` (only when it is < 1), else ``cap``. The gate's sigmoid, survival and CDF are
  fp32 torch scalars updated after every loop, as the reference does.
- The coda runs on every row, so Huginn's coda K/V is written for every position: the output
  row's input is its state at the exit depth, other prompt rows' input is their state at ``D_r``.
"""

from __future__ import annotations

import math

import torch

from rltserve.models.base import LoopedModel


def dense_causal_attention(
    q: torch.Tensor,  # [N, heads, head_dim]: positions q_start .. q_start + N - 1
    k: torch.Tensor,  # [T, kv_heads, head_dim]: positions 0 .. T - 1, T >= q_start + N
    v: torch.Tensor,  # [T, kv_heads, head_dim]
    q_start: int,
) -> torch.Tensor:
    """Causal GQA attention, scale 1/sqrt(head_dim), softmax in fp32 -> [N, heads, head_dim]."""
    n, heads, head_dim = q.shape
    rep = heads // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)  # [T, heads, head_dim]
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("nhd,thd->hnt", q, k) * (1.0 / math.sqrt(head_dim))  # [heads, N, T]
    q_pos = torch.arange(q_start, q_start + n, device=q.device)[:, None]
    k_pos = torch.arange(k.shape[0], device=q.device)[None, :]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.einsum("hnt,thd->nhd", probs, v)  # [N, heads, head_dim]


class DenseKVCache:
    """Dense K/V of one request: per plane, per layer, ``[capacity, kv_heads, head_dim]``.

    Plane ``None`` is the boundary plane (Huginn's prelude and coda layers).
    """

    def __init__(self, model: LoopedModel, capacity: int) -> None:
        spec = model.spec
        param = next(model.parameters())
        self.shape = (capacity, spec.num_kv_heads, spec.head_dim)
        self.dtype, self.device = param.dtype, param.device
        self.planes: dict[int | None, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def attn(self, plane: int | None, start: int) -> DenseAttention:
        """AttentionFn for rows at positions ``start..`` reading/writing ``plane``."""
        return DenseAttention(self, plane, start)

    def layer(self, plane: int | None, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        layers = self.planes.setdefault(plane, {})
        if layer not in layers:
            kw = {"dtype": self.dtype, "device": self.device}
            layers[layer] = (torch.zeros(self.shape, **kw), torch.zeros(self.shape, **kw))
        return layers[layer]


class DenseAttention:
    def __init__(self, cache: DenseKVCache, plane: int | None, start: int) -> None:
        self.cache, self.plane, self.start = cache, plane, start

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        k_cache, v_cache = self.cache.layer(self.plane, layer)
        end = self.start + q.shape[0]
        k_cache[self.start : end] = k
        v_cache[self.start : end] = v
        return dense_causal_attention(q, k_cache[:end], v_cache[:end], self.start)


def request_depth(model: LoopedModel, max_loops: int | None) -> tuple[int, int]:
    """(cap, D_r): the latest exit depth and the loops every token runs under ``full``."""
    cap = max_loops or model.spec.num_loops
    if not 1 <= cap <= model.spec.max_loops:
        raise ValueError(f"max_loops={max_loops!r}: must be in [1, {model.spec.max_loops}]")
    return cap, (max(model.spec.num_loops, cap) if model.spec.has_gate else cap)


@torch.inference_mode()
def _step(
    model: LoopedModel,
    cache: DenseKVCache,
    ids: list[int],
    start: int,
    seed: int | None,
    cap: int,
    depth: int,
    exit_threshold: float,
    min_loops: int,
) -> tuple[int, int]:
    """Run tokens ``ids`` at positions ``start..`` through all loops; (next token, exit depth)."""
    device = cache.device
    positions = torch.arange(start, start + len(ids), device=device)  # [N]
    input_ids = torch.tensor(ids, dtype=torch.long, device=device)  # [N]
    e = model.prelude(input_ids, positions, cache.attn(None, start))  # [N, E]
    noise = model.draw_noise(seed, positions.tolist()) if model.spec.needs_noise else None
    state = model.initial_state(e, noise)  # [N, S]
    survival = torch.ones((), dtype=torch.float32)
    cdf = torch.zeros((), dtype=torch.float32)
    adaptive = model.spec.has_gate and exit_threshold < 1.0
    exit_depth, exit_state = 0, state
    for d in range(1, depth + 1):
        state = model.loop(state, e, positions, cache.attn(d - 1, start))
        if exit_depth:
            continue
        if adaptive:
            gate = model.exit_logit(state)
            assert gate is not None, "has_gate models return exit logits"
            lam = torch.sigmoid(gate[-1].float().cpu())
            cdf = cdf + lam * survival
            survival = survival * (1.0 - lam)
            if d >= min_loops and bool(cdf >= exit_threshold):
                exit_depth = d
        if d == cap:
            exit_depth = d
        if exit_depth:
            exit_state = state[-1:]  # [1, S]
    coda_in = torch.cat((state[:-1], exit_state))  # [N, S]: only the last row exits early
    hidden = model.coda(coda_in, positions, cache.attn(None, start))  # [N, H]
    logits = model.logits(hidden[-1:])  # [1, V] fp32
    return int(logits[0].argmax()), exit_depth


def naive_generate(
    model: LoopedModel,
    prompt_ids: list[int],
    max_tokens: int,
    *,
    max_loops: int | None = None,
    exit_threshold: float = 1.0,
    min_loops: int = 1,
    seed: int | None = None,
) -> tuple[list[int], list[int]]:
    """Greedy generation of ``max_tokens`` tokens (no EOS stop): (tokens, exit_depths).

    ``seed`` seeds Huginn's initial state per position (None: the zero state).
    """
    if not prompt_ids:
        raise ValueError("prompt_ids: must not be empty")
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens!r}: must be >= 1")
    if min_loops < 1:
        raise ValueError(f"min_loops={min_loops!r}: must be >= 1")
    cap, depth = request_depth(model, max_loops)
    total = len(prompt_ids) + max_tokens - 1
    if total > model.spec.max_position:
        raise ValueError(f"prompt + max_tokens - 1 = {total} exceeds {model.spec.max_position}")
    cache = DenseKVCache(model, total)
    args = (seed, cap, depth, exit_threshold, min_loops)
    token, exit_depth = _step(model, cache, list(prompt_ids), 0, *args)
    tokens, depths = [token], [exit_depth]
    for pos in range(len(prompt_ids), total):
        token, exit_depth = _step(model, cache, [tokens[-1]], pos, *args)
        tokens.append(token)
        depths.append(exit_depth)
    return tokens, depths
