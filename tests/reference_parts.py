"""Pieces of the dense reference oracle (``reference.py``; DESIGN §9): its outputs, the exit rule
and Huginn's zero-shot criteria, KV policy planes, the math of norms, RoPE and causal
attention, dense per-plane K/V, checkpoint loading.
Like the oracle it is written from MODELS.md alone and never imports ``rltserve``."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

EXIT_MODES = ("gate", "delayed", "trace")

AttnFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# --------------------------------------------------------------------------- outputs


@dataclass
class RefOutput:
    """Result of :meth:`Reference.generate`, one entry per output token.

    ``exit_depths[k]`` is the 1-based loop whose state produced ``tokens[k]`` (entry 0 belongs to
    the last prompt position). ``logits[k]`` is the fp32 ``[V]`` logit vector at that depth.
    ``gate_logits[k]`` / ``cdfs[k]`` hold the fp32 gate logit and exit CDF after each loop of the
    producing position up to its exit (empty lists for models without a gate).
    """

    tokens: list[int] = field(default_factory=list)
    exit_depths: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    gate_logits: list[list[float]] = field(default_factory=list)
    cdfs: list[list[float]] = field(default_factory=list)
    # fp32 [T - 1, V]: the logits at prompt positions 0 .. T - 2 after the request's most loops
    # (``max_loops``; what each predicts of the next prompt token).
    prompt_logits: torch.Tensor | None = None


@dataclass
class RecomputeOutput:
    """Result of :meth:`Reference.full_recompute` over ``T`` positions.

    ``logits``: ``[T, V]`` fp32 at each position's exit depth. ``depth_logits``: ``[D_r, T, V]``
    fp32 at every depth (None for Huginn, whose coda output depends on the exit depths).
    ``gate_logits``: ``[D_r, T]`` fp32 (None without a gate).
    """

    logits: torch.Tensor
    depth_logits: torch.Tensor | None
    gate_logits: torch.Tensor | None


# --------------------------------------------------------------------------- exit rule


class ExitRule:
    """Incremental exit decision for one position (DESIGN §5, MODELS §1.5).

    Call :meth:`update` after loop ``t = 1, 2, ...`` with that loop's gate logit (None without a
    gate); it returns True when the position exits at depth ``t``. The gate arithmetic is fp32
    torch ops in HF's order: ``lam = sigmoid(g)``, ``p = lam * S``, ``S = S * (1 - lam)``,
    ``CDF = CDF + p`` (a sequential cumsum), and ``CDF >= q`` compares against ``q`` rounded to
    fp32, as a tensor/scalar comparison does.
    """

    def __init__(
        self,
        mode: str,
        cap: int,
        *,
        min_loops: int = 1,
        exit_threshold: float = 1.0,
        trace_depth: int | None = None,
    ) -> None:
        if mode not in EXIT_MODES:
            raise ValueError(f"unknown exit_mode {mode!r}")
        if cap < 1:
            raise ValueError("cap must be >= 1")
        if mode == "trace" and trace_depth is None:
            raise ValueError("trace mode needs a trace depth")
        self.mode = mode
        self.cap = cap
        self.min_loops = min_loops
        self.exit_threshold = exit_threshold
        self.target = min(max(int(trace_depth), 1), cap) if trace_depth is not None else cap
        self.survival = torch.ones((), dtype=torch.float32)
        self.cdf = torch.zeros((), dtype=torch.float32)
        self.pending = False
        self.gate_logits: list[float] = []
        self.cdfs: list[float] = []

    def update(
        self, t: int, gate_logit: torch.Tensor | float | None, below: bool | None = None
    ) -> bool:
        """``below``: models without a gate, whether the zero-shot criterion after loop ``t``
        asks for the exit (``Criterion.below``)."""
        hit = below is not None and t >= self.min_loops and below
        if gate_logit is not None:
            g = torch.as_tensor(gate_logit, dtype=torch.float32).reshape(())
            lam = torch.sigmoid(g)
            p = lam * self.survival
            self.survival = self.survival * (1.0 - lam)
            self.cdf = self.cdf + p
            self.gate_logits.append(float(g))
            self.cdfs.append(float(self.cdf))
            hit = (
                self.exit_threshold < 1.0
                and t >= self.min_loops
                and bool(self.cdf >= self.exit_threshold)
            )
        if t >= self.cap:
            return True
        if self.mode == "trace":
            return t >= self.target
        if self.mode == "gate":
            return hit
        if self.pending:  # delayed: the decision of loop t-1 takes effect now
            return True
        self.pending = hit
        return False


def exit_depth_from_gates(
    gate_logits: list[float] | torch.Tensor | None,
    *,
    cap: int,
    exit_mode: str = "gate",
    min_loops: int = 1,
    exit_threshold: float = 1.0,
    trace_depth: int | None = None,
) -> int:
    """Exit depth (1-based) of one position given its gate logits after loops 1..n (n >= cap, or
    enough to decide). ``gate_logits=None`` means a model without a gate."""
    rule = ExitRule(
        exit_mode, cap, min_loops=min_loops, exit_threshold=exit_threshold, trace_depth=trace_depth
    )
    for t in range(1, cap + 1):
        g = None if gate_logits is None else gate_logits[t - 1]
        if rule.update(t, g):
            return t
    raise AssertionError("unreachable: the cap always forces an exit")


def parse_kv_policy(policy: str, depth: int) -> tuple[str, int]:
    """-> (kind, number of planes) for a request of depth ``depth``."""
    if policy in ("full", "last_exited"):
        return policy, depth
    if policy == "shared":
        return policy, 1
    if policy.startswith("ring:"):
        try:
            k = int(policy[5:])
        except ValueError:
            k = 0
        if k < 1:
            raise ValueError(f"bad ring size in {policy!r}")
        return "ring", k
    raise ValueError(f"unknown kv_policy {policy!r}")


def plane_of(kind: str, planes: int, d: int) -> int:
    if kind in ("full", "last_exited"):
        return d - 1
    if kind == "shared":
        return 0
    return (d - 1) % planes


class Criterion:
    """Hugging Face's zero-shot exit criteria (``generate_with_adaptive_compute``, MODELS.md
    §2.5) for one decode position, fed loop by loop: the state after each loop (and before the
    first) and, for the criteria over next-token distributions, that loop's logits. It keeps the
    previous loop's distribution, entropy, argmax and state as Hugging Face does."""

    NEEDS_LOGITS = ("kl", "minp-kl", "entropy-diff", "argmax-stability")

    def __init__(self, name: str, threshold: float, vocab: int, state: torch.Tensor) -> None:
        self.name, self.threshold = name, threshold
        self.log_probs = torch.full((vocab,), 1.0 / vocab).log()  # (fp32, as HF's)
        self.entropy = torch.tensor(100.0)
        self.argmax, self.stable = -1, 0  # argmax-stability: loops the argmax has not changed
        self.state = state.float()
        self.values: list[float] = []

    def below(self, state: torch.Tensor, logits: torch.Tensor | None) -> bool:
        before, self.state = self.state, state.float()
        if self.name == "argmax-stability":
            top = int(logits.float().argmax())
            self.stable = self.stable + 1 if top == self.argmax else 0
            self.argmax = top
            self.values.append(float(self.stable))
            return self.stable >= self.threshold
        if self.name == "latent-diff":
            value = ((before - self.state).norm(dim=-1) / self.state.norm(dim=-1)).mean()
        elif self.name == "entropy-diff":
            probs = F.softmax(logits.float(), dim=-1)
            entropy = -torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
            value, self.entropy = (entropy - self.entropy).abs(), entropy
        else:
            probs = F.softmax(logits.float(), dim=-1)
            if self.name == "minp-kl":
                probs = probs.clone()
                probs[probs < 0.1 * probs.max()] = 1.0 / probs.shape[-1]
                log_probs = (probs / probs.sum()).log()
            else:
                log_probs = F.log_softmax(logits.float(), dim=-1)
            value = F.kl_div(log_probs, self.log_probs, reduction="none", log_target=True).sum()
            self.log_probs = log_probs
        self.values.append(float(value))
        return bool(value < torch.tensor(self.threshold, dtype=torch.float32))


