"""Batched token sampling with per-request seeded generators.

Order of operations per row (vLLM V1's): structured outputs' mask (on the model's logits, so
raw logprobs are masked too, as vLLM's) -> allowed ids -> min_tokens bans -> logit bias ->
penalties (repetition over prompt + output tokens, vLLM style; presence/frequency over output
tokens, OpenAI style) -> greedy argmax, or temperature -> min-p -> top-k -> top-p ->
exponential-race sampling. So a bias is scaled by the repetition penalty as the logit is
(``(l + b) / r``), and top-p's mass is that of what min-p and top-k leave. Filters run
vectorized over the rows that sample, with per-row parameters as tensors, and are skipped when
no row uses them.

Reproducibility: a seeded request's row draws its ``Exp(1)`` noise ``[V]`` from its own generator
and nothing else does, and every other operation is row-wise, so its tokens do not depend on the
rest of the batch. Rows without a generator share one batched draw from the global RNG.

Logprobs are by default (vLLM's ``raw_logprobs``) ``log_softmax`` of the model's logits, before
penalties, bias, bans, temperature and filters: independent of the sampling knobs, so they are
comparable across requests and meaningful for greedy rows; ``Sampler``'s ``processed_logprobs``
describes the distribution the token was drawn from instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter

import numpy as np
import torch

from rltserve.core.guide import Guide, GuideMasks
from rltserve.core.staging import move_to, to_device
from rltserve.sampling import SamplingParams
from rltserve.seeds import seeded_generator


class SeededGenerator:
    """A request's sampling generator and the number of ``Exp(1)`` rows drawn from it.

    The sampler draws exactly one row of the logits' width per token the request samples, and
    nothing else draws from it, so ``(seed, draws)`` determines the state. A request resumed
    after preemption continues from the generator it had (``resume``): it draws only the rows
    it lacks instead of replaying one vocabulary-wide draw per token sampled so far."""

    def __init__(self, seed: int, device: torch.device | str) -> None:
        self.seed = seed
        self.generator = seeded_generator(seed, device)
        self.draws = 0

    def noise(self, width: int) -> torch.Tensor:
        """[width] ~ Exp(1): the draw of one sampled token."""
        return self.draw_into(torch.empty(width, device=self.generator.device))

    def draw_into(self, out: torch.Tensor) -> torch.Tensor:
        """``noise(len(out))`` written into ``out`` (a contiguous float32 row of the step's
        noise, same values): the sampler draws each seeded row in place, without a tensor of
        its own and a copy per row (two device operations and an allocation per sampled row
        per step, the largest host cost of a sampled decode step)."""
        self.draws += 1
        return out.exponential_(generator=self.generator)

    @classmethod
    def resume(
        cls,
        seed: int,
        device: torch.device | str,
        draws: int,
        width: int,
        kept: SeededGenerator | None = None,
    ) -> SeededGenerator:
        """The generator of a request that has sampled ``draws`` tokens. ``kept``: its
        generator from before a preemption. It may have drawn more (a step in flight when the
        request was preempted sampled a token whose result was dropped): then the draws are
        replayed from the seed, as they are without one."""
        usable = kept is not None and kept.seed == seed and kept.draws <= draws
        gen = kept if usable else cls(seed, device)
        while gen.draws < draws:
            gen.noise(width)
        return gen


@dataclass
class SampleRow:
    """One logits row to sample. ``generator`` lives on the logits' device and is owned by the
    runner (one per seeded request); ``penalty_tokens`` is (prompt ids, output ids)."""

    params: SamplingParams
    generator: SeededGenerator | None = None
    penalty_tokens: tuple[list[int], list[int]] | None = None
    # min_tokens: [B] int64 ids on the logits' device the row may not sample when its token
    # is sampled at a position below ``banned_below`` (the caller says which rows are).
    banned: torch.Tensor | None = None
    banned_below: int = 0
    # [V] fp32 on the logits' device, added to the row's logits before it samples (logit_bias;
    # -inf outside allowed_token_ids).
    bias: torch.Tensor | None = None
    # Structured outputs: the request's guide, whose state masks what the row may sample.
    guide: Guide | None = None
    # The row is the argmax and nothing else is asked of it (greedy, no penalties, no bias, no
    # guide, no logprobs): a step whose rows all are skips the per-row work.
    plain: bool = field(init=False)
    # The prompt's distinct ids on the logits' device (``prompt_ids``), made on the first
    # penalized step: a request's prompt never changes, and converting its whole list again
    # every step was most of a penalized step's host time (O(rows x prompt length)).
    _prompt_ids: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        p = self.params
        penalized = self.penalty_tokens is not None and _uses_penalties(p)
        unchanged = self.bias is None and self.guide is None  # (the logits as the model gave them)
        self.plain = p.greedy and p.logprobs is None and not penalized and unchanged

    def prompt_ids(self, device: torch.device) -> torch.Tensor:
        """[N] int64 on ``device``: the distinct ids of the prompt in ``penalty_tokens``."""
        ids = self._prompt_ids
        if ids is None or ids.device != device:
            prompt = self.penalty_tokens[0] if self.penalty_tokens else []
            ids = self._prompt_ids = to_device(sorted(set(prompt)), device, torch.int64)
        return ids


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float | None]  # of the sampled token; None where not asked for
    top_logprobs: list[list[tuple[int, float]] | None]  # descending by logprob
    # Per row: every logit was finite. A row with a NaN or infinity samples a meaningless token
    # (argmax treats NaN as the largest value); the scheduler fails its request.
    finite: list[bool] | None = None
    # Per row: the sampled token's rank (1: the most likely; vLLM's count of logprobs >= its
    # own); None where logprobs were not asked for. None when no row asked.
    ranks: list[int | None] | None = None


_PLAIN = attrgetter("plain")


def _greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R] int64: each row's argmax (the first maximal id), and [R] bool: the row's logits are
    all finite. ``logits``: [R, V] float32. A row's max is NaN when it holds a NaN (max and min
    propagate NaN) or +inf, its min NaN or -inf, so the flags take two reductions beside the
    argmax. Where torch computes: ``max`` gives the argmax with the max in one reduction (not
    ``isfinite(logits).all(-1)``, which writes and rereads an [R, V] mask: 8x the time on CPU;
    an argmax beside ``amax`` and ``amin``: 1.4-1.7x). On CPU with one torch thread (the
    runner's reductions then get no parallelism) numpy's argmax, also the first maximal id,
    plus ``amax`` take a third of the time of torch's reduction with indices (256 rows: 56
    against 165 us at V=512; 4.9 against 9.1 ms at V=32000)."""
    if logits.device.type == "cpu" and torch.get_num_threads() == 1:
        ids = logits.detach().numpy().argmax(axis=-1).astype(np.int64, copy=False)
        tokens, top = torch.from_numpy(ids), logits.amax(dim=-1)
    else:
        top, tokens = logits.max(dim=-1)
    return tokens, torch.isfinite(top) & torch.isfinite(logits.amin(dim=-1))


