"""Turning a parsed completion or chat request into a ``GenerationPlan``: prompts tokenized and
checked, one ``ChoiceRequest`` per (prompt, sample), and the response format to render with.

Choice ``index`` is ``prompt_index * n + sample_index``, as OpenAI numbers them. With ``n > 1``
the samples of one prompt form a group: the stage computes the prompt once for all of them.

A request without ``max_tokens`` gets its default (chat, and completions' explicit null: all the
context its prompt leaves; completions without the field: 16, or less if the context ends
sooner), within what the KV pool holds for it alone at its depth; one whose prompt plus the
``max_tokens`` it asked for exceeds the context is a 400 (as in vLLM), never silently shortened.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass

from rltserve.http.auto_tools import AutoToolFormat, tool_tag_ids
from rltserve.http.chat_messages import answer_role, echoed_text
from rltserve.http.context_limit import tokens_too_many
from rltserve.http.errors import HTTPError, bad_request, in_batch
from rltserve.http.frontend import ChoiceRequest, Frontend, PromptInput
from rltserve.http.responses import ChatFormat, CompletionFormat, ResponseHeader
from rltserve.http.schemas import (
    COMPLETION_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    as_sent,
    sampling_params,
)
from rltserve.http.state import ServingState
from rltserve.http.tool_calls import ToolCallFormat
from rltserve.http.tool_choice import asks_auto
from rltserve.http.validation import param_of
from rltserve.structured import StructuredOutputsParams
from rltserve.thinking import reasoning_kept_ids


@dataclass(frozen=True)
class GenerationPlan:
    """What ``deliver`` needs to run one generating request."""

    choices: list[ChoiceRequest]
    format: CompletionFormat | ChatFormat
    stream: bool
    include_usage: bool
    continuous_usage: bool
    prompt_tokens: int  # each prompt once, however many choices sample it
    arrival: float  # time.monotonic() when the request arrived
    prompt_only: bool = False  # ``CompletionRequest.prompt_only``: no completion tokens

    @property
    def request_id(self) -> str:
        """The response's id, which names the request in log lines."""
        return self.format.header.id

    def prompts(self) -> list[PromptInput]:
        """Each prompt once, in order."""
        return list({c.prompt_index: c.prompt for c in self.choices}.values())

    def completion_tokens(self, generation) -> int:
        """What ``usage`` counts of ``generation``'s tokens (a ``Generation``)."""
        return 0 if self.prompt_only else generation.num_completion_tokens()


def _token_limit(
    asked: int | None,
    param: str,
    frontend: Frontend,
    prompt: PromptInput,
    default: int | None,
    max_loops: int | None,
) -> tuple[int, str | None]:
    """The max_tokens a choice runs with, and, where the client named none, what it is (in
    ``ChoiceRequest.default_max_tokens``' words): ``default`` (None: all the context leaves)
    within the context and within what the KV pool holds for the request alone at its depth
    (``EngineInfo.context_alone``), so that it runs and ends "length" there. Asked for more than
    the context holds, a 400."""
    info, prompt_len = frontend.info, len(prompt.token_ids)
    if asked is not None:
        if prompt_len + asked > info.max_model_len:
            message = tokens_too_many(prompt_len, asked, info.max_model_len, info.pool_limited)
            raise bad_request(message, param)
        return asked, None
    rest = info.max_model_len - prompt_len
    # (At least 1: a prompt the pool cannot hold at this depth is the engine's refusal.)
    held = max(1, info.context_alone(max_loops) - prompt_len)
    limit = min(rest, held) if default is None else min(default, rest, held)
    if limit == rest:
        what = "the rest of the context"
    elif limit == held:
        what = "what the KV cache holds for it at this depth"
    else:
        what = "the server default"
    return limit, f"{what}, {limit} tokens"


def _default_max_tokens(state: ServingState, default: int | None = None) -> int | None:
    """What a request that names no max_tokens gets (None: the rest of the context, or the
    generation config's ``max_new_tokens``, as vLLM's), within the operator's
    ``max_tokens_limit``: chat clients rarely send one."""
    if default is None:
        default = state.sampling_defaults.get("max_tokens")
    limit = state.config.max_tokens_limit
    if limit is None or default is None:
        return default if limit is None else limit
    return min(default, limit)