# --------------------------------------------------------------------------- choosing


def choose_token(
    logits: torch.Tensor,
    *,
    allowed: list[int] | tuple[int, ...] | None = None,
    logit_bias: dict[int, float] | None = None,
    banned: tuple[int, ...] = (),
) -> int:
    """The greedy choice among ``allowed`` (all when None) after ``logit_bias``, never a
    ``banned`` id (``min_tokens``' stop and EOS ids) unless the bans would leave nothing: a
    constraint matched in full allows only the end id, and the constraint wins (README)."""
    choice = logits.clone()
    if allowed is not None:
        outside = torch.ones_like(choice, dtype=torch.bool)
        outside[list(allowed)] = False
        choice[outside] = float("-inf")
    for t, bias in (logit_bias or {}).items():
        choice[t] += bias
    unbanned = choice.clone()
    for t in banned:
        if 0 <= t < choice.shape[-1]:
            choice[t] = float("-inf")
    if not bool(torch.isfinite(choice).any()):
        choice = unbanned
    return int(torch.argmax(choice))


# --------------------------------------------------------------------------- math helpers


def noise_seed(seed: int, position: int) -> int:
    return (seed * 1_000_003 + position) % (2**63)


def noise_generator(seed: int, position: int) -> torch.Generator:
    """The CPU generator of one position's initial state: ``manual_seed(noise_seed(...))``
    (its mt19937 reads the low 32 bits); where the seed (mod 2**64) has high 32 bits, mt19937
    state words 2..623 are XORed with those of ``manual_seed(high)``."""
    gen = torch.Generator().manual_seed(noise_seed(seed, position))
    high = (seed % 2**64) // 2**32
    if high:
        # torch's CPU state: uint64 seed, int32 left, int32 seeded, uint64 next, then the 624
        # mt19937 words as uint64.
        state, other = gen.get_state(), torch.Generator().manual_seed(high).get_state()
        words = state[24 : 24 + 624 * 8].view(torch.int64)
        words[2:] ^= other[24 : 24 + 624 * 8].view(torch.int64)[2:]
        gen.set_state(state)
    return gen


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_half(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX / rotate_half RoPE over the full head dim. x: [T, H, hd]."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    freqs = positions.float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos().to(x.dtype)[:, None, :]
    sin = emb.sin().to(x.dtype)[:, None, :]
    return x * cos + rotate_half(x) * sin


def rope_interleaved(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Interleaved (complex-pair) RoPE in fp32, cast back. x: [T, H, hd]."""
    hd = x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    ang = positions.float()[:, None] * inv[None, :]
    c, s = ang.cos()[:, None, :], ang.sin()[:, None, :]
    xr = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xr[..., 0], xr[..., 1]
    out = torch.stack((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1).flatten(-2)
    return out.to(x.dtype)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, scale: float
) -> torch.Tensor:
    """q: [T, H, hd] at positions q_start..q_start+T-1; k, v: [S, KVH, hd] at positions 0..S-1.
    Causal (key position <= query position), softmax in fp32. Returns [T, H, hd]."""
    t, h, _ = q.shape
    rep = h // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    scores = torch.matmul(qh, kh.transpose(1, 2)) * scale  # [H, T, S]
    qpos = torch.arange(t)[:, None] + q_start
    kpos = torch.arange(k.shape[0])[None, :]
    scores = scores.masked_fill(kpos > qpos, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, vh).transpose(0, 1)


class DenseKV:
    """Dense K/V of one request: [planes, layers, max_len, kv_heads, head_dim]."""

    def __init__(self, planes: int, layers: int, max_len: int, kvh: int, hd: int, dtype) -> None:
        self.k = torch.zeros(planes, layers, max_len, kvh, hd, dtype=dtype)
        self.v = torch.zeros_like(self.k)

    def attn_fn(self, plane: int, start: int, scale: float) -> AttnFn:
        def fn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            end = start + q.shape[0]
            self.k[plane, layer, start:end] = k
            self.v[plane, layer, start:end] = v
            return causal_attention(
                q, self.k[plane, layer, :end], self.v[plane, layer, :end], start, scale
            )

        return fn

    def copy_position(self, src_plane: int, dst_planes: range, position: int) -> None:
        for p in dst_planes:
            self.k[p, :, position] = self.k[src_plane, :, position]
            self.v[p, :, position] = self.v[src_plane, :, position]


# --------------------------------------------------------------------------- loading


def load_checkpoint(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    index = path / "model.safetensors.index.json"
    tensors: dict[str, torch.Tensor] = {}
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        for shard in sorted(set(weight_map.values())):
            tensors.update(load_file(str(path / shard)))
    else:
        tensors = load_file(str(path / "model.safetensors"))
    return cfg, tensors


def thinking_logprobs(
    ref,
    prompt: list[int],
    out: list[int],
    depths: list[int],
    forced: set[int],
    top: int,
    steer=None,
    **kw,
) -> list[tuple[float, list[tuple[int, float]], int]]:
    """Bounded thinking's oracle: the (raw logprob, top ``top``, rank) of every output token of
    a run given its output ``out`` and exit depths ``depths``, from a dense recompute of prompt
    + output at those depths (``Reference.full_recompute``; ``kw``: its ``kv_policy``): a
    sampled token's at its exit depth, a forced one's (output indices ``forced``) at the cap,
    as ``prompt_logprobs`` would score prompt + output there (``core/thinking.py``). With a
    constraint (``steer``, ``reference_guided.Constraint`` or ``Answer``) each is over the
    tokens it allows after the output before it, as README says a constrained request's
    logprobs are."""
    n = len(prompt)
    cap, depth = ref.depths(kw.get("max_loops"))
    full = ref.full_recompute(prompt + out[:-1], [depth] * (n - 1) + depths, prompt_len=n, **kw)
    entries = []
    for j, token in enumerate(out):
        q = n - 1 + j
        if j in forced and full.depth_logits is None:  # (coda attention: no per-depth logits)
            assert depths[j] == cap, "no per-depth logits to read a forced token at the cap"
        at_cap = j in forced and full.depth_logits is not None
        logits = full.depth_logits[cap - 1, q] if at_cap else full.logits[q]
        allowed = None if steer is None else steer.allowed(out[:j])
        if allowed is not None:
            logits = torch.full_like(logits, float("-inf")).index_copy(
                0, torch.tensor(allowed), logits[allowed]
            )
        logp = torch.log_softmax(logits, -1)
        values, ids = logp.topk(top)
        rank = int((logp >= logp[token]).sum())
        entries.append((logp[token].item(), list(zip(ids.tolist(), values.tolist())), rank))
    return entries
