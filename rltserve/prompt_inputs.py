"""The offline API's prompts in vLLM's forms, as the token ids the engine takes: text, token ids
(a list, a NumPy array or a tensor), ``{"prompt": text}`` or ``{"prompt_token_ids": ids}``; and
chat messages as the chat template takes them. Every check here is one the engine makes too,
made before anything is submitted."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from rltserve.caller_values import outside_vocab, plain_number
from rltserve.http.chat_messages import joined_text_parts, template_role, template_tool_calls


# (Optional keys through ``total=False`` bases: ``typing.NotRequired`` is Python 3.11's.)
class _Salted(TypedDict, total=False):
    cache_salt: str


class TextPrompt(_Salted):
    """vLLM's text prompt dict (``vllm.inputs.TextPrompt``)."""

    prompt: str


class _SaltedText(_Salted, total=False):
    prompt: str


class TokensPrompt(_SaltedText):
    """vLLM's token-id prompt dict (``vllm.inputs.TokensPrompt``); ``prompt``: its text, for
    the output's ``prompt``."""

    prompt_token_ids: list[int]


PromptInput = str | Sequence[int] | Mapping[str, Any]
_PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")
# vLLM's keys that ask for nothing when empty, not only when None (text only here).
_EMPTY_OK = ("mm_processor_kwargs",)


def prompt_text(prompt: PromptInput) -> str | None:
    """The prompt's text, when it came as text."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Mapping):
        return prompt.get("prompt")
    return None


def prompt_cache_salt(prompt: PromptInput) -> str | None:
    """The prompt dict's ``cache_salt`` (vLLM's), None without one."""
    if not isinstance(prompt, Mapping) or prompt.get("cache_salt") is None:
        return None
    salt = prompt["cache_salt"]
    if not isinstance(salt, str) or not salt:
        raise ValueError(f"cache_salt={salt!r:.80}: must be a non-empty string (or None)")
    return salt


def normalize_prompts(prompts: object) -> list[PromptInput]:
    """One prompt or a list of them (a 1-D NumPy array of texts too), as a list."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if getattr(prompts, "ndim", None) == 1 and hasattr(prompts, "tolist"):
        texts = prompts.tolist()
        if all(isinstance(t, str) for t in texts):
            prompts = texts
    if not isinstance(prompts, Sequence):
        raise ValueError(f"prompts={prompts!r:.80}: must be a string, token ids or a list")
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        raise ValueError("prompts: pass a list of token-id lists, not one flat list of ids")
    return prompts


def token_id_prompts(ids: object, texts: object = None) -> list[dict[str, Any]]:
    """Older vLLM's ``generate(prompt_token_ids=...)``: one prompt's ids or a list of them, as
    prompt dicts; ``texts`` (None, one text or one per prompt) become their ``prompt``."""
    if hasattr(ids, "tolist") and not isinstance(ids, list):
        ids = ids.tolist()  # (a NumPy array or a tensor)
    if isinstance(ids, Mapping):  # (one prompt's encoding: ``check_ids``)
        batch = [ids]
    elif not isinstance(ids, Sequence) or isinstance(ids, (str, bytes)):
        raise ValueError(f"prompt_token_ids={ids!r:.80}: must be token ids or a list of them")
    else:
        # (an id may be a NumPy or torch scalar, ndim 0; a prompt a list, array or tensor)
        one = bool(ids) and not (isinstance(ids[0], Sequence) or getattr(ids[0], "ndim", 0) > 0)
        batch = [ids] if one else list(ids)
    if texts is None:
        return [{"prompt_token_ids": p} for p in batch]
    texts = [texts] if isinstance(texts, str) else texts
    if not isinstance(texts, Sequence) or len(texts) != len(batch):
        raise ValueError("prompts and prompt_token_ids: must be as many (the texts of the ids)")
    if not all(isinstance(t, str) for t in texts):
        raise ValueError("prompts: with prompt_token_ids, must be the prompts' texts")
    return [{"prompt": t, "prompt_token_ids": p} for t, p in zip(texts, batch)]


