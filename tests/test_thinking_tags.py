"""The thinking tags' ids as the chat path looks them up per request (``thinking.tag_id``):
from the tokenizer's cache, not a copy of the whole vocabulary per request (about 28 ms at
Ouro's 49k ids, on the server's event loop for every chat request)."""

from __future__ import annotations

import pytest

from rltserve.http.auto_tools import tool_tag_ids
from rltserve.models.tokenizer import load_tokenizer
from rltserve.sampling import SamplingParams
from rltserve.thinking import (
    ChatPrompt,
    bound_thinking,
    chat_prompt,
    ids_open_thinking,
    reasoning_kept_ids,
    resolve_thinking,
    tag_id,
)


@pytest.fixture()
def counted(tiny, monkeypatch):
    """The ouro-tiny tokenizer, and the list of its whole-vocabulary reads from now on."""
    tok = load_tokenizer(tiny)
    reads = []
    read = tok.backend.get_vocab
    monkeypatch.setattr(tok.backend, "get_vocab", lambda: reads.append(1) or read())
    return tok, reads


def _render(tok):
    def render(turns, generation_prompt, continue_final):
        return tok.apply_chat_template(
            turns, generation_prompt, tokenize=False, continue_final_message=continue_final
        )

    return render


def test_chat_requests_do_not_read_the_whole_vocabulary_each(counted):
    tok, reads = counted
    vocab = tok.get_vocab()
    reads.clear()
    render = _render(tok)
    think = [{"role": "user", "content": "What does <think> do?"}]
    first = chat_prompt(render, think, True, False, {}, tok)  # (tags looked up once here)
    warm = len(reads)
    budget = SamplingParams(max_thinking_tokens=4)
    for i in range(20):
        plain = [{"role": "user", "content": f"Question {i}"}]
        assert chat_prompt(render, plain, True, False, {}, tok).thinking is False
        assert chat_prompt(render, think, True, False, {}, tok) == first
        ids = tok.encode("<think>\nso", add_special_tokens=False)
        assert ids_open_thinking(ids, tok)
        resolved = resolve_thinking(budget, tok)
        assert resolved.thinking_end_token_ids == (vocab["</think>"],)
        assert bound_thinking(resolved, ids, tok) is resolved
        reasoning_kept_ids(tok)
        tool_tag_ids(tok, "hermes")
    assert first == ChatPrompt(first.text, False)
    assert len(reads) - warm <= 2  # (the tool tags' first look-ups), none per request after


def test_tag_id_reads_a_tokenizer_without_a_cache_whole():
    class Plain:  # (a tokenizer with get_vocab alone)
        def get_vocab(self):
            return {"<think>": 3}

    assert tag_id(Plain(), "<think>") == 3
    assert tag_id(Plain(), "</think>") is None
    assert tag_id(None, "<think>") is None
