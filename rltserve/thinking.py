"""Bounded thinking on the front end: ``SamplingParams`` thinking fields resolved to token ids,
as the engine takes them (``core/thinking.py`` does the forcing), the span a chat prompt opens
(``ChatPrompt``), and the split of a chat answer into its thinking span and the rest
(``reasoning_content`` and ``content``)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rltserve.sampling import SamplingParams

THINK_START = "<think>"
THINK_END = "</think>"
# ChatML's turn start (Ouro's and Nanbeige's templates): a prompt's thinking span is opened in
# the turn being answered, after the last one; a <think> before it (in a user's words, which
# encode to the very same token) opens none. A prompt without one is judged whole.
TURN_START = "<|im_start|>"


def tag_id(tokenizer, tag: str) -> int | None:
    """``tag``'s token id (None: not in the vocabulary, or no tokenizer). rltserve's
    ``Tokenizer`` answers from a cache (``Tokenizer.token_id``): the chat path asks on every
    request, and ``get_vocab`` copies the whole vocabulary (tens of ms at 50k ids and more).
    Another tokenizer (one with ``get_vocab`` alone) is read whole."""
    if tokenizer is None:
        return None
    lookup = getattr(tokenizer, "token_id", None)
    if callable(lookup):
        return lookup(tag)
    return tokenizer.get_vocab().get(tag)


def think_end_ids(tokenizer) -> tuple[int, ...]:
    """The tokenizer's ``</think>`` as token ids; ValueError when it has no such token."""
    token = tag_id(tokenizer, THINK_END)
    if token is None:
        why = "no tokenizer is loaded" if tokenizer is None else f"the tokenizer has no {THINK_END}"
        raise ValueError(f"thinking_end_token_ids: required ({why})")
    return (token,)


def resolve_thinking(params: SamplingParams, tokenizer) -> SamplingParams:
    """``params`` with ``thinking_end_token_ids`` filled in (default: ``</think>``) and a text
    ``thinking_interruption`` tokenized (without special tokens). Where the tokenizer has
    neither ``<think>`` nor ``</think>`` and no end ids are named, ``params`` without the
    budget: no prompt can open a span there, so the bound is a no-op (one ``SamplingParams``
    serves every model), not an error."""
    end = params.thinking_end_token_ids
    if end is None:
        if tokenizer is not None and think_tag_ids(tokenizer) == (None, None):
            return params.replace(max_thinking_tokens=None)
        end = think_end_ids(tokenizer)
    interruption = params.thinking_interruption
    if isinstance(interruption, str):
        if tokenizer is None:
            raise ValueError("thinking_interruption: text needs a tokenizer; pass token ids")
        interruption = tuple(tokenizer.encode(interruption, add_special_tokens=False))
    return params.replace(thinking_end_token_ids=end, thinking_interruption=interruption)


def reasoning_kept_ids(tokenizer) -> frozenset[int]:
    """The ``</think>`` id where the tokenizer makes it a special token: a reasoning split needs
    its text, which ``skip_special_tokens`` would drop (and with it the split)."""
    token = tag_id(tokenizer, THINK_END)
    return frozenset({token}) if token in getattr(tokenizer, "special_ids", ()) else frozenset()


def split_reasoning(text: str, prompt_open: bool) -> tuple[str | None, str]:
    """(reasoning, content) of a chat answer. The thinking span runs from the start of the
    answer when the prompt left ``<think>`` open (else from a ``<think>`` the answer opens) to
    ``</think>``; an answer still thinking is all reasoning. None: no thinking span."""
    if not prompt_open:
        stripped = text.lstrip()
        if not stripped.startswith(THINK_START):
            return None, text
        text = stripped[len(THINK_START) :]
    reasoning, sep, content = text.partition(THINK_END)
    if not sep:
        return reasoning, ""
    return reasoning, content


def prompt_opens_thinking(prompt_text: str) -> bool:
    """Whether a rendered prompt ends inside a thinking span: its last ``<think>`` is not
    closed, and comes after the last ``TURN_START``."""
    start = prompt_text.rfind(THINK_START, max(prompt_text.rfind(TURN_START), 0))
    return start >= 0 and prompt_text.find(THINK_END, start) < 0


def ids_open_thinking(ids: list[int], tokenizer) -> bool:
    """Whether prompt ids end inside a thinking span: a ``<think>`` token after the last
    ``</think>`` token and the last ``TURN_START`` token where the vocabulary has one (False
    for a tokenizer without ``<think>`` and ``</think>``)."""
    return bool(_open_span(ids, tokenizer))


def think_tag_ids(tokenizer) -> tuple[int | None, int | None]:
    """The ids of ``<think>`` and ``</think>`` (None: not in the vocabulary)."""
    return tag_id(tokenizer, THINK_START), tag_id(tokenizer, THINK_END)


def _open_span(ids: list[int], tokenizer) -> bool | None:
    """As ``ids_open_thinking``; None where the tokenizer has no such tokens to tell by."""
    start, end, turn = (tag_id(tokenizer, tag) for tag in (THINK_START, THINK_END, TURN_START))
    if start is None or end is None:
        return None
    for token in reversed(ids):
        if token in (end, turn):  # (a turn of None: no id equals it)
            return False
        if token == start:
            return True
    return False