def encode_prompt(prompt: PromptInput, tokenizer, vocab_size: int) -> list[int]:
    """The prompt's token ids (text encoded with ``tokenizer``, which may be None)."""
    if isinstance(prompt, Mapping):
        # (vLLM's multimodal keys, which RL code sends as None for text: text only here)
        unknown = [k for k in prompt if k not in _PROMPT_KEYS and _asks(k, prompt[k])]
        if unknown:
            raise ValueError(
                f"prompt: unknown key {unknown[0]!r} (accepted: {', '.join(_PROMPT_KEYS)})"
            )
        if "prompt_token_ids" in prompt:
            return check_ids(prompt["prompt_token_ids"], vocab_size)
        if "prompt" not in prompt:
            raise ValueError("prompt: a dict needs 'prompt' or 'prompt_token_ids'")
        if not isinstance(prompt["prompt"], str):
            raise ValueError("prompt: the 'prompt' key must hold a string")
        prompt = prompt["prompt"]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(
                "prompt: text needs a tokenizer and there is no tokenizer "
                "(skip_tokenizer_init=True, or none in the checkpoint); pass token ids"
            )
        return tokenizer.encode_prompt(prompt)
    return check_ids(prompt, vocab_size)


def _asks(key: str, value: object) -> bool:
    """Whether a prompt dict's ``key`` asks for something rltserve would have to do."""
    if key in _EMPTY_OK and isinstance(value, Mapping):
        return bool(value)
    return value is not None


def check_ids(prompt: object, vocab_size: int) -> list[int]:
    """Token ids given as a list, a NumPy array or a tensor, as a list of ints in the
    vocabulary; or a tokenizer's encoding of one sequence (a mapping with ``input_ids``:
    transformers 5's ``apply_chat_template(..., tokenize=True)`` returns a BatchEncoding)."""
    if isinstance(prompt, Mapping) and "input_ids" in prompt:
        prompt = prompt["input_ids"]
        rows = prompt.tolist() if hasattr(prompt, "tolist") else prompt
        if isinstance(rows, Sequence) and any(isinstance(r, Sequence) for r in rows):
            raise ValueError(
                f"prompt: input_ids holds a batch of {len(rows)} sequences; pass one "
                "sequence's ids per prompt (input_ids[i])"
            )
    if hasattr(prompt, "tolist") and not isinstance(prompt, (str, list)):
        prompt = prompt.tolist()  # a NumPy array or a torch tensor of ids
    if not isinstance(prompt, Sequence) or isinstance(prompt, (str, bytes, bytearray)):
        # (bytes are a sequence of ints, but text, not token ids: decode them to a string)
        raise ValueError(f"prompt={prompt!r:.80}: must be a string or a list of token ids")
    ids = list(map(plain_number, prompt))
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError("prompt: token ids must be ints")
    if message := outside_vocab("prompt", ids, vocab_size):
        raise ValueError(message)
    return ids


def template_message(message: Mapping[str, Any], path: str) -> Mapping[str, Any]:
    """``message`` as the server's chat endpoint gives it to the template: OpenAI-style content
    parts (``[{"type": "text", "text": ...}]``) joined into one text (other content as it is),
    no content (None: an assistant turn that carries ``tool_calls``) as "" (vLLM's), the calls'
    JSON arguments as dicts (``template_tool_calls``), a ``developer`` message as ``system``.
    (The template's own normalisation would drop a None content, and templates read
    ``message.content``.)"""
    if callable(getattr(message, "model_dump", None)):
        message = message.model_dump()  # (a pydantic message, such as openai's)
    if not isinstance(message, Mapping):
        raise ValueError(f"{path}: must be a message, a dict with 'role' and 'content'")
    content = message.get("content")
    if content is None:
        message = {**message, "content": ""}
    elif isinstance(content, list):
        parts = [
            (p.get("type"), p.get("text")) if isinstance(p, Mapping) else (None, None)
            for p in content
        ]
        message = {**message, "content": joined_text_parts(parts, path)}
    calls = message.get("tool_calls")
    if calls:  # (templates render ``arguments | tojson``: a dict, as the server gives them)
        if not isinstance(calls, list):
            raise ValueError(f"{path}.tool_calls: must be a list of tool calls")
        message = {**message, "tool_calls": template_tool_calls(calls, f"{path}.tool_calls")}
    role = template_role(message.get("role"))
    return message if role == message.get("role") else {**message, "role": role}
