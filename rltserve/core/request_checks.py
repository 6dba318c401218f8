"""The checks a request's settings must pass against the engine's model and configuration
before it is admitted (each a ValueError naming the field); torch-free."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from rltserve.caller_values import outside_vocab
from rltserve.config import EngineConfig, SchedulerConfig
from rltserve.guide_index import check_bound
from rltserve.kv_policy import KVPolicy
from rltserve.sampling import REQUEST_KV_POLICIES, SamplingParams

if TYPE_CHECKING:
    from rltserve.core.engine_info import EngineInfo
    from rltserve.core.request import Request
    from rltserve.models.base import LoopedSpec


# How the refusal of a request larger than the whole KV pool ends (``Scheduler.add_request``):
# the HTTP API words it otherwise where the client sent no max_tokens (``http.generation``).
POOL_ADVICE = "; lower max_tokens or max_loops, or raise num_blocks"


def no_room(name: str, num_tokens: int, max_model_len: int, pool_limited: bool) -> str:
    """Why a prompt of ``num_tokens`` tokens cannot run: it is longer than the context, or
    (where the pool is the limit) fills it, leaving no room to generate."""
    why = " (what the KV pool holds: raise kv_cache_gb or num_blocks)"
    if num_tokens > max_model_len:
        head = f"{name}: {num_tokens} tokens exceed"
    else:
        head = f"{name}: {num_tokens} tokens leave no room to generate within"
    return f"{head} the maximum context length of {max_model_len} tokens" + (
        why if pool_limited else ""
    )


def longest_prompt(max_model_len: int, scored: bool, pool_limited: bool) -> int:
    """The most tokens a prompt may have: one less than the context, leaving room for a token;
    or, ``scored``, the whole context, the one token it then gets being the last position's
    prediction, whose KV is never written. Scored: the HTTP API's echo with max_tokens=0, and
    every offline request (vLLM's offline check refuses only a prompt longer than the context;
    one that fills it gets one token, ending "length"). Not where the pool holds only the
    context less that position."""
    return max_model_len if scored and not pool_limited else max_model_len - 1


def check_priority(priority: int, scheduling_policy: str) -> None:
    """vLLM's rule: a priority the engine would ignore (under ``fcfs``) is refused, not
    dropped silently."""
    if priority != 0 and scheduling_policy != "priority":
        raise ValueError(
            f"priority={priority}: priority scheduling is not enabled (this engine runs "
            f"scheduling_policy={scheduling_policy!r}; start it with "
            "scheduling_policy='priority')"
        )


def check_kv_policy(asked: str | None, policy: str) -> None:
    """A request's own KV policy (``asked``; None: the engine's) on an engine running
    ``policy``: the engine's own (a no-op), or on a full or last_exited engine the other of
    those two (they lay out planes alike). Any other needs planes the engine does not lay out."""
    if asked is None:
        return
    engine, request = KVPolicy.parse(policy), KVPolicy.parse(asked)
    if request == engine or (engine.per_depth and request.per_depth):
        return
    if engine.per_depth:
        raise ValueError(
            f"kv_policy={asked!r}: this engine runs kv_policy={policy!r}, where a request may "
            f"pick one of {REQUEST_KV_POLICIES} (shared and ring:K are the engine's choice)"
        )
    raise ValueError(
        f"kv_policy={asked!r}: this engine runs kv_policy={policy!r}, whose "
        "planes a request cannot change (full and last_exited engines take either)"
    )


def check_params(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    spec: LoopedSpec,
    config: EngineConfig,
    max_model_len: int,
    pool_limited: bool,
) -> SamplingParams:
    """The params as the engine runs them (vLLM's ``logprobs=-1`` as the vocabulary's size);
    raises ValueError for settings the model or the engine cannot run. ``pool_limited``: the
    context limit is the KV pool's, not the model's."""
    if not prompt_token_ids:
        raise ValueError("prompt: must contain at least one token")
    for name, ids in [("prompt", prompt_token_ids), *params.vocab_token_ids()]:
        if message := outside_vocab(name, ids, spec.vocab_size):
            raise ValueError(message)
    params = _bounded_logprobs(params, spec.vocab_size, config.model.max_logprobs)
    if len(prompt_token_ids) > longest_prompt(max_model_len, True, pool_limited):
        raise ValueError(no_room("prompt", len(prompt_token_ids), max_model_len, pool_limited))
    if params.max_loops is not None and params.max_loops > spec.max_loops:
        raise ValueError(
            f"max_loops={params.max_loops}: this model allows at most {spec.max_loops}"
        )
    sched = config.scheduler
    check_priority(params.priority, sched.scheduling_policy)
    if sched.exit_mode == "trace" and params.trace_depths is None:
        raise ValueError("trace_depths: required when the engine runs exit_mode='trace'")
    if sched.exit_mode != "trace" and params.trace_depths is not None:
        raise ValueError(
            f"trace_depths: only for an engine with exit_mode='trace' (this one runs "
            f"exit_mode={sched.exit_mode!r})"
        )
    if sched.async_scheduling and sched.exit_mode == "gate" and params.adaptive_exit:
        raise ValueError(
            f"exit_threshold={params.exit_threshold}: adaptive exit with "
            "async_scheduling needs exit_mode='delayed' (or 'trace'); the in-step "
            "exit rule would make every step wait for the previous one"
        )
    cap = params.max_loops or spec.num_loops
    check_kv_policy(params.kv_policy, config.cache.kv_policy)
    check_bound(params)
    if problem := model_field_problem(params.exit_criterion, params.init_state, spec):
        raise ValueError(problem)
    if params.min_loops > cap:
        raise ValueError(
            f"min_loops={params.min_loops}: above the {cap} loops this request runs at most "
            "(max_loops, or the model's loop count)"
        )
    if params.trace_depths and max(params.trace_depths) > cap:
        raise ValueError(
            f"trace_depths: depth {max(params.trace_depths)} is above the request's "
            f"{cap} loops at most"
        )
    return params


def model_field_problem(
    exit_criterion: str | None, init_state: str | None, model: LoopedSpec | EngineInfo
) -> str | None:
    """Why a model cannot take ``exit_criterion`` or ``init_state`` (a request's, or a server
    default's), else None: a gated model exits by its gate, and only Huginn has an initial
    state to set."""
    if exit_criterion is not None and model.has_gate:
        return (
            f"exit_criterion={exit_criterion!r}: this model's tokens exit by its learned "
            "gate (exit_threshold); the zero-shot criteria are for models without one "
            "(Huginn, Nanbeige)"
        )
    if init_state is not None and not model.needs_noise:
        return (
            f"init_state={init_state!r}: this model has no recurrent initial state to "
            "set (it starts from the embedding); init_state is for Huginn"
        )
    return None


def check_bans(request: Request, vocab_size: int) -> None:
    """min_tokens bans that leave no token to sample are refused."""
    banned, params = request.banned_ids, request.params
    if len(banned) >= vocab_size and banned[vocab_size - 1] < vocab_size:
        raise ValueError(
            f"min_tokens={params.min_tokens}: EOS and stop_token_ids are every token id, "
            "so no token could be sampled before min_tokens"
        )
    if banned and params.allowed_token_ids and set(params.allowed_token_ids) <= set(banned):
        raise ValueError(
            f"allowed_token_ids: every one is EOS or a stop_token_id, so no token could be "
            f"sampled before min_tokens={params.min_tokens}"
        )


def _bounded_logprobs(params: SamplingParams, vocab_size: int, cap: int) -> SamplingParams:
    """``params`` with vLLM's -1 (every token) as the vocabulary's size; a count above the
    engine's ``max_logprobs`` is refused."""
    changes = {}
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is None:
            continue
        if k == -1:
            k = changes[name] = vocab_size
        if cap != -1 and k > cap:
            raise ValueError(
                f"{name}={getattr(params, name)}: more than this engine's max_logprobs "
                f"({cap}; LLM(max_logprobs=N) raises it)"
            )
        if k > vocab_size:
            raise ValueError(f"{name}={k}: more than the vocabulary's {vocab_size} tokens")
    return params.replace(**changes) if changes else params


def check_pipelining(
    params: SamplingParams, cap: int, sched: SchedulerConfig, num_loops: int
) -> bool:
    """Whether a request of depth cap ``cap`` decodes with token pipelining on an engine of
    ``sched`` for a model of ``num_loops`` loops; a ValueError where it asks for it
    (``speculative=True``) and cannot have it."""
    if params.speculative is False or (params.speculative is None and not sched.speculative_tokens):
        return False
    reasons = []
    if not sched.speculative_tokens:
        reasons.append("the engine runs with speculative_tokens=0")
    if not params.greedy:
        reasons.append("it needs greedy sampling (temperature=0)")
    if params.adaptive_exit or cap != num_loops:
        reasons.append("it needs a fixed full depth (exit_threshold >= 1, max_loops unset)")
    if params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty:
        reasons.append("it does not combine with penalties")
    if sched.exit_mode == "trace":
        reasons.append("it does not combine with exit_mode='trace'")
    if params.max_thinking_tokens is not None:  # (forced ids would unwind drafts)
        reasons.append("it does not combine with bounded thinking (max_thinking_tokens)")
    if params.structured_outputs is not None:  # (a draft ignores the constraint: rejected)
        reasons.append("it does not combine with structured outputs")
    if reasons and params.speculative:
        raise ValueError("speculative=True: " + "; ".join(reasons))
    return not reasons
