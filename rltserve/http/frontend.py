"""The engine as HTTP handlers see it: prompt preparation and per-request event streams.

``Frontend`` tokenizes and checks prompts (so that bad input is a 400 before anything streams;
long texts are encoded off the event loop, see ``encoding``) and opens ``Generation``s. A
``Generation`` (``generation``) is the set of engine requests behind one HTTP request.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from rltserve.caller_values import outside_vocab
from rltserve.core.engine_info import EngineInfo, EngineStats
from rltserve.core.request_checks import check_kv_policy, longest_prompt
from rltserve.core.stage import Sink
from rltserve.core.thinking import check_thinking
from rltserve.guide_index import GuideCompiler, after_open_span, check_bound
from rltserve.http.chat_messages import RESPONSE_ROLE
from rltserve.http.context_limit import prompt_too_long
from rltserve.http.encoding import TextCodec
from rltserve.http.errors import HTTPError, bad_request, in_batch
from rltserve.http.generation import Generation
from rltserve.http.metrics import ServingMetrics
from rltserve.http.structured_fields import compile_structured, requested
from rltserve.http.validation import param_of
from rltserve.models.tokenizer import Tokenizer, TokenizerError
from rltserve.prompt_truncation import truncated_prompt
from rltserve.sampling import SamplingParams
from rltserve.structured import StructuredOutputsParams
from rltserve.thinking import (
    ChatPrompt,
    bound_thinking,
    ids_open_thinking,
    resolve_thinking,
    think_tag_ids,
)

if TYPE_CHECKING:
    from rltserve.http.schemas import GenerationFields


class StageClientLike(Protocol):
    """What the server needs of a stage client (``StageClient``, ``InProcessStageClient``,
    ``ReplicaSetClient``)."""

    info: EngineInfo | None
    stats: EngineStats | None

    @property
    def alive(self) -> bool: ...

    def wait_ready(self, timeout: float | None = None) -> EngineInfo: ...
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        sink: Sink,
        group: str | None = None,
    ) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def close(self) -> None: ...


class SessionRoutedClient(StageClientLike, Protocol):
    """A stage client whose ``add_request`` also takes the request's session key, for replica
    affinity: ``ReplicaSetClient``, and ``SupervisedStage`` (what the frontend talks to), which
    hands the key on only to a client whose ``routes_by_session`` is true. Clients without that
    attribute keep the plain ``StageClientLike.add_request``."""

    @property
    def routes_by_session(self) -> bool: ...

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        sink: Sink,
        group: str | None = None,
        session: str | None = None,
    ) -> None: ...


@dataclass(frozen=True)
class PromptInput:
    """One prompt of a request: its token ids and, when it came as text, that text (echo)."""

    token_ids: list[int]
    text: str | None = None
    # Whether the prompt leaves a thinking span open, where a chat rendering decided it
    # (``thinking.ChatPrompt``: a <think> in a message's words opens none). None: judged from
    # ``token_ids``, as a raw prompt is (its caller wrote every tag in it).
    thinking: bool | None = None


@dataclass(frozen=True)
class ChoiceRequest:
    """One engine request behind an HTTP request: choice ``index`` samples prompt
    ``prompt_index``."""

    index: int
    prompt_index: int
    prompt: PromptInput
    params: SamplingParams
    group: str | None = None  # shared by the samples of one prompt: the stage prefills it once
    session: str | None = None  # the HTTP request's session key: its replica, under affinity
    # Special tokens whose text the choice's text keeps with skip_special_tokens (the
    # </think> that splits reasoning from content, where the tokenizer makes it special).
    kept_special_ids: frozenset[int] = frozenset()
    # What max_tokens is when the request sent none ("the rest of the context, 509 tokens"):
    # a refusal it causes says so, as the client never chose it. None: the client's own.
    default_max_tokens: str | None = None
    # The depth field as the request sent it ("max_loops", or Huginn's "num_steps"; None: not
    # sent): the param of a refusal for want of KV blocks, which the depth sizes.
    loops_param: str | None = None
    # Completions' echo with max_tokens=0 (scoring): the engine samples one token to finish
    # the prompt, which the response leaves out, and so do the generated-token metrics.
    prompt_only: bool = False


class Frontend:
    def __init__(
        self,
        client: SessionRoutedClient,
        info: EngineInfo,
        tokenizer: Tokenizer | None,
        metrics: ServingMetrics,
        executor: Executor | None = None,
        token_chars: int | None = None,
        template_defaults: dict | None = None,
        tokens_as_ids: bool = False,
        response_role: str = RESPONSE_ROLE,
    ) -> None:
        """``template_defaults``: the operator's template variables
        (``ServerConfig.default_chat_template_kwargs``), under each request's;
        ``tokens_as_ids``: ``ServerConfig.return_tokens_as_token_ids``, the requests'
        default; ``response_role``: ``ServerConfig.response_role``, chat answers' role."""
        self.client = client
        self.info = info
        self.tokenizer = tokenizer
        self.guides = GuideCompiler(tokenizer)  # (structured outputs' compiled constraints)
        self.metrics = metrics
        self.template_defaults = dict(template_defaults or {})
        self.tokens_as_ids = tokens_as_ids
        self.response_role = response_role
        # The thinking span's tags as token ids (None: not in the vocabulary), read once.
        self.think_ids: tuple[int | None, int | None] = think_tag_ids(tokenizer)
        self.codec = (
            TextCodec(tokenizer, info.max_model_len, executor, token_chars, info.pool_limited)
            if tokenizer is not None
            else None
        )
        self._ids = itertools.count()
        self._generations: set[Generation] = set()
        self._executor = executor

    # ------------------------------------------------------------------ prompts

    def require_codec(self, param: str) -> TextCodec:
        if self.codec is None:
            raise bad_request(f"{param}: this model has no tokenizer; send token ids", param)
        return self.codec

    async def completion_prompts(
        self,
        items: list,
        keep: int | None = None,
        add_special_tokens: bool = True,
        scored: bool = False,
    ) -> list[PromptInput]:
        """``items``: a request's prompts (``CompletionRequest.prompts``), texts or token ids;
        ``keep``: ``truncate_prompt_tokens`` (a truncated text echoes what was run);
        ``scored``: the prompts alone are asked for (``check_prompt``)."""
        if not items:
            raise bad_request("prompt: must not be empty", "prompt")
        out = []
        for index, item in enumerate(items):
            try:
                out.append(await self._completion_prompt(item, keep, add_special_tokens, scored))
            except HTTPError as exc:
                raise in_batch(exc, index, len(items)) from None
        return out

    async def _completion_prompt(
        self, item, keep: int | None, add_special_tokens: bool, scored: bool
    ) -> PromptInput:
        """One of ``completion_prompts``' items."""
        if not isinstance(item, str):
            ids = self.truncated(list(item), keep)
            return PromptInput(self.check_prompt(ids, "prompt", scored))
        codec = self.require_codec("prompt")
        if keep is None:
            ids = await codec.encode(item, "prompt", add_special_tokens)
        else:  # (a text too long for the context is what truncation is for)
            ids = await codec.encode_any(item, add_special_tokens)
        kept = self.truncated(ids, keep)
        return PromptInput(self.check_prompt(kept, "prompt", scored), item if kept is ids else None)

    def truncated(self, ids: list[int], keep: int | None) -> list[int]:
        """``ids`` as ``truncate_prompt_tokens=keep`` runs them
        (``prompt_truncation.truncated_prompt``); ``ids`` itself when nothing is cut."""
        try:
            return truncated_prompt(ids, keep, self.info.max_model_len)
        except ValueError as exc:
            raise bad_request(str(exc), "truncate_prompt_tokens") from exc

    async def chat_prompt(
        self,
        messages: list[dict],
        add_generation_prompt: bool,
        template_kwargs: dict | None,
        continue_final_message: bool = False,
        keep: int | None = None,
        add_special_tokens: bool = False,
    ) -> PromptInput:
        """``keep``: ``truncate_prompt_tokens``."""
        chat = await self._render_chat(
            messages, add_generation_prompt, template_kwargs, continue_final_message
        )
        ids = await self._encode_chat(chat.text, keep is None, add_special_tokens)
        kept = self.truncated(ids, keep)
        thinking = chat.thinking
        if thinking and kept is not ids:  # (the cut may have taken the span's <think> too)
            thinking = ids_open_thinking(kept, self.tokenizer)
        return PromptInput(self.check_prompt(kept, "messages"), thinking=thinking)

    async def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool,
        template_kwargs: dict | None,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """The conversation's prompt ids (``/tokenize``); a rendering too long to fit the
        context is a 400 before it is encoded. ``continue_final_message``: the last message
        left open (``Tokenizer.apply_chat_template``); ``add_special_tokens``: the tokenizer's
        special tokens on top of the template's."""
        chat = await self._render_chat(
            messages, add_generation_prompt, template_kwargs, continue_final_message
        )
        return await self._encode_chat(chat.text, True, add_special_tokens)

    async def _render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool,
        template_kwargs: dict | None,
        continue_final_message: bool,
    ) -> ChatPrompt:
        codec = self.require_codec("messages")
        template_kwargs = {**self.template_defaults, **(template_kwargs or {})}
        try:
            return await codec.chat(
                messages, add_generation_prompt, template_kwargs, continue_final_message
            )
        except TokenizerError as exc:
            raise bad_request(f"messages: {exc}", "messages") from exc
        except Exception as exc:  # noqa: BLE001 - template code raising on its input (jinja)
            raise bad_request(
                f"messages: the chat template failed: {type(exc).__name__}: {exc}", "messages"
            ) from exc

    async def _encode_chat(
        self, text: str, check_length: bool, add_special_tokens: bool
    ) -> list[int]:
        codec = self.require_codec("messages")
        if check_length:
            return await codec.encode(text, "messages", add_special_tokens)
        return await codec.encode_any(text, add_special_tokens)

    def check_prompt(self, ids: list[int], param: str, scored: bool = False) -> list[int]:
        """The engine's own admission checks, run here so they are a 400 before streaming.
        ``scored``: the prompt alone is asked for (echo with max_tokens=0), so it may fill the
        context as vLLM's may (``request_checks.longest_prompt``)."""
        info = self.info
        if not ids:
            raise bad_request(f"{param}: must contain at least one token", param)
        longest = longest_prompt(info.max_model_len, scored, info.pool_limited)
        if len(ids) > longest:  # first: it is cheap, a long scan is not
            message = prompt_too_long(len(ids), info.max_model_len, info.pool_limited)
            raise bad_request(message, param)
        self._check_vocab(ids, param)
        return ids

    def _check_vocab(self, ids: Sequence[int], param: str) -> None:
        if message := outside_vocab(param, ids, self.info.vocab_size):
            raise bad_request(message, param)

    def check_params(
        self, params: SamplingParams, prompt_ids: list[int], thinking: bool | None = None
    ) -> SamplingParams:
        """``params`` checked against the model, as ``prompt_ids`` run with them (bounded
        thinking in token ids, and only where the prompt leaves a thinking span open;
        ``thinking``: ``PromptInput.thinking``; a chat prompt's open span also defers structured
        outputs to the answer after it)."""
        cap = self.info.max_loops
        if params.max_loops is not None and params.max_loops > cap:
            raise bad_request(
                f"max_loops={params.max_loops}: this model allows at most {cap}", "max_loops"
            )
        try:  # (the engine's own check)
            check_kv_policy(params.kv_policy, self.info.kv_policy)
        except ValueError as exc:
            raise bad_request(str(exc), "kv_policy") from exc
        if params.max_thinking_tokens is not None:
            try:
                params = resolve_thinking(params, self.tokenizer)
            except ValueError as exc:
                raise bad_request(str(exc), param_of(str(exc))) from exc
        params = params.for_engine(self.info.vocab_size)
        for name, ids in params.vocab_token_ids():  # (the engine's own check)
            self._check_vocab(ids, name)
        params = bound_thinking(params, prompt_ids, self.tokenizer, thinking)
        params = after_open_span(params, thinking, self.think_ids[1])
        # (A 400 before a stream starts, naming the field as sent: ``plans``. The engine
        # checks again.)
        try:
            check_thinking(params)
            check_bound(params)
        except ValueError as exc:
            raise bad_request(str(exc), param_of(str(exc))) from exc
        return params

    async def structured(self, req: GenerationFields) -> StructuredOutputsParams | None:
        """The request's structured outputs compiled for the tokenizer, off the event loop
        (a schema's first compile on a large vocabulary takes seconds); None without."""
        if requested(req) is None:
            return None
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, compile_structured, req, self.guides)

    def token_text(self, token_id: int) -> str:
        """A token as logprobs show it: its text, or ``token_id:N`` without a tokenizer. The
        tokenizer's cached text: a response's logprobs name each id many times over (k top
        entries per token, an echoed prompt's once per choice), and a decode call for each held
        the event loop for seconds on a large ``n`` with ``echo``."""
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.token_text(token_id)

    def token_bytes(self, token_id: int) -> list[int]:
        """A token's bytes as chat logprobs list them (``Tokenizer.token_bytes``: a token that
        holds part of a character gives its own bytes, not U+FFFD's)."""
        if self.tokenizer is None:
            return list(self.token_text(token_id).encode())
        return list(self.tokenizer.token_bytes(token_id))

    async def prompt_text(self, prompt: PromptInput) -> str:
        if prompt.text is not None:
            return prompt.text
        return await self.codec.decode(prompt.token_ids) if self.codec is not None else ""

    # ------------------------------------------------------------------ generation

    def open(
        self, choices: list[ChoiceRequest], arrival: float, request_id: str = ""
    ) -> Generation:
        return Generation(self, choices, arrival, request_id)

    def next_stage_id(self) -> str:
        return f"http-{next(self._ids)}"

    def interrupt_all(self) -> None:
        """Ends every open generation with abort events (server shutdown)."""
        for generation in list(self._generations):
            generation.interrupt()

    @property
    def num_open(self) -> int:
        return len(self._generations)

    def open_request_ids(self) -> list[str]:
        """The HTTP request ids of the open generations, sorted."""
        return sorted(g.request_id for g in self._generations)

    def request_ids(self, stage_ids: Iterable[str]) -> list[str]:
        """The HTTP request ids whose choices had ``stage_ids``, sorted (a stage id no open
        generation has, as itself)."""
        wanted = set(stage_ids)
        names = {g.request_id for g in self._generations if g.stage_ids & wanted}
        owned = set().union(*(g.stage_ids for g in self._generations))
        return sorted(names | (wanted - owned))
