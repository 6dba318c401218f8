"""Request bodies of the OpenAI-compatible endpoints, as strict frozen dataclasses.

Field names and defaults are OpenAI's (``max_tokens`` 16 for completions, ``temperature`` 1.0),
plus the common vLLM/SGLang extensions and the looped-model fields ``min_loops``, ``max_loops``
(alias ``num_steps``, Huginn's name), ``exit_threshold``, ``exit_criterion`` (the zero-shot
exit criteria of models without a gate: Huginn, Nanbeige), ``kv_policy`` (per request) and
``priority``, and bounded thinking (``max_thinking_tokens``, alias ``thinking_token_budget``,
vLLM's name; ``thinking_interruption``, text or token ids; ``thinking_end_token_ids``). Two opt-in
response extensions: ``return_exit_depths`` and ``return_token_ids`` add per-choice arrays.
Parsing is in ``validation``; ``validate()`` adds the cross-field rules; ``sampling_params``
maps a request onto ``SamplingParams``, whose ValueErrors name the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rltserve.generation_config import GENERATION_CONFIG_KEYS
from rltserve.http.chat_messages import (
    ChatMessage,
    check_generation_prompt,
    check_reasoning_effort,
    check_template_kwargs,
    template_variables,
)
from rltserve.http.config import MAX_N
from rltserve.http.structured_fields import requested
from rltserve.http.tool_choice import ForcedTools, check_tools, forced_tools
from rltserve.http.validation import SchemaError, param_of
from rltserve.prompt_truncation import truncation_error
from rltserve.samples import sample_seed
from rltserve.sampling import MAX_LOGPROBS, SamplingParams
from rltserve.structured import StructuredOutputsParams
from rltserve.thinking_budget import THINKING_BUDGET_ALIAS, thinking_budget

# OpenAI's default for completions; a prompt that leaves less room gets what is left (only a
# max_tokens the client asked for is held to the context).
COMPLETION_MAX_TOKENS = 16
# vLLM's seed range (int64). Sample j uses seed + j, which stays within what torch's generators
# take (up to 2**64 - 1).
SEED_RANGE = (-(2**63), 2**63 - 1)
PRIORITY_RANGE = SEED_RANGE  # (a 64-bit int, as vLLM's)
Prompt = str | list[int] | list[str] | list[list[int]]


UNSUPPORTED_FIELDS = ("guided_grammar", "use_beam_search")


@dataclass(frozen=True, kw_only=True)
class StreamOptions:
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


@dataclass(frozen=True, kw_only=True)
class GenerationFields:
    """Fields shared by completions and chat completions."""

    model: str | None = None
    # None: the server's default (the generation config's, else SamplingParams', vLLM's).
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = field(default=None, metadata={"range": SEED_RANGE})
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM / SGLang extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # looped-model extensions
    min_loops: int = 1
    max_loops: int | None = None
    num_steps: int | None = None  # Huginn's name for max_loops
    exit_threshold: float | None = None  # None: 1.0, or the named criterion's default
    exit_criterion: str | None = None
    kv_policy: str | None = None  # "full" or "last_exited", or the server's own (None: it)
    priority: int = field(default=0, metadata={"range": PRIORITY_RANGE})
    init_state: str | None = None  # Huginn: the recurrent state's start ("random" or "zero")
    # Bounded thinking (SamplingParams' fields): after this many output tokens inside the
    # thinking span, the engine appends the interruption and the end ids itself.
    max_thinking_tokens: int | None = None
    thinking_token_budget: int | None = None  # vLLM's name for max_thinking_tokens
    thinking_interruption: str | list[int] | None = None  # text, or token ids
    thinking_end_token_ids: list[int] | None = None
    return_exit_depths: bool = False
    return_token_ids: bool = False
    # vLLM's: logprobs name tokens "token_id:N" (None: the server's --return-tokens-as-token-ids)
    return_tokens_as_token_ids: bool | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: run only the prompt's last k tokens
    cache_salt: str | None = None  # vLLM's: prompts share prefix-cache blocks only within one
    # Structured outputs (``structured_fields``): OpenAI's response_format (vLLM's completions
    # take it too), vLLM's guided_* fields and its structured_outputs object; at most one.
    response_format: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_whitespace_pattern: Any = None
    structured_outputs: Any = None
    # vLLM's grammars and beam search: known so that asking for them is a clear 400 (ignored,
    # they would give unconstrained output that looks like an answer).
    guided_grammar: Any = None
    use_beam_search: bool = False

    def validate(self) -> None:
        for name in UNSUPPORTED_FIELDS:
            value = getattr(self, name)
            if value is not None and value is not False:
                raise SchemaError(name, f"{name}: not supported (no grammars or beam search)")
        requested(self)  # (a bad constraint's 400 before any prompt is encoded)
        if not 1 <= self.n <= MAX_N:
            raise SchemaError("n", f"n={self.n}: must be in [1, {MAX_N}]")
        if self.temperature is not None and not 0 <= self.temperature <= 2:  # OpenAI's range
            raise SchemaError("temperature", f"temperature={self.temperature}: must be in [0, 2]")
        keep = self.truncate_prompt_tokens
        if keep is not None and (why := truncation_error(keep)):
            raise SchemaError("truncate_prompt_tokens", why)
        if self.stream_options is not None and not self.stream:
            raise SchemaError("stream_options", "stream_options: only allowed when stream=true")
        for key in self.logit_bias or {}:
            if not (key.isascii() and key.isdigit()):
                why = f"logit_bias: key {key!r} is not a token id (digits, as '50256')"
                raise SchemaError("logit_bias", why)
        if (
            self.num_steps is not None
            and self.max_loops is not None
            and self.num_steps != self.max_loops
        ):
            raise SchemaError("num_steps", "num_steps: an alias of max_loops; they disagree")
        try:
            thinking_budget(self.max_thinking_tokens, self.thinking_token_budget)
        except ValueError as exc:
            raise SchemaError(THINKING_BUDGET_ALIAS, str(exc)) from None

    @property
    def forced_tools(self) -> ForcedTools | None:
        """The tool calls the request's ``tool_choice`` forces (chat's; structured outputs
        generate them)."""
        return None

    @property
    def thinking_budget(self) -> int | None:
        """``max_thinking_tokens``, or its alias ``thinking_token_budget``."""
        return thinking_budget(self.max_thinking_tokens, self.thinking_token_budget)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


@dataclass(frozen=True, kw_only=True)
class CompletionRequest(GenerationFields):
    prompt: Prompt
    max_tokens: int | None = None  # absent: COMPLETION_MAX_TOKENS, within the context
    # Sent as an explicit null: the rest of the context, as vLLM's (its default of 16 is for
    # an absent field only).
    max_tokens_null: bool = field(default=False, metadata={"null_of": "max_tokens"})
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    # vLLM's extension: each choice gets ``prompt_logprobs`` in vLLM's shape (per prompt
    # token {id: {logprob, rank, decoded_token}}, null for the first).
    prompt_logprobs: int | None = None
    # vLLM's: a text prompt is encoded with the tokenizer's special tokens (BOS); false for a
    # text that already holds them.
    add_special_tokens: bool = True

    def validate(self) -> None:
        super().validate()
        if self.best_of is not None and self.best_of != self.n:
            raise SchemaError("best_of", "best_of: only best_of == n is supported")
        if self.suffix:
            raise SchemaError("suffix", "suffix: not supported")
        for name in ("logprobs", "prompt_logprobs"):  # (the offline API's -1 is not HTTP's)
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise SchemaError(name, f"{name}={value}: must be in [0, {MAX_LOGPROBS}]")
        if self.max_tokens == 0 and not self.echo:
            raise SchemaError("max_tokens", "max_tokens=0: only with echo=true (the prompt alone)")
        if self.prompt_only and self.min_tokens:
            message = f"min_tokens={self.min_tokens}: must be 0 with max_tokens=0"
            raise SchemaError("min_tokens", message)

    @property
    def prompts(self) -> list:
        """The prompts: ``prompt`` is one text, one list of token ids, or a list of either."""
        p = self.prompt
        return [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)

    @property
    def prompt_only(self) -> bool:
        """``echo`` with ``max_tokens=0``: the response is the prompt (with its logprobs), as
        scoring clients ask (the engine still samples one token, which is left out)."""
        return self.echo and self.max_tokens == 0

    @property
    def top_logprobs(self) -> int | None:
        return self.logprobs


@dataclass(frozen=True, kw_only=True)
class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # OpenAI chat: up to the context limit
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # (vLLM's; refused)
    add_generation_prompt: bool = True
    # vLLM's: the final message (an assistant prefill) left open for the model to continue.
    continue_final_message: bool = False
    # vLLM's: each choice's content starts with the last message's text where that message is
    # the assistant's (``chat_messages.echoed_text``), as a continued prefill reads whole.
    echo: bool = False
    # vLLM's: special tokens added on top of what the chat template renders (off: templates
    # render their own).
    add_special_tokens: bool = False
    # vLLM's: false leaves the reasoning (``reasoning``, ``reasoning_content``) out.
    include_reasoning: bool = True
    # OpenAI's; a template variable (``reasoning_effort``), as vLLM and SGLang pass it.
    reasoning_effort: str | None = None
    # ``tools`` go to the template; a named ``tool_choice`` or "required" constrains the output
    # to the calls (``tool_choice``); "auto" is read for calls where the server enables it
    # (``auto_tools``; else a 400, ``check_auto_choice``); the legacy ``functions`` are known
    # so that asking for them is a clear 400 (``check_tools``).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # (false: "required" makes one call at most)
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    # OpenAI's audio output and web search: known so that asking for them is a clear 400.
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None

    def validate(self) -> None:
        # (first: the structured-output rules of ``super()`` read ``forced_tools``)
        check_tools(self.tools, self.tool_choice, self.functions, self.function_call)
        super().validate()
        if not self.messages:
            raise SchemaError("messages", "messages: must not be empty")
        for name in ("max_completion_tokens", "max_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise SchemaError(name, f"{name}={value}: must be >= 1")
        check_reasoning_effort(self.reasoning_effort)
        if self.modalities is not None and set(self.modalities) - {"text"}:
            raise SchemaError("modalities", 'modalities: only ["text"] is supported')
        for name in ("audio", "web_search_options"):
            if getattr(self, name) is not None:
                raise SchemaError(name, f"{name}: not supported (text generation only)")
        check_template_kwargs(self.chat_template_kwargs, self.chat_template)
        check_generation_prompt(self.add_generation_prompt, self.continue_final_message)
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise SchemaError("top_logprobs", "top_logprobs: requires logprobs=true")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise SchemaError("top_logprobs", f"top_logprobs: must be in [0, {MAX_LOGPROBS}]")

    @property
    def forced_tools(self) -> ForcedTools | None:
        return forced_tools(self.tools, self.tool_choice, self.parallel_tool_calls)

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.as_template_input(f"messages[{i}]") for i, m in enumerate(self.messages)]

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """The template variables: ``chat_template_kwargs`` with ``reasoning_effort`` and
        ``tools`` (the fields win over the same keys there) where given."""
        return template_variables(self.chat_template_kwargs, self.tools, self.reasoning_effort)

    @property
    def token_limit(self) -> int | None:
        """OpenAI's ``max_completion_tokens``, else its deprecated ``max_tokens`` (vLLM's
        order)."""
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens

    @property
    def token_limit_param(self) -> str:
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"


@dataclass(frozen=True, kw_only=True)
class TokenizeRequest:
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # vLLM's defaults: on for a prompt, off for messages (as chat has them); None: the default.
    add_special_tokens: bool | None = None
    return_token_strs: bool = False  # vLLM's: each token as the vocabulary spells it
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # (vLLM's; refused)
    # As chat's (``check_tools``): tools go to the template.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    reasoning_effort: str | None = None  # (as chat's: the same prompt)

    def validate(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise SchemaError("prompt", "prompt, messages: give exactly one")
        check_template_kwargs(self.chat_template_kwargs, self.chat_template)
        check_tools(self.tools, self.tool_choice, self.functions, self.function_call)
        check_reasoning_effort(self.reasoning_effort)
        if self.messages is not None:
            check_generation_prompt(self.add_generation_prompt, self.continue_final_message)

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """As ``ChatCompletionRequest.template_kwargs``."""
        return template_variables(self.chat_template_kwargs, self.tools, self.reasoning_effort)


@dataclass(frozen=True, kw_only=True)
class DetokenizeRequest:
    tokens: list[int]
    model: str | None = None
    # Special tokens are kept (vLLM's: its tokenizer's decode), so /tokenize of a chat comes
    # back whole; true drops them, as a completion's text does.
    skip_special_tokens: bool = False

    def validate(self) -> None:
        pass


def _prompt_logprobs(req: CompletionRequest | ChatCompletionRequest, logprobs: int | None):
    """How many top logprobs each prompt token needs: vLLM's ``prompt_logprobs``, or echo's
    ``logprobs`` (the larger when both are asked)."""
    if not isinstance(req, CompletionRequest):
        return None
    asked = [k for k in (req.prompt_logprobs, logprobs if req.echo else None) if k is not None]
    return max(asked) if asked else None


def sampling_params(
    req: CompletionRequest | ChatCompletionRequest,
    *,
    max_tokens: int,
    logprobs: int | None,
    sample_index: int,
    defaults: dict[str, object] | None = None,
    structured: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """The engine parameters of one choice (``structured``: its compiled constraint). Sample
    ``j`` of a seeded request uses ``seed + j`` (``sample_seed``: a derived -1 seeds too) so
    that n > 1 gives distinct but reproducible samples; a seed of -1 is none (vLLM's), for
    every sample. A sampling field the request leaves out takes ``defaults``' value (the
    server's generation config), else ``SamplingParams``' default."""
    given = {name: getattr(req, name) for name in GENERATION_CONFIG_KEYS}
    chosen = {name: (defaults or {}).get(name) if v is None else v for name, v in given.items()}
    sampling = {name: value for name, value in chosen.items() if value is not None}
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    seed = None if req.seed in (None, -1) else sample_seed(req.seed, sample_index)
    if req.min_tokens > max_tokens >= 1:  # (a max_tokens below 1 is SamplingParams' error)
        asked = req.max_tokens is not None or getattr(req, "max_completion_tokens", None)
        limit = f"max_tokens ({max_tokens})" if asked else f"the default max_tokens ({max_tokens})"
        raise SchemaError("min_tokens", f"min_tokens={req.min_tokens}: must be <= {limit}")
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            **sampling,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            seed=seed,
            stop=tuple(stop) if stop else None,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            logit_bias=(
                None if req.logit_bias is None else {int(k): v for k, v in req.logit_bias.items()}
            ),
            # Completions with echo and logprobs (or vLLM's prompt_logprobs): the prompt's, for
            # every choice.
            prompt_logprobs=_prompt_logprobs(req, logprobs),
            allowed_token_ids=req.allowed_token_ids,
            min_loops=req.min_loops,
            max_loops=req.max_loops if req.max_loops is not None else req.num_steps,
            exit_threshold=req.exit_threshold,
            exit_criterion=req.exit_criterion,
            kv_policy=req.kv_policy,
            priority=req.priority,
            init_state=req.init_state,
            logprobs=logprobs,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
            cache_salt=req.cache_salt,
            max_thinking_tokens=req.thinking_budget,
            structured_outputs=structured,
            thinking_interruption=(
                req.thinking_interruption
                if isinstance(req.thinking_interruption, str | None)
                else tuple(req.thinking_interruption)
            ),
            thinking_end_token_ids=(
                None if req.thinking_end_token_ids is None else tuple(req.thinking_end_token_ids)
            ),
        )
    except ValueError as exc:
        message = as_sent(req, str(exc))
        raise SchemaError(param_of(message), message) from exc


def as_sent(req: CompletionRequest | ChatCompletionRequest, message: str) -> str:
    """``message`` with the field named as the client sent it: ``num_steps`` (Huginn's name)
    where it names ``max_loops``, ``thinking_token_budget`` (vLLM's) where it names
    ``max_thinking_tokens``."""
    if req.max_loops is None and req.num_steps is not None and message.startswith("max_loops="):
        return "num_steps" + message[len("max_loops") :]
    alias = req.max_thinking_tokens is None and req.thinking_token_budget is not None
    if alias and message.startswith("max_thinking_tokens"):
        return "thinking_token_budget" + message[len("max_thinking_tokens") :]
    return message