def _with_loop_defaults(
    req: CompletionRequest | ChatCompletionRequest, state: ServingState, depth: int
) -> CompletionRequest | ChatCompletionRequest:
    """``req`` with the server's defaults (``sampling_defaults``) in the loop fields it left
    unset, and a request that asks no depth held to ``max_loops_limit`` when the default depth
    (the server's, else the model's ``depth``) is beyond it, as ``_default_max_tokens`` holds
    an unasked max_tokens to ``max_tokens_limit``."""
    defaults = state.sampling_defaults
    changes = {
        name: defaults[name]
        for name in ("exit_criterion", "exit_threshold", "init_state")
        if getattr(req, name) is None and defaults.get(name) is not None
    }
    if not _default_threshold_applies(req.exit_criterion, defaults):
        changes.pop("exit_threshold", None)
    if req.max_loops is None and req.num_steps is None:
        loops = defaults.get("max_loops")
        limit = state.config.max_loops_limit
        if limit is not None and (depth if loops is None else loops) > limit:
            loops = limit
        if loops is not None:
            changes["max_loops"] = loops
    return dataclasses.replace(req, **changes) if changes else req


def _default_threshold_applies(criterion: str | None, defaults: dict[str, object]) -> bool:
    """Whether the server's default ``exit_threshold`` applies to a request naming
    ``criterion``: a threshold is on its criterion's scale (kl's 5e-4, argmax-stability's whole
    loops), so a request naming another criterion than the default's takes that one's own
    default, as on a server without overrides (not a 400 for a threshold it never sent). A
    default threshold below 1 without a default criterion is kl's (README, Models)."""
    if criterion is None:
        return True
    own = defaults.get("exit_criterion")
    threshold = defaults.get("exit_threshold")
    if own is None and isinstance(threshold, (int, float)) and threshold < 1.0:
        own = "kl"
    return criterion == own


def _header(
    state: ServingState, prefix: str, response_id: str | None, model: str | None
) -> ResponseHeader:
    """``response_id``: the response's id (``cmpl-<X-Request-Id>``, as vLLM names it, from
    the handler); None: a fresh one. ``model``: the (checked) name the request gave, which
    the response repeats as vLLM's does; else the first served name."""
    rid = response_id or state.ids(prefix)
    return ResponseHeader(rid, int(state.clock()), model or state.model_name)


def _choices(
    frontend: Frontend,
    req: CompletionRequest | ChatCompletionRequest,
    prompts: list[PromptInput],
    max_tokens: int | None,
    logprobs: int | None,
    max_tokens_param: str = "max_tokens",
    default_max_tokens: int | None = None,
    session: str | None = None,
    defaults: dict[str, object] | None = None,
    structured: StructuredOutputsParams | None = None,
) -> list[ChoiceRequest]:
    choices = []
    loops_param = next((n for n in ("max_loops", "num_steps") if getattr(req, n) is not None), None)
    max_loops = req.max_loops if req.max_loops is not None else req.num_steps
    for p, prompt in enumerate(prompts):
        try:
            limit, unsent = _token_limit(
                max_tokens, max_tokens_param, frontend, prompt, default_max_tokens, max_loops
            )
        except HTTPError as exc:
            raise in_batch(exc, p, len(prompts)) from None
        prompt_only = limit == 0  # (echo's max_tokens=0: the engine samples one token, dropped)
        if prompt_only:
            limit = 1
        group = f"{uuid.uuid4().hex}-{p}" if req.n > 1 else None
        for j in range(req.n):
            params = sampling_params(
                req,
                max_tokens=limit,
                logprobs=logprobs,
                sample_index=j,
                defaults=defaults,
                structured=structured,
            )
            try:
                checked = frontend.check_params(params, prompt.token_ids, prompt.thinking)
            except HTTPError as exc:
                error, message = exc, as_sent(req, exc.message)
                if message != exc.message:  # (the field named as the client sent it)
                    error = bad_request(message, param_of(message))
                if p == 0:  # (the request's settings may be what is wrong: no prompt to name)
                    raise error from None
                raise in_batch(error, p, len(prompts)) from None  # (they passed for prompt 0)
            choices.append(
                ChoiceRequest(
                    p * req.n + j,
                    p,
                    prompt,
                    checked,
                    group,
                    session,
                    default_max_tokens=unsent,
                    loops_param=loops_param,
                    prompt_only=prompt_only,
                )
            )
    return choices


