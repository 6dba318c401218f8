"""Bounded thinking in the engine: the end of an over-long thinking span, forced.

Semantics (``SamplingParams.max_thinking_tokens = K``): the thinking span is open from the
start of the output until the output contains ``thinking_end_token_ids``. When the K-th output
token has been sampled and the span is still open, the forced ids ``thinking_interruption +
thinking_end_token_ids`` (the interruption alone where it holds the end ids: ``forced_ids``) are
appended to the output at once (as many as ``max_tokens`` and the context leave room for), and
decoding continues in the same request with no re-prefill:

- the positions whose inputs are the K-th output token and the forced ids but the last run to
  full depth without sampling, exactly as a recompute replays positions after preemption
  (``preemption.replay_item``; a forced token's recorded exit depth is the request's depth);
- the position whose input is the last forced id samples the next token as any decode does.

So the output equals the oracle run on prompt + the K thinking tokens (at their recorded exit
depths) + the forced ids, and a recompute after preemption replays the forced ids like any
recorded token. Forced tokens are in the output's token ids and never count as stop tokens.

Logprobs (``logprobs=k``): a forced token goes out with none, and a later update gives it
(``RequestUpdate.forced_logprobs``, which ``OutputAssembler`` writes into the earlier entries):
the model's raw logprob of the forced token given everything before it, with its top k and
rank, exactly what ``prompt_logprobs`` would give scoring prompt + output at that position
(the state after ``max_loops``). The replay item holding the position before each forced token
(the first: the K-th sampled token's) gets it as a target (``Request.forced_targets``,
``WorkItem.prompt_targets``) and the applier records it once (``Request.forced_scores``: a
recompute after preemption finds it filled; a swap keeps no position whose score is missing);
forced ids that fill ``max_tokens`` end the request only once scored, and a front end whose
stop string ended the output there keeps taking the request's updates (only their scores:
``OutputAssembler.add_late``) until the forced tokens it kept have theirs, then aborts it and
delivers the result. Raw in either ``logprobs_mode``: the forced token was drawn from no
processed distribution. Offline results (final and cumulative outputs, ``cumulative_logprob``
included) and HTTP non-streaming responses have them; what a stream (DELTA, SSE) already
delivered keeps its empty entry (SSE chat leaves it out, completions give a null logprob),
and an update that only scores sends no SSE chunk; a score that comes with its token (a budget
of 0 with prompt logprobs, below) is in that token's delta.

A budget of 0 (vLLM's ``thinking_token_budget=0``: the model answers without thinking) forces
the ids before the first output (``force_at_start``): they are recorded when the request is
made, as a recompute after preemption finds its output, so the prompt runs without sampling
and the forced positions but the last replay; the position of the last forced id samples the
first token. The output equals the oracle run on prompt + forced ids. With logprobs the first
forced token is scored by the prompt's last chunk (its last row: ``WorkItem.targets_from``),
the others by the replay items. They go out in one update, when the result of the prompt's
last chunk is first applied (every later output comes from positions after it, whose loops
start in later steps); that update is the request's first output (``num_cached_tokens``).

Async scheduling plans a step before the previous one's result is applied, but whether the
position after the token that may spend the budget replays the first forced id or decodes is
what that token decides: that position waits for its result (``awaits_budget``, once per
request: a step later), so the request runs the very items synchronous scheduling gives it
(token ids, exit depths, forced logprobs and generator draws alike). Penalties count forced
tokens as output tokens: the runner's penalty history takes them as they enter as recorded
inputs (``LiveRequest.record_inputs``), and a resumed request's setup has them with the
sampled ones. A constraint (structured outputs) applies to the answer after the span: the
request's guide turns active at the token that spends the budget, so the first token sampled
after the forced ids is the answer's first (``core/guide.py``). On an engine with token
pipelining such a request decodes without it
(``request_checks.check_pipelining``; an explicit ``speculative=True`` is refused there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rltserve.core.request import Request
    from rltserve.sampling import SamplingParams
    from rltserve.updates import RequestUpdate


def check_thinking(params: SamplingParams) -> None:
    """Raises ValueError when a request's bounded thinking is incomplete: no end ids, or an
    interruption still in text (the front ends tokenize it)."""
    if params.max_thinking_tokens is None:
        return
    if params.thinking_end_token_ids is None:
        raise ValueError("thinking_end_token_ids: required with max_thinking_tokens")
    if isinstance(params.thinking_interruption, str):
        raise ValueError("thinking_interruption: the engine takes token ids, not text")


def awaits_budget(request: Request) -> bool:
    """Whether the request's next position must wait for the result of the token before it
    (async scheduling plans a step before the last one's result is applied): its input is an
    output not yet applied after which the budget may be spent, when the position is the
    first forced id's replay (what the applied token decides) rather than a decode token."""
    p = request.params
    if p.max_thinking_tokens is None or request.thinking_closed:
        return False
    index = request.num_scheduled - request.num_prompt_tokens  # (the output it takes as input)
    return index >= len(request.output_token_ids) and index + 1 >= p.max_thinking_tokens


def forced_ids(interruption: tuple[int, ...], end: tuple[int, ...]) -> list[int]:
    """The ids forced at the budget: the interruption, then the end ids unless the interruption
    holds them already. vLLM's forced end string includes ``</think>`` (``"Time is
    up.</think>"``), and a config ported from it would otherwise close the span twice: a stray
    ``</think>`` in the answer, and a model conditioned on it."""
    n = len(end)
    closes = any(interruption[i : i + n] == end for i in range(len(interruption) - n + 1))
    return list(interruption) if closes else [*interruption, *end]


def force_at_start(request: Request) -> None:
    """A budget of 0: records the forced ids as the request's first outputs (as many as
    ``max_tokens`` and the context leave room for) before it runs (see the module doc)."""
    p = request.params
    if p.max_thinking_tokens != 0:
        return
    request.thinking_closed = True
    forced = forced_ids(p.thinking_interruption or (), p.thinking_end_token_ids)
    forced = forced[: request.max_outputs]
    request.output_token_ids.extend(forced)
    request.exit_depths.extend([request.num_loops] * len(forced))
    request.num_forced = len(forced)
    request.forced_unsent = True
    if p.logprobs is not None:  # (scored by the prompt's last chunk and the replay items)
        request.forced_scores = dict.fromkeys(range(len(forced)))
    request.replay_until = request.num_prompt_tokens + len(forced) - 1


def force_thinking_end(request: Request, update: RequestUpdate) -> bool:
    """Called after each sampled token of a request still running. Appends the forced ids when
    the thinking budget is spent (see the module doc); True when that filled the request's
    ``max_tokens`` or context (it ends with LENGTH)."""
    p = request.params
    if p.max_thinking_tokens is None or request.thinking_closed:
        return False
    out = request.output_token_ids
    end = p.thinking_end_token_ids
    if tuple(out[-len(end) :]) == end:
        request.thinking_closed = True
        return False
    if len(out) < p.max_thinking_tokens:
        return False
    request.thinking_closed = True
    forced = forced_ids(p.thinking_interruption or (), end)
    room = request.max_outputs - len(out)
    forced = forced[: max(0, room)]
    depth = request.num_loops
    if p.logprobs is not None:  # (scored later: the module doc)
        slots = request.forced_scores = request.forced_scores or {}
        slots.update(dict.fromkeys(range(len(out), len(out) + len(forced))))
    for token in forced:
        out.append(token)
        request.exit_depths.append(depth)
        update.new_token_ids.append(token)
        update.new_exit_depths.append(depth)
        update.new_logprobs.append(None)
        update.new_top_logprobs.append(None)
        update.add_rank(None)
    request.num_forced += len(forced)
    # Positions up to the last forced id's are recomputed from recorded inputs (replay items).
    request.replay_until = request.num_prompt_tokens + len(out) - 1
    return len(forced) == room
