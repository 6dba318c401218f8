"""``OutputAssembler``'s text rules, as vLLM's: the text of the stop token (EOS or one of
``stop_token_ids``) that ended a request is left out unless ``include_stop_str_in_output``;
stop strings count only once more than ``min_tokens`` tokens exist (a match must end in a
later token's text, and may reach back into the earlier text by less than its length).
Tokens are single characters here (id = the character's code)."""

from __future__ import annotations

import pytest

from rltserve.outputs import Logprob, OutputAssembler, request_output, vllm_logprobs
from rltserve.updates import FinishReason, RequestUpdate


class _Chars:
    def add(self, token_id: int) -> str:
        return chr(token_id)

    def flush(self) -> str:
        return ""


class CharTokenizer:
    def detokenizer(self, prompt_token_ids, skip_special_tokens, kept_ids):
        return _Chars()


def assemble(text: str, finish: str | None, *, per_update: int = 1, **kw) -> OutputAssembler:
    asm = OutputAssembler("r", [1, 2], CharTokenizer(), **kw)
    ids = [ord(c) for c in text]
    chunks = [ids[i : i + per_update] for i in range(0, len(ids), per_update)]
    for k, chunk in enumerate(chunks):
        last = k == len(chunks) - 1
        reason = FinishReason(finish) if last and finish else None
        asm.add(RequestUpdate("r", chunk, [1] * len(chunk), finish_reason=reason))
        if asm.output.finish_reason is not None:
            break
    return asm


@pytest.mark.parametrize("per_update", [1, 3])
def test_the_stop_token_that_ended_it_is_not_in_the_text(per_update):
    out = assemble("abc!", "stop", per_update=per_update, stop_token_ids=(ord("!"),)).output
    assert out.text == "abc" and out.token_ids == [97, 98, 99, 33]
    assert out.finish_reason == "stop" and out.stop_reason == ord("!")
    kept = assemble("abc!", "stop", stop_token_ids=(33,), include_stop_str_in_output=True)
    assert kept.output.text == "abc!"
    eos = assemble("abc~", "stop").output  # EOS: not a stop_token_id, no stop_reason
    assert eos.text == "abc" and eos.stop_reason is None
    assert assemble("abc!", "length", stop_token_ids=(33,)).output.text == "abc!"


@pytest.mark.parametrize("per_update", [1, 2, 8])
def test_stop_strings_count_after_min_tokens(per_update):
    def run(min_tokens, text="heeeello"):
        asm = assemble(text, None, per_update=per_update, stop=("e",), min_tokens=min_tokens)
        return asm.output.text, asm.output.finish_reason, asm.output.stop_reason

    assert run(0) == ("h", "stop", "e")
    assert run(3) == ("hee", "stop", "e")  # the e's of the first 3 tokens do not count
    assert run(6) == ("heeeello", None, None)  # no e after the first 6
    asm = assemble("hello", "length", per_update=per_update, stop=("e",), min_tokens=4)
    assert asm.output.text == "hello" and asm.output.finish_reason == "length"


@pytest.mark.parametrize("include", [False, True])
def test_an_update_of_several_tokens_ends_at_the_stop_strings_token(include):
    """Tokens after the one that completes a stop string (a bounded thinking span's forced end
    arrives in one update with the token before it) are not part of the output: not in
    ``token_ids``, ``exit_depths`` or ``logprobs``, nor in the update's delta."""
    asm = OutputAssembler(
        "r", [1], CharTokenizer(), stop=("bc",), want_logprobs=True,
        include_stop_str_in_output=include, min_tokens=1,
    )  # fmt: skip
    first = RequestUpdate("r", [ord("x")], [4], new_logprobs=[-0.5], new_top_logprobs=[None])
    asm.add(first)
    ids = [ord(c) for c in "abcde"]
    update = RequestUpdate(
        "r", ids, [1, 2, 3, 4, 4], new_logprobs=[-1.0, -2.0, -3.0, None, None],
        new_top_logprobs=[None] * 5,
    )  # fmt: skip
    delta = asm.add(update)
    out = asm.output
    assert out.text == ("xabc" if include else "xa") and out.finish_reason == "stop"
    assert out.token_ids == [ord(c) for c in "xabc"] and out.exit_depths == [4, 1, 2, 3]
    assert [lp["logprob"] for lp in out.logprobs] == [-0.5, -1.0, -2.0, -3.0]
    assert delta.token_ids == ids[:3] and delta.exit_depths == [1, 2, 3]
    assert len(delta.logprobs) == 3 and delta.stop_reason == "bc"


@pytest.mark.parametrize("per_update", [1, 2, 5])
def test_which_stop_string_ends_it_does_not_depend_on_update_size(per_update):
    """The stop string completed by the earliest token wins (the first in the list of those,
    vLLM's order), however many tokens an update brings: "b" (token 3) before "abb" (token
    4)."""
    asm = assemble("cabbz", None, per_update=per_update, stop=("abb", "b"))
    assert (asm.output.text, asm.output.stop_reason) == ("ca", "b")
    assert asm.output.token_ids == [ord(c) for c in "cab"]
    # Both completed by one token: the first in the list, wherever it starts.
    asm = assemble("xaby", None, per_update=per_update, stop=("b", "ab"))
    assert (asm.output.text, asm.output.stop_reason) == ("xa", "b")
    asm = assemble("xaby", None, per_update=per_update, stop=("ab", "b"))
    assert (asm.output.text, asm.output.stop_reason) == ("x", "ab")


