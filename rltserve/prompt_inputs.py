"""The offline API's prompts in vLLM's forms, as the token ids the engine takes: text, token ids
(a list, a NumPy array or a tensor), ``{"prompt": text}`` or ``{"prompt_token_ids": ids}``; and
chat messages as the chat template takes them. Every check here is one the engine makes too,
made before anything is submitted."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rltserve.http.schemas import joined_text_parts, template_role
from rltserve.sampling import outside_vocab, plain_number

PromptInput = str | Sequence[int] | Mapping[str, Any]
_PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")


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
    """One prompt or a list of them, as a list."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
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
    if not isinstance(ids, Sequence) or isinstance(ids, (str, bytes)):
        raise ValueError(f"prompt_token_ids={ids!r:.80}: must be token ids or a list of them")
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
        unknown = [k for k in prompt if k not in _PROMPT_KEYS and prompt[k] is not None]
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


def check_ids(prompt: object, vocab_size: int) -> list[int]:
    """Token ids given as a list, a NumPy array or a tensor, as a list of ints in the
    vocabulary."""
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
    a ``developer`` message as ``system``."""
    if not isinstance(message, Mapping):
        return message
    content = message.get("content")
    if isinstance(content, list):
        parts = [
            (p.get("type"), p.get("text")) if isinstance(p, Mapping) else (None, None)
            for p in content
        ]
        message = {**message, "content": joined_text_parts(parts, path)}
    role = template_role(message.get("role"))
    return message if role == message.get("role") else {**message, "role": role}