def _uses_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


@dataclass
class DeviceSample:
    """A sampling result still on the device: the runner feeds ``token_ids`` to the next
    prelude directly and reads everything on the host only when the step's result is
    delivered (``StepOutputs``)."""

    token_ids: torch.Tensor  # [R] int64
    finite: torch.Tensor  # [R] bool: the row's logits (the model's) were all finite
    logprob_rows: list[int]  # rows that asked for logprobs, in order
    num_top: list[int]  # per such row: how many top logprobs it asked for
    chosen: torch.Tensor | None = None  # [W] fp32: logprob of each such row's token
    ranks: torch.Tensor | None = None  # [W] int64: its rank
    top_values: torch.Tensor | None = None  # [W, n_top] fp32, descending
    top_ids: torch.Tensor | None = None  # [W, n_top] int64

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors ``to_output`` needs, by name (for staging to the host)."""
        out = {"token_ids": self.token_ids, "finite": self.finite}
        for name in ("chosen", "ranks", "top_values", "top_ids"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out

    def to_output(self, host: dict[str, list]) -> SampleOutput:
        """``host``: ``tensors()`` as lists (``tensor.tolist()``)."""
        token_ids = host["token_ids"]
        rows = len(token_ids)
        logprobs: list[float | None] = [None] * rows
        top: list[list[tuple[int, float]] | None] = [None] * rows
        chosen, host_ranks = host.get("chosen", []), host.get("ranks", [])
        ranks: list[int | None] | None = [None] * rows if self.logprob_rows else None
        values, ids = host.get("top_values"), host.get("top_ids")
        for j, (i, n) in enumerate(zip(self.logprob_rows, self.num_top)):
            logprobs[i] = chosen[j]
            ranks[i] = host_ranks[j]
            top[i] = list(zip(ids[j][:n], values[j][:n])) if n else []
        finite = host["finite"] if "finite" in host else [True] * rows  # bools already
        return SampleOutput(token_ids, logprobs, top, finite, ranks)


class Sampler:
    """No request state: all of it (generators, token history, guides) comes in the rows.

    ``logprobs_mode`` (vLLM's): what a row's logprobs describe: ``"raw_logprobs"``, the
    model's distribution (before penalties and everything after them; masked by structured
    outputs, as vLLM's); ``"processed_logprobs"``, the distribution the token was drawn from:
    after penalties, logit_bias, allowed ids and min_tokens bans, and for a sampled (non-greedy)
    row temperature, top_k, top_p and min_p (ids they remove have logprob -inf)."""

    def __init__(self, logprobs_mode: str = "raw_logprobs") -> None:
        self.processed = logprobs_mode == "processed_logprobs"
        self.guide_masks = GuideMasks()  # (structured outputs: a cache, no request state)

    def sample(
        self, logits: torch.Tensor, rows: list[SampleRow], banned: Sequence[int] = ()
    ) -> SampleOutput:
        """logits: [R, V] fp32, one row per ``rows`` entry; ``banned``: the rows that may not
        sample their ``SampleRow.banned`` ids (min_tokens). The input tensor is not modified."""
        out = self.sample_device(logits, rows, banned)
        return out.to_output({k: v.tolist() for k, v in out.tensors().items()})

    def sample_device(
        self, logits: torch.Tensor, rows: list[SampleRow], banned: Sequence[int] = ()
    ) -> DeviceSample:
        """As ``sample``, leaving the results on the device (no host synchronisation)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} for {len(rows)} rows")
        logits = logits if logits.dtype == torch.float32 else logits.float()
        if not banned and all(map(_PLAIN, rows)):  # every row greedy, nothing more asked
            return DeviceSample(*_greedy(logits), [], [])
        device = logits.device
        # One reduction per step over the model's logits; read with the tokens, no sync. The
        # tokens are the result of greedy rows nothing below changes.
        tokens, finite = _greedy(logits)  # [R]
        # Structured outputs' mask first: vLLM applies it to the model's logits before its
        # sampler, so even raw logprobs describe the masked distribution (a choice's logprobs
        # are its options').
        guided = [i for i, r in enumerate(rows) if r.guide is not None and r.guide.active]
        if guided:
            logits = self.guide_masks.apply(logits, [rows[i].guide for i in guided], guided)
        raw = logits
        # What tokens are drawn from, in vLLM's order: allowed ids and bias (one [V] row each),
        # min_tokens bans, then penalties (which scale a biased logit as they scale any other).
        choice = logits
        biased = [i for i, r in enumerate(rows) if r.bias is not None]
        if biased:
            idx = to_device(biased, device)
            choice = logits.index_add(0, idx, torch.stack([rows[i].bias for i in biased]))
        if banned:
            unbanned = choice
            choice = _ban(choice, [rows[i].banned for i in banned], banned)
            if guided_banned := sorted(set(guided) & set(banned)):
                choice = GuideMasks.keep_ends(unbanned, choice, guided_banned)
        penalized = [
            i for i, r in enumerate(rows) if r.penalty_tokens and _uses_penalties(r.params)
        ]
        if penalized:
            choice = choice.clone() if choice is raw else choice
            idx = to_device(penalized, device)
            choice[idx] = _apply_penalties(choice[idx], [rows[i] for i in penalized])
        changed = sorted({*banned, *guided, *biased, *penalized})
        greedy_filtered = [i for i in changed if rows[i].params.greedy]
        if greedy_filtered:
            idx = to_device(greedy_filtered, device)
            tokens[idx] = choice[idx].argmax(dim=-1)  # (the first maximal id, as _greedy's)
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        described = choice if self.processed else raw  # [R, V]: what logprobs describe
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if len(sampled) == len(rows):  # (a rollout's batch: no gather, no scatter back)
            tokens, drawn_from = _sample_rows(choice, rows)
            if self.processed and wanted:
                described = drawn_from
        elif sampled:
            idx = to_device(sampled, device)
            tokens[idx], drawn_from = _sample_rows(choice[idx], [rows[i] for i in sampled])
            if self.processed and wanted:
                described = described.index_copy(0, idx, drawn_from)

        num_top = [rows[i].params.logprobs or 0 for i in wanted]
        out = DeviceSample(tokens, finite, wanted, num_top)
        if wanted:
            idx = to_device(wanted, device)
            logp = torch.log_softmax(described[idx], dim=-1)  # [W, V]
            out.chosen = logp.gather(1, tokens[idx].unsqueeze(1)).squeeze(1)  # [W]
            out.ranks = token_ranks(logp, out.chosen)  # [W]
            if max(num_top):
                out.top_values, out.top_ids = logp.topk(max(num_top), dim=-1)  # [W, n_top]
        return out