def test_a_stop_string_may_reach_back_into_the_first_min_tokens():
    asm = assemble("xab", None, stop=("ab",), min_tokens=2)
    assert asm.output.text == "x" and asm.output.stop_reason == "ab"
    asm = assemble("abx", "length", stop=("ab",), min_tokens=2)  # ended inside: no match
    assert asm.output.text == "abx" and asm.output.finish_reason == "length"
    # Each stop string reaches back by less than its own length, not the longest one's.
    asm = assemble("heab", "length", stop=("e", "long"), min_tokens=2)
    assert asm.output.text == "heab" and asm.output.finish_reason == "length"


class _LaggingChars:
    """Holds each character back until the next token (as a real incremental detokenizer
    holds back an incomplete UTF-8 sequence); ``flush`` gives what is held."""

    def __init__(self) -> None:
        self.held = ""

    def add(self, token_id: int) -> str:
        out, self.held = self.held, chr(token_id)
        return out

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


class LaggingTokenizer:
    def detokenizer(self, prompt_token_ids, skip_special_tokens, kept_ids):
        return _LaggingChars()


@pytest.mark.parametrize("finish", ["length", "stop"])
def test_the_text_the_detokenizer_holds_back_comes_out_at_the_end(finish):
    asm = OutputAssembler("r", [1, 2], LaggingTokenizer(), stop_token_ids=(ord("!"),))
    text = "abc!" if finish == "stop" else "abc"
    for k, c in enumerate(text):
        last = k == len(text) - 1
        reason = FinishReason(finish) if last else None
        asm.add(RequestUpdate("r", [ord(c)], [1], finish_reason=reason))
    assert asm.output.text == "abc" and asm.output.finish_reason == finish


def test_vllm_logprobs_list_the_sampled_token_first():
    # vLLM's dict: the sampled token first, keeping its top-k rank when it is among the top k.
    entries = [
        {"token_id": 7, "logprob": -1.5, "top_logprobs": [(3, -0.5), (7, -1.5)], "rank": 2},
        {"token_id": 9, "logprob": -4.0, "top_logprobs": [(3, -0.2)], "rank": 6},
        {"token_id": 5, "logprob": None, "top_logprobs": None, "rank": None},  # forced
    ]
    first, second, forced = vllm_logprobs(entries, None)
    assert list(first) == [7, 3] and first[7] == Logprob(-1.5, 2) and first[3] == Logprob(-0.5, 1)
    assert list(second) == [9, 3] and second[9] == Logprob(-4.0, 6)
    assert forced == {}


def test_request_output_takes_the_latest_weight_version_of_its_samples():
    samples = [assemble("ab", "length"), assemble("cd", "length")]
    samples[0].weight_version, samples[1].weight_version = 1, 3
    out = request_output(samples, "p")
    assert out.weight_version == 3 and out.finished
    assert [o.text for o in out.outputs] == ["ab", "cd"] and out.prompt_token_ids == [1, 2]


def test_cumulative_logprob_sums_every_sampled_token():
    asm = OutputAssembler("r", [1, 2], CharTokenizer(), want_logprobs=True)
    asm.add(RequestUpdate("r", [97], [1], [-0.5], [[(97, -0.5)]], new_ranks=[1]))
    asm.add(RequestUpdate("r", [98, 99], [1, 1], [None, -1.25], [None, []], new_ranks=[None, 4]))
    asm.add(RequestUpdate("r", [100], [1], [-2.0], [[]], FinishReason("length"), new_ranks=[7]))
    (out,) = request_output([asm], None).outputs
    assert out.cumulative_logprob == pytest.approx(-3.75)  # the forced token adds nothing
    assert out.text == "abcd" and [len(d) for d in out.logprobs] == [1, 0, 1, 1]


def test_logprob_tokens_are_decoded_once_per_id(tiny):
    """A dataset's prompt logprobs name the same ids again and again: each id's text is decoded
    once (``Tokenizer.token_text``) and shared, not decoded per entry."""
    from rltserve.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny)
    calls = []
    decode = tokenizer.backend.decode
    tokenizer.backend.decode = lambda ids, skip: calls.append(ids) or decode(ids, skip)
    entries = [
        {"token_id": 5 + i % 3, "logprob": -1.0, "top_logprobs": [(7, -0.5), (8, -0.7)]}
        for i in range(300)
    ]
    first = vllm_logprobs(entries, tokenizer)
    again = vllm_logprobs(entries, tokenizer)  # (another request of the batch)
    assert len(calls) == 4  # ids 5, 6, 7 and 8
    assert first == again
    for e, d in zip(entries, first):
        expected = [e["token_id"], *(t for t in (7, 8) if t != e["token_id"])]
        assert list(d) == expected
        assert [d[t].decoded_token for t in expected] == [decode([t], False) for t in expected]