def check_sequences(state: ServingState, prompts: int, n: int) -> None:
    """A request of more sequences (prompts x n) than the server runs at once is a 400."""
    limit = state.gate.max_concurrent
    if prompts * n > limit:
        param = "prompt" if prompts > 1 else "n"  # (what the client can make smaller)
        what = f"{prompts} prompts x n = " if prompts > 1 else ""
        raise bad_request(
            f"{param}: {what}{prompts * n} sequences exceed the server's limit of "
            f"{limit} at once (--max-concurrent); send fewer per request",
            param,
        )


async def completion_plan(
    state: ServingState,
    req: CompletionRequest,
    arrival: float,
    session: str | None = None,
    response_id: str | None = None,
) -> GenerationPlan:
    """``session``: the request's session key (``http.session.session_key``), for affinity;
    ``response_id``: its response's id (``_header``)."""
    frontend = state.require_frontend()
    items = req.prompts
    # Before any prompt is tokenized: a million prompts would hold the event loop for a minute.
    check_sequences(state, len(items), req.n)
    prompts = await frontend.completion_prompts(
        items, req.truncate_prompt_tokens, req.add_special_tokens, req.prompt_only
    )
    default = _default_max_tokens(state, None if req.max_tokens_null else COMPLETION_MAX_TOKENS)
    choices = _choices(
        frontend,
        _with_loop_defaults(req, state, frontend.info.num_loops),
        prompts,
        req.max_tokens,
        req.logprobs,
        "max_tokens",
        default,
        session,
        state.sampling_defaults,
        await frontend.structured(req),
    )
    echo = {c.index: await frontend.prompt_text(c.prompt) for c in choices} if req.echo else {}
    header = _header(state, "cmpl", response_id, req.model)
    return GenerationPlan(
        choices=choices,
        format=CompletionFormat(header, req, frontend, echo),
        stream=req.stream,
        include_usage=req.include_usage or state.config.enable_force_include_usage,
        continuous_usage=req.continuous_usage,
        prompt_tokens=sum(len(p.token_ids) for p in prompts),
        arrival=arrival,
        prompt_only=req.prompt_only,
    )


async def chat_plan(
    state: ServingState,
    req: ChatCompletionRequest,
    arrival: float,
    session: str | None = None,
    response_id: str | None = None,
) -> GenerationPlan:
    """As ``completion_plan``."""
    frontend = state.require_frontend()
    check_sequences(state, 1, req.n)
    messages = req.template_messages()
    prompt = await frontend.chat_prompt(
        messages,
        req.add_generation_prompt,
        req.template_kwargs,
        req.continue_final_message,
        req.truncate_prompt_tokens,
        req.add_special_tokens,
    )
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    param = req.token_limit_param
    choices = _choices(
        frontend,
        _with_loop_defaults(req, state, frontend.info.num_loops),
        [prompt],
        req.token_limit,
        logprobs,
        param,
        _default_max_tokens(state),
        session,
        state.sampling_defaults,
        await frontend.structured(req),
    )
    forced = req.forced_tools  # (the answers are tool calls: no thinking span to split off)
    reasoning = bool(prompt.thinking) and forced is None  # (the split follows the budget's)
    # ("auto" tools: the server's parser reads the calls the answer writes, if any)
    parser = state.config.tool_call_parser if asks_auto(req.tools, req.tool_choice) else None
    kept = reasoning_kept_ids(frontend.tokenizer) if reasoning else frozenset()
    kept |= tool_tag_ids(frontend.tokenizer, parser) if parser else frozenset()
    if kept:
        choices = [dataclasses.replace(c, kept_special_ids=kept) for c in choices]
    header = _header(state, "chatcmpl", response_id, req.model)
    role = answer_role(req.add_generation_prompt, req.messages[-1].role, frontend.response_role)
    echo = echoed_text(messages, role) if req.echo else ""
    if forced is not None:
        format_: ChatFormat = ToolCallFormat(header, req, frontend, forced, echo=echo)
    elif parser is not None:
        format_ = AutoToolFormat(header, req, frontend, parser, reasoning=reasoning, echo=echo)
    else:
        format_ = ChatFormat(header, req, frontend, reasoning=reasoning, echo=echo)
    return GenerationPlan(
        choices=choices,
        format=format_,
        stream=req.stream,
        include_usage=req.include_usage or state.config.enable_force_include_usage,
        continuous_usage=req.continuous_usage,
        prompt_tokens=len(prompt.token_ids),
        arrival=arrival,
    )
