"""Bounded thinking and structured outputs in the differential fuzzer (``scripts/fuzz_oracle.py``):
their draws, the oracle's steer of a request (``reference_guided``), and the checks beyond
token ids and exit depths: logprobs against the oracle's dense scores of the output
(``reference_parts.thinking_logprobs``: each forced token's, raw, at the cap; a constrained
token's over what the constraint allows), and a sampled output's forced ids and constraint
(both on one request: ``reference_guided.Answer``).

Their draws use random streams of their own, so a case's other draws stay as they were. A
structured output needs the model's tokenizer: such a case runs on its family's tiny preset
(``tokenized``), whose vocabulary decodes to ASCII digits, letters and short words."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import torch
from reference_guided import Answer, Constraint, ThinkingBudget
from reference_parts import thinking_logprobs

from rltserve.guide_index import bind
from rltserve.models.tokenizer import load_tokenizer
from rltserve.sampling import SamplingParams
from rltserve.structured import StructuredOutputsParams

# Where a match may go on ("1" then "10", "a" then "a.b", "[0-9]+"), words the vocabulary has
# whole or in pieces (" the", "then"), alternations.
CHOICES = (
    ["yes", "no"],
    ["1", "10", "100"],
    ["a", "a.b"],
    [" the", " and", "then"],
    ["red", "green", "blue"],
)
REGEXES = (
    r"[0-9]+",
    r"[0-9]{2,3}",
    r"(yes|no)!?",
    r"[a-z]{1,4}",
    r"[0-9]+(\.[0-9]+)?",
    r"(the|an?) [a-z]+",
    r"[a-c]+x?",
    r"-?[1-9][0-9]?",
)


def draw_thinking(rng: random.Random, params: list[SamplingParams]) -> list[SamplingParams]:
    """In some cases, a thinking budget on some requests: K of 0 (forced before the first
    token), 1 to 3, or -1 (no bound), by either of its names; an interruption of 0 to 2 ids,
    sometimes holding the end ids; room for none, some or all of the forced ids and an answer;
    logprobs sometimes (a sampled case's penalties stay: they count the forced tokens)."""
    if rng.random() >= 0.2:
        return params
    drawn = []
    for p in params:
        if rng.random() < 0.3:
            drawn.append(p)
            continue
        budget = rng.choice([0, 0, 1, 2, 3, -1])
        end = tuple(rng.randrange(384) for _ in range(rng.choice([1, 1, 2])))
        interruption = tuple(rng.randrange(384) for _ in range(rng.randint(0, 2)))
        if rng.random() < 0.2:
            interruption = (*interruption, *end)
        room = max(budget, 0) + len(ThinkingBudget(budget, interruption, end).forced_ids) + 3
        name = rng.choice(["max_thinking_tokens", "thinking_token_budget"])
        kw = {name: budget, "thinking_interruption": interruption, "thinking_end_token_ids": end}
        if rng.random() < 0.4:
            kw["logprobs"] = rng.choice([0, 2])
        max_tokens = max(p.min_tokens, rng.randint(max(budget, 0) + 1, room))
        drawn.append(p.replace(max_tokens=max_tokens, **kw))
    return drawn


def draw_guided(rng: random.Random, params: list[SamplingParams]):
    """-> (params, tokenized): in some cases a choice or a regex on some requests (on one with
    a budget too: the answer after its span is constrained), ending at EOS (or not:
    ``ignore_eos``), with ``min_tokens`` sometimes longer than a match; logprobs sometimes. A
    case with budgets draws them more often (their combination is rare otherwise)."""
    budgeted = any(p.max_thinking_tokens is not None for p in params)
    if rng.random() >= (0.5 if budgeted else 0.2):
        return params, False
    drawn = []
    for p in params:
        if rng.random() < 0.25:
            drawn.append(p)
            continue
        if rng.random() < 0.5:
            structured = StructuredOutputsParams(choice=list(rng.choice(CHOICES)))
        else:
            structured = StructuredOutputsParams(regex=rng.choice(REGEXES))
        min_tokens = rng.choice([0, 0, 0, 2, 6])
        max_tokens = rng.randint(max(min_tokens, 3), 10)
        logprobs = rng.choice([None, None, 0, 2])
        if p.max_thinking_tokens is not None:  # (an answer after the thinking, or none)
            max_tokens = max(min_tokens, p.max_tokens + rng.randint(0, 8))
            logprobs = p.logprobs if p.logprobs is not None else logprobs
        drawn.append(
            p.replace(
                structured_outputs=structured,
                ignore_eos=rng.random() < 0.15,
                min_tokens=min_tokens,
                max_tokens=max_tokens,
                logprobs=logprobs,
            )
        )
    return drawn, True


@functools.cache
def _tokenizer(path: Path):
    return load_tokenizer(path)


def engine_params(params: list[SamplingParams], path: Path) -> list[SamplingParams]:
    """The params as a front end hands them to the engine: constraints compiled (``bind``)."""
    return [bind(p, _tokenizer(path)) if p.structured_outputs else p for p in params]


def steer_for(p: SamplingParams, ref, path: Path):
    """The oracle's steer of ``p`` (``Reference.generate``'s), or None."""
    budget = constraint = None
    if p.max_thinking_tokens is not None:
        interruption = p.thinking_interruption or ()
        budget = ThinkingBudget(p.max_thinking_tokens, interruption, p.thinking_end_token_ids)
    if (structured := p.structured_outputs) is not None:
        vocab = ref.w["lm_head.weight"].shape[0]
        end = ref.eos_token_ids[0]
        constraint = Constraint(
            path, end, vocab, choice=structured.choice, pattern=structured.regex
        )
    if budget is not None and constraint is not None:
        return Answer(budget, constraint)
    return budget or constraint


def chosen_logits(steer, tokens: list[int], logits: torch.Tensor) -> torch.Tensor:
    """``logits`` as the choice after ``tokens`` saw them: outside a constraint, -inf."""
    allowed = None if steer is None else steer.allowed(tokens)
    if allowed is None:
        return logits
    masked = torch.full_like(logits, float("-inf"))
    masked[allowed] = logits[allowed]
    return masked


def output_diff(steer, tokens: list[int]) -> str | None:
    """What a (sampled) output breaks of its steer's rules: a forced id missing, or a token
    its constraint did not allow."""
    if isinstance(steer, (ThinkingBudget, Answer)):
        for j in range(len(tokens)):
            want = steer.forced(tokens[:j])
            if want is not None and tokens[j] != want:
                return f"token {j} is {tokens[j]}, not the forced {want}"
    if isinstance(steer, (Constraint, Answer)) and (j := steer.first_outside(tokens)) is not None:
        return f"token {j} ({tokens[j]}) is outside the constraint after {steer.text(tokens[:j])!r}"
    return None


def logprobs_diff(ref, prompt, p: SamplingParams, steer, run, rid, policy) -> str | None:
    """What differs between a steered request's logprob entries (with their top k, and the
    forced tokens' ranks) and the oracle's dense scores of its output, for any output (greedy
    or sampled; full and last_exited KV: ``full_recompute``'s). Top ids of equal values may
    come in either order: values are compared."""
    if steer is None or p.logprobs is None:
        return None
    if policy not in ("full", "last_exited") or run.finish.get(rid) == "abort":
        return None
    out, depths = run.tokens[rid], run.depths[rid]
    forced = steer.forced_at(out) if isinstance(steer, (ThinkingBudget, Answer)) else set()
    constraint = steer if isinstance(steer, (Constraint, Answer)) else None
    kw = {"kv_policy": policy, "max_loops": p.max_loops}
    if ref.family == "huginn_raven":
        kw.update(init_state=p.init_state or "random", seed=p.seed)
    want = thinking_logprobs(ref, prompt, out, depths, forced, p.logprobs, constraint, **kw)
    ranks = run.forced_ranks.get(rid, {})
    for j, (logprob, top, rank) in enumerate(want):
        what = "forced token" if j in forced else "token"
        got, got_top = run.logprobs[rid][j], run.top_logprobs[rid][j]
        if got is None or not _near(got, logprob):
            return f"{what} {j}: logprob {got}, the oracle's {logprob}"
        values = [v for _, v in top]
        if got_top is None or len(got_top) != len(top):
            return f"{what} {j}: top logprobs {got_top}, the oracle's {top}"
        if not all(_near(v, w) for (_, v), w in zip(got_top, values)):
            return f"{what} {j}: top logprobs {got_top}, the oracle's {top}"
        if j in ranks and abs(ranks[j] - rank) > 1:  # (float noise at ties)
            return f"{what} {j}: rank {ranks[j]}, the oracle's {rank}"
    return None


def _near(a: float, b: float) -> bool:
    """Within float32 noise, which grows with a logprob's size; -inf (outside a constraint)
    only as -inf."""
    return a == b or abs(a - b) <= 1e-4 * (1 + abs(b))