def token_ranks(logp: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """[W] int64: the rank of each row's ``chosen`` logprob among its row of ``logp`` [W, V]
    (vLLM's: the count of logprobs >= it, 1 for the most likely token)."""
    return (logp >= chosen[:, None]).sum(dim=-1)


def _ban(logits: torch.Tensor, ids: list[torch.Tensor | None], rows: Sequence[int]) -> torch.Tensor:
    """A copy of ``logits`` [R, V] with ``ids[k]`` set to -inf in row ``rows[k]``."""
    vocab = logits.shape[1]
    flat = torch.cat([b + row * vocab for b, row in zip(ids, rows) if b is not None])
    return logits.clone().view(-1).index_fill_(0, flat, float("-inf")).view_as(logits)


def _apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """[P, V] -> [P, V] with repetition, presence and frequency penalties applied."""
    p, vocab = logits.shape
    device = logits.device
    outputs = [row.penalty_tokens[1] if row.penalty_tokens else [] for row in rows]
    out_ids = list(chain.from_iterable(outputs))
    counts = torch.zeros(p, vocab, device=device)  # [P, V]: occurrences in the output
    if out_ids:
        flat = _row_starts([len(o) for o in outputs], vocab, device) + to_device(out_ids, device)
        counts.view(-1).index_add_(0, flat, torch.ones(len(out_ids), device=device))
    seen = counts > 0  # [P, V]: in the output, then the prompt too
    prompts = [row.prompt_ids(device) for row in rows]
    flat = _row_starts([len(ids) for ids in prompts], vocab, device) + torch.cat(prompts)
    seen.view(-1).index_fill_(0, flat, True)

    rep = to_device([r.params.repetition_penalty for r in rows], device)[:, None]
    pres = to_device([r.params.presence_penalty for r in rows], device)[:, None]
    freq = to_device([r.params.frequency_penalty for r in rows], device)[:, None]
    repeated = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, repeated, logits)
    return logits - freq * counts - pres * (counts > 0).float()