def bound_thinking(
    params: SamplingParams, prompt_ids: list[int], tokenizer, thinking: bool | None = None
) -> SamplingParams:
    """``params`` as they apply to ``prompt_ids``: a thinking budget bounds the span the prompt
    leaves open; a prompt that opens none (or closes its own) runs without it, since forcing
    ``</think>`` into a plain answer would corrupt it. Kept where the tokenizer has no
    ``<think>`` and ``</think>`` tokens to tell by (the caller named the end ids).
    ``thinking``: whether the prompt leaves a span open where its chat rendering decided it
    (``ChatPrompt.thinking``); None: judged from ``prompt_ids``, as a raw prompt is."""
    if params.max_thinking_tokens is None:
        return params
    if thinking is None:
        thinking = _open_span(prompt_ids, tokenizer)
    if thinking is not False:
        return params
    return params.replace(max_thinking_tokens=None)


class ReasoningStream:
    """Splits a streamed answer whose prompt left ``<think>`` open into reasoning and content
    deltas: text before ``</think>`` is reasoning, after it content, the tag itself neither. A
    tail that could be the start of the tag is held back until the next delta (or ``flush``)."""

    def __init__(self) -> None:
        self.thinking = True
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of one delta."""
        if not self.thinking:
            return "", text
        text = self._held + text
        self._held = ""
        before, sep, after = text.partition(THINK_END)
        if sep:
            self.thinking = False
            return before, after
        keep = next(
            (k for k in range(min(len(THINK_END) - 1, len(text)), 0, -1)
             if THINK_END.startswith(text[-k:])),
            0,
        )  # fmt: skip
        if keep:
            self._held = text[-keep:]
            text = text[:-keep]
        return text, ""

    def flush(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        return (held, "") if self.thinking else ("", held)


def with_thinking_prefix(prompt_text: str, start: int = 0) -> str:
    """A rendered chat prompt asked to think (``enable_thinking``): ``<think>\\n`` appended, as
    the Ouro-Thinking recipes do, unless the template wrote a ``<think>`` in its generation
    region (after ``start``, where that region begins: ``ChatPrompt``; and after its last
    ``TURN_START``): one it left open is the span already, and one it opened and closed (the
    "thinking off" pre-fill of Qwen3-style templates, ``<think>\\n\\n</think>\\n\\n``) is the
    template's decision, which a new ``<think>`` would turn into an answer all reasoning."""
    region = prompt_text[start:]
    if THINK_START in region[max(region.rfind(TURN_START), 0) :]:
        return prompt_text
    return prompt_text + THINK_START + "\n"


def chat_prompt_text(
    rendered: str,
    add_generation_prompt: bool,
    template_kwargs: Mapping[str, Any],
    tokenizer,
    start: int = 0,
) -> str:
    """A conversation rendered by its chat template, as the engine takes it (the server's chat
    endpoint and ``LLM.chat`` alike): a generation prompt asked to think (``enable_thinking``)
    gets the thinking prefix (``with_thinking_prefix``, ``start`` its generation region) where
    the vocabulary has a ``<think>`` token (elsewhere, as Huginn's, it would be six tokens of
    text the model never learned; the template still gets ``enable_thinking``)."""
    if (
        add_generation_prompt
        and template_kwargs.get("enable_thinking")
        and tokenizer.has_think_token
    ):
        return with_thinking_prefix(rendered, start)
    return rendered


# A chat template applied with the request's template variables: (messages,
# add_generation_prompt, continue_final_message) -> text.
ChatRenderer = Callable[[Sequence[Mapping[str, Any]], bool, bool], str]


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation rendered as the engine takes it (``chat_prompt``).

    Its generation region is what follows the messages: the template's generation prompt and
    the thinking prefix rltserve appends, or with ``continue_final_message`` the final message
    being continued. Only a thinking span opened there is the answer's: a ``<think>`` in a
    user's or system's words (which encode to the very same token) opens none."""

    text: str
    # Whether the generation region leaves a thinking span open (None: the tokenizer has no
    # <think> and </think> tokens to tell by). The reasoning split and the thinking budget
    # both follow it.
    thinking: bool | None


def chat_prompt(
    render: ChatRenderer,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
    continue_final_message: bool,
    template_kwargs: Mapping[str, Any],
    tokenizer,
) -> ChatPrompt:
    """``messages`` rendered (``chat_prompt_text``) and their generation region judged. The
    region starts where the rendering parts from the messages before it rendered without a
    generation prompt; that second rendering is made only where the prompt holds ``<think>``
    text at all (else nothing but the thinking prefix can open a span), and where the template
    refuses it the whole prompt counts, as a raw prompt's does."""
    rendered = render(messages, add_generation_prompt, continue_final_message)
    start = len(rendered)
    if THINK_START in rendered and tokenizer.has_think_token:
        before = messages[:-1] if continue_final_message else messages
        start = len(os.path.commonprefix([rendered, _rendered_or_empty(render, before)]))
    text = chat_prompt_text(rendered, add_generation_prompt, template_kwargs, tokenizer, start)
    region = text[start:]
    # (A <think> token decodes to that text: a region without it cannot hold the token.)
    ids = tokenizer.encode(region, add_special_tokens=False) if THINK_START in region else []
    return ChatPrompt(text, _open_span(ids, tokenizer))


def _rendered_or_empty(render: ChatRenderer, messages: Sequence[Mapping[str, Any]]) -> str:
    if not messages:
        return ""
    try:
        return render(messages, False, False)
    except Exception:  # noqa: BLE001 - template code refusing a conversation without its end
        return ""
