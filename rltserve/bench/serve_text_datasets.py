"""The text datasets ``rltserve bench serve`` reads (vLLM's ``--dataset-name sharegpt|custom``
with ``--dataset-path``): each request's prompt, its prompt tokens and its output tokens.

``sharegpt``: a JSON list of ``{"conversations": [{"from": "human"|"gpt", "value": ...}, ...]}``.
As vLLM's, in its order: the entries of at least 2 turns are kept (the others before the
shuffle, so they do not change it), shuffled by ``seed`` (vLLM's ``random.seed(seed)``, then
``random.shuffle``), then taken in that order, each giving its turn 0 as the prompt and turn 1
as the reply, whatever their roles (vLLM's), the reply's token count the output length
(``sharegpt_output_len`` replaces it); a pair whose lengths vLLM skips is passed over: a prompt
or (counted) reply under 4 tokens, a prompt over 1024, or prompt and output over 2048.

``custom``: JSONL, a ``"prompt"`` per line, every output ``custom_output_len`` tokens (vLLM's
default 256); shuffled by ``seed`` as vLLM's. Sent to ``/v1/completions`` a prompt goes in the
model's chat template (as one user message, with the generation prompt) unless
``skip_chat_template``.

Fewer usable prompts than ``num_prompts``: the list is filled with repeats of them, drawn as
vLLM oversamples (``random.seed(seed)``, then a ``random.choice`` per missing request), and
stderr says so.

Tokens are counted by the server's ``/tokenize`` (rltserve's and vLLM's; the counts are then the
server's own), or by the local tokenizer of ``--tokenizer``. A completions prompt is sent as
those token ids, so the prompt the server sees is the one counted; a chat prompt is sent as
text (the server applies its template: the report's prompt lengths are its ``usage``).
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rltserve.bench.serve_config import BenchConfig

# vLLM's ShareGPT filter (is_valid_sequence's defaults)
MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048


@dataclass(frozen=True)
class TextRequest:
    """One request of a text dataset: ``prompt`` as sent (token ids for completions, the text
    for chat), ``prompt_len`` its tokens counted (chat: the text's, without the template) and
    ``output_len`` its ``max_tokens``."""

    prompt: list[int] | str
    prompt_len: int
    output_len: int


def local_tokenizer(path: str) -> Any:
    """The tokenizer of ``--tokenizer`` (ValueError naming the flag where it has none)."""
    from rltserve.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(path)
    if tokenizer is None:
        raise ValueError(f"--tokenizer {path}: no tokenizer files there")
    return tokenizer


class TokenCounter:
    """Counts tokens with a local tokenizer (``--tokenizer``) or the server's ``/tokenize``."""

    def __init__(self, client: Any, tokenizer_path: str | None = None) -> None:
        self._client = client
        self._local = None if tokenizer_path is None else local_tokenizer(tokenizer_path)

    async def encode(self, text: str) -> list[int]:
        if self._local is not None:
            return self._local.encode(text)
        return await self._client.tokenize(text)

    async def render_chat(self, text: str) -> list[int]:
        """The prompt of ``text`` as one user message in the chat template."""
        messages = [{"role": "user", "content": text}]
        if self._local is not None:
            return list(self._local.apply_chat_template(messages, add_generation_prompt=True))
        return await self._client.tokenize(messages=messages, add_generation_prompt=True)


def read_sharegpt(path: str) -> list[tuple[str, str]]:
    """(turn 0, turn 1) of each conversation of at least 2 turns, in the file's order."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ValueError(f"--dataset-path {path}: not a ShareGPT JSON file ({exc})") from None
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path}: a ShareGPT file is a JSON list")
    pairs = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        # Kept whatever the turns hold (a turn without text gives "", too short to be sent):
        # dropping an entry here would change the shuffle of all the others.
        texts = [str(t.get("value", "")) if isinstance(t, dict) else "" for t in turns[:2]]
        pairs.append((texts[0], texts[1]))
    return pairs


def read_custom(path: str) -> list[str]:
    """The ``"prompt"`` of each line of a JSONL file."""
    prompts = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ValueError(
                f"--dataset-path {path}: line {number} is not a JSON object with a string 'prompt'"
            )
        prompts.append(record["prompt"])
    return prompts


async def text_requests(config: BenchConfig, counter: TokenCounter) -> list[TextRequest]:
    """``num_prompts`` requests of the dataset (see the module's docstring)."""
    rng = random.Random(config.seed)
    chat = config.endpoint == "chat"
    requests: list[TextRequest] = []
    if config.dataset == "sharegpt":
        pairs = read_sharegpt(config.dataset_path)
        rng.shuffle(pairs)
        for text, reply in pairs:
            if len(requests) == config.num_prompts:
                break
            ids = await counter.encode(text)
            fixed = config.sharegpt_output_len
            output_len = fixed or len(await counter.encode(reply))
            too_short = len(ids) < MIN_LEN or (fixed is None and output_len < MIN_LEN)
            too_long = len(ids) > MAX_PROMPT_LEN or len(ids) + output_len > MAX_TOTAL_LEN
            if not (too_short or too_long):
                requests.append(TextRequest(text if chat else ids, len(ids), output_len))
    else:
        texts = read_custom(config.dataset_path)
        rng.shuffle(texts)
        for text in texts[: config.num_prompts]:
            if chat:
                ids, prompt = await counter.encode(text), text
            else:
                templated = not config.skip_chat_template
                ids = await (counter.render_chat(text) if templated else counter.encode(text))
                prompt = ids
            requests.append(TextRequest(prompt, len(ids), config.custom_output_len))
    if not requests:
        raise ValueError(
            f"--dataset-path {config.dataset_path}: no usable prompt in it (sharegpt: a "
            f"conversation of 2 or more turns whose first two are within vLLM's lengths)"
        )
    if len(requests) < config.num_prompts:
        print(
            f"--dataset-path {config.dataset_path}: {len(requests)} usable prompts for "
            f"--num-prompts {config.num_prompts}; the rest repeat them (as vLLM oversamples)",
            file=sys.stderr,
        )
        again = random.Random(config.seed)  # (vLLM's: reseeded, then a choice per request)
        requests += [again.choice(requests) for _ in range(config.num_prompts - len(requests))]
    return requests