def _row_starts(lengths: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """[sum(lengths)] int64 on ``device``: ``j * vocab`` (row j's start in a flattened [P, V])
    repeated ``lengths[j]`` times."""
    starts = np.arange(len(lengths), dtype=np.int64) * vocab
    return move_to(torch.from_numpy(np.repeat(starts, lengths)), device)


def _sample_rows(logits: torch.Tensor, rows: list[SampleRow]) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, V] penalized logits of non-greedy rows -> [S] sampled token ids, and the [S, V]
    logits they were drawn from (after temperature, min_p, top_k and top_p)."""
    s, vocab = logits.shape
    device = logits.device
    params = [r.params for r in rows]
    temp = to_device([p.temperature for p in params], device)[:, None]
    logits = logits / temp

    # min-p before top-k and top-p (vLLM's: it is argmax-invariant, they renormalise after it).
    if any(p.min_p > 0.0 for p in params):
        probs = logits.softmax(dim=-1)
        min_p = to_device([p.min_p for p in params], device)[:, None]
        logits = logits.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))

    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    use_k = any(k < vocab for k in top_k)
    use_p = any(p.top_p < 1.0 for p in params)
    if use_k or use_p:
        # Stable sort: among equal logits the lower id ranks first, as in argmax.
        sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [S, V]
        drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if use_k:
            ranks = torch.arange(vocab, device=device)[None, :]
            drop |= ranks >= to_device(top_k, device)[:, None]
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        if use_p:
            probs = sorted_logits.softmax(dim=-1)
            before = probs.cumsum(dim=-1) - probs  # mass ranked strictly above each token
            top_p = to_device([p.top_p for p in params], device)[:, None]
            drop |= before >= top_p
            drop[:, 0] = False  # the most likely token always survives
        drop = torch.empty_like(drop).scatter_(1, order, drop)  # back to vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))

    probs = logits.softmax(dim=-1)  # [S, V]
    noise = torch.empty_like(probs)  # [S, V] ~ Exp(1)
    shared = [j for j, r in enumerate(rows) if r.generator is None]
    if shared:
        noise[to_device(shared, device)] = torch.empty(
            len(shared), vocab, device=device
        ).exponential_()
    for row_noise, row in zip(noise, rows):  # (rows of ``noise`` as views: one unbind)
        if row.generator is not None:
            row.generator.draw_into(row_noise)
    # argmax(probs / q) with q ~ Exp(1) draws from probs; q is kept > 0 so 0/0 cannot occur.
    return (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1), logits
