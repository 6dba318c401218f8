"""Bounded thinking in the engine (core/thinking.py): after K thinking tokens the interruption and
end ids are forced into the output and decoding continues in the same request. The output equals
the oracle on prompt + thinking (at its recorded exit depths) + forced ids; a recompute after
preemption replays the forced ids; combinations that cannot work are refused."""

from __future__ import annotations

import pytest
import torch
from engine_util import make_core, run_core
from engine_util import tight_blocks as _tight_blocks

from rltserve.core.thinking import check_thinking
from rltserve.sampling import SamplingParams
from rltserve.thinking import (
    ReasoningStream,
    bound_thinking,
    ids_open_thinking,
    prompt_opens_thinking,
    resolve_thinking,
    split_reasoning,
    with_thinking_prefix,
)

PROMPTS = [[3, 17, 42, 7, 8], [99, 5, 61], [12, 250, 31, 4, 77, 2, 6]]
K = 3
INTERRUPTION = (40, 41)


def _end_id(tokens: list[int]) -> int:
    """An end id the thinking tokens do not contain (so the budget is what ends the span)."""
    return next(t for t in range(300, 400) if t not in tokens)


def _params(ref, prompt, **kw) -> SamplingParams:
    thinking = ref.generate(prompt, K, kv_policy="last_exited").tokens
    base = dict(temperature=0.0, max_tokens=10, ignore_eos=True, max_thinking_tokens=K)
    base.update(thinking_end_token_ids=(_end_id(thinking),), thinking_interruption=INTERRUPTION)
    return SamplingParams(**{**base, **kw})


@pytest.mark.parametrize("kv_policy", ["last_exited", "full"])
def test_fixed_depth_equals_oracle_on_prompt_thinking_forced(ouro_rv1, ouro_ref, kv_policy):
    params = [_params(ouro_ref, p) for p in PROMPTS]
    run = run_core(make_core(ouro_rv1, kv_policy=kv_policy), PROMPTS, params)
    depth = ouro_ref.depths(None)[1]
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        thinking = ouro_ref.generate(prompt, K, kv_policy=kv_policy)
        forced = [*INTERRUPTION, *p.thinking_end_token_ids]
        rest = ouro_ref.generate(
            prompt + thinking.tokens + forced, p.max_tokens - K - len(forced), kv_policy=kv_policy
        )
        assert run.tokens[f"r{i}"] == thinking.tokens + forced + rest.tokens
        want_depths = thinking.exit_depths + [depth] * len(forced) + rest.exit_depths
        assert run.depths[f"r{i}"] == want_depths
        assert run.finish[f"r{i}"] == "length"


def test_adaptive_exit_continues_from_the_recorded_depths(ouro_rv1, ouro_ref):
    """Teacher-forced check against a dense recompute of prompt + output at the recorded exit
    depths (last_exited): every sampled token after the forced ones is the argmax there."""
    params = [_params(ouro_ref, p, exit_threshold=0.5) for p in PROMPTS]
    run = run_core(make_core(ouro_rv1), PROMPTS, params)
    depth = ouro_ref.depths(None)[1]
    for i, prompt in enumerate(PROMPTS):
        out, depths = run.tokens[f"r{i}"], run.depths[f"r{i}"]
        n = len(prompt)
        assert out[K : K + 3] == [*INTERRUPTION, *params[i].thinking_end_token_ids]
        assert depths[K : K + 3] == [depth] * 3
        seq = prompt + out[:-1]
        exits = [depth] * (n - 1) + depths
        full = ouro_ref.full_recompute(seq, exits, prompt_len=n, kv_policy="last_exited")
        for k in [*range(K), *range(K + 3, len(out))]:
            assert out[k] == int(torch.argmax(full.logits[n - 1 + k])), f"request {i} token {k}"


def test_no_forcing_when_thinking_ends_in_time_and_truncation_at_max_tokens(ouro_rv1, ouro_ref):
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    base = run_core(make_core(ouro_rv1), PROMPTS[:1], [plain])
    tokens = base.tokens["r0"]
    ended = plain.replace(
        max_thinking_tokens=K, thinking_end_token_ids=(tokens[1],), thinking_interruption=(40,)
    )
    short = _params(ouro_ref, PROMPTS[0], max_tokens=K + 2)  # room for 2 of the 3 forced ids
    run = run_core(make_core(ouro_rv1), PROMPTS[:1] * 2, [ended, short])
    assert run.tokens["r0"] == tokens  # the span ended by itself at token 2: nothing forced
    assert run.tokens["r1"][K:] == list(INTERRUPTION)
    assert run.finish["r1"] == "length"


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_replays_forced_tokens(ouro_rv1, ouro_ref, mode):
    prompts = PROMPTS * 2
    params = [
        _params(ouro_ref, p, max_tokens=16, temperature=1.0, seed=5 + i, exit_threshold=0.5)
        for i, p in enumerate(prompts)
    ]
    kw = {"prefill_chunk_size": 8, "max_num_batched_tokens": 32}
    plain = run_core(make_core(ouro_rv1, block_size=4, num_blocks=1024, **kw), prompts, params)
    tight_kw = {**kw, "block_size": 4, "kv_watermark": 0.0, "preemption_mode": mode}
    blocks = _tight_blocks(ouro_rv1, prompts, params, **kw)
    core = make_core(ouro_rv1, num_blocks=blocks, **tight_kw)
    tight = run_core(core, prompts, params)
    assert core.stats().num_preemptions > 0
    assert tight.tokens == plain.tokens and tight.depths == plain.depths
    for i, p in enumerate(params):
        assert tight.tokens[f"r{i}"][K : K + 3] == [*INTERRUPTION, *p.thinking_end_token_ids]


def test_refused_combinations_name_the_reason(ouro_rv1, ouro_ref):
    p = _params(ouro_ref, PROMPTS[0])
    # On a pipelining engine it decodes without pipelining; asking for both is refused.
    piped = make_core(ouro_rv1, speculative_tokens=2, draft_loops=2)
    assert not piped.make_request(None, PROMPTS[0], p).pipelined
    with pytest.raises(ValueError, match=r"speculative=True: .*bounded thinking"):
        piped.make_request(None, PROMPTS[0], p.replace(speculative=True))
    piped.shutdown()
    core = make_core(ouro_rv1)
    with pytest.raises(ValueError, match="thinking_end_token_ids: required"):
        core.make_request(None, PROMPTS[0], p.replace(thinking_end_token_ids=None))
    with pytest.raises(ValueError, match="thinking_end_token_ids: required"):
        check_thinking(p.replace(thinking_end_token_ids=None))  # (the front ends' check too)
    with pytest.raises(ValueError, match=r"max_thinking_tokens=-2: must be >= 0"):
        SamplingParams(temperature=0.0, max_thinking_tokens=-2)
    # Forced ids are fed back as inputs: outside the vocabulary they are refused up front.
    vocab = core.spec.vocab_size
    with pytest.raises(ValueError, match=rf"thinking_end_token_ids: token id {vocab} is outside"):
        core.make_request(None, PROMPTS[0], p.replace(thinking_end_token_ids=(vocab,)))
    with pytest.raises(ValueError, match=rf"thinking_interruption: token id {vocab + 1} is"):
        core.make_request(None, PROMPTS[0], p.replace(thinking_interruption=(5, vocab + 1)))


def test_reasoning_split():
    assert split_reasoning("a plan</think>the answer", prompt_open=True) == (
        "a plan",
        "the answer",
    )
    assert split_reasoning("still thinking", prompt_open=True) == ("still thinking", "")
    assert split_reasoning("<think>x</think>y", prompt_open=False) == ("x", "y")
    assert split_reasoning("plain", prompt_open=False) == (None, "plain")
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<think>a</think>b")


def test_llm_resolves_text_interruption_and_the_end_token(tmp_path):
    from rltserve import LLM
    from rltserve.models.presets import make_model

    tiny = make_model("ouro-tiny", tmp_path / "tiny")
    with LLM(str(tiny), in_process=True, num_blocks=64) as llm:
        end = llm.tokenizer.get_vocab()["</think>"]
        words = llm.tokenizer.encode("so the answer", add_special_tokens=False)
        p = SamplingParams(temperature=0.0,
            max_tokens=12, ignore_eos=True, max_thinking_tokens=2,
            thinking_interruption="so the answer",
        )  # fmt: skip
        start = llm.tokenizer.get_vocab()["<think>"]
        (out,) = llm.generate([[5, 6, 7, start]], p)
        ids = out.outputs[0].token_ids
        assert end not in ids[:2]  # the model did not end its thinking itself
        assert ids[2 : 3 + len(words)] == [*words, end]
        # A prompt that leaves no span open (none, or one it closes) runs without the bound:
        # the same params serve thinking and plain prompts.
        free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        for prompt in ([5, 6, 7], [5, start, 6, end, 7]):
            (bounded,) = llm.generate([prompt], p)
            (plain,) = llm.generate([prompt], free)
            assert bounded.outputs[0].token_ids == plain.outputs[0].token_ids
            assert end not in plain.outputs[0].token_ids[:4]  # (so the bound would have shown)
    with (
        LLM(str(tiny), in_process=True, num_blocks=64, skip_tokenizer_init=True) as llm,
        pytest.raises(ValueError, match="thinking_end_token_ids: required"),
    ):
        llm.generate([[5]], SamplingParams(temperature=0.0, max_thinking_tokens=2))


def test_reasoning_stream_splits_across_deltas():
    s = ReasoningStream()
    parts = [s.feed(t) for t in ["plan a", "nd b</th", "ink>ans", "wer"]]
    parts.append(s.flush())
    assert "".join(r for r, _ in parts) == "plan and b"
    assert "".join(c for _, c in parts) == "answer"
    s = ReasoningStream()
    assert s.feed("x</") == ("x", "") and s.flush() == ("</", "")


class _Vocab:
    def get_vocab(self):
        return {"<think>": 3, "</think>": 4}


def test_bound_thinking_applies_to_an_open_span_only():
    p = SamplingParams(
        temperature=0.0, max_tokens=8, max_thinking_tokens=2, thinking_end_token_ids=(4,)
    )
    assert bound_thinking(p, [1, 3], _Vocab()) is p
    assert bound_thinking(p, [1, 3, 2, 2], _Vocab()) is p  # still open
    assert bound_thinking(p, [1, 2], _Vocab()).max_thinking_tokens is None
    assert bound_thinking(p, [3, 2, 4, 1], _Vocab()).max_thinking_tokens is None  # closed
    # No tokenizer (or one without the tags) cannot tell: the caller's end ids stand.
    assert bound_thinking(p, [1, 2], None) is p


def test_a_raw_prompts_span_is_opened_only_after_its_last_turn_start():
    # ChatML (<|im_start|> = 1): a <think> in a user's words, before the turn being answered,
    # opens no span; one after the last turn start does. Without the token, the whole prompt.
    class ChatML:
        def get_vocab(self):
            return {"<|im_start|>": 1, "<think>": 3, "</think>": 4}

    p = SamplingParams(
        temperature=0.0, max_tokens=8, max_thinking_tokens=2, thinking_end_token_ids=(4,)
    )
    user_think = [1, 5, 3, 6, 2, 1, 7]  # user: "... <think> ..." then the assistant's turn
    assert bound_thinking(p, user_think, ChatML()).max_thinking_tokens is None
    assert bound_thinking(p, [*user_think, 3], ChatML()) is p
    assert bound_thinking(p, [3, 5, 6], ChatML()) is p  # (no turn start: judged whole)
    assert not ids_open_thinking(user_think, ChatML())
    assert ids_open_thinking(user_think, _Vocab())  # (no <|im_start|> in this vocabulary)
    head = "<|im_start|>user\nWhat does <think> do?<|im_end|>\n<|im_start|>assistant\n"
    assert not prompt_opens_thinking(head)
    assert prompt_opens_thinking(head + "<think>\n")
    assert prompt_opens_thinking("What does <think> do?")


def test_forced_tokens_get_their_logprob_later(ouro_rv1, ouro_ref):
    # The forced ids go out with no logprob; a later update scores them (``forced_logprobs``:
    # test_thinking_logprobs.py checks the values against the oracle).
    params = [_params(ouro_ref, PROMPTS[0], logprobs=1)]
    run = run_core(make_core(ouro_rv1), PROMPTS[:1], params)
    lps = run.logprobs["r0"]
    assert len(lps) == params[0].max_tokens
    assert all(lp is not None for lp in lps)
    assert set(run.forced_ranks["r0"]) == {K, K + 1, K + 2}


def test_reasoning_edges():
    # Whitespace before the answer's <think>; a prompt that opens with <think>; the prefix
    # ends with a newline, as the Ouro-Thinking recipes' does.
    assert split_reasoning("\n <think>x</think>y", prompt_open=False) == ("x", "y")
    assert prompt_opens_thinking("<think>\n")
    assert with_thinking_prefix("<|im_start|>assistant\n") == "<|im_start|>assistant\n<think>\n"
    assert with_thinking_prefix("a<think>\n") == "a<think>\n"
    # A delta that ends one character short of </think> is held back whole.
    s = ReasoningStream()
    assert s.feed("plan</think") == ("plan", "")
    assert s.feed(">answer") == ("", "answer")


def test_text_interruption_is_encoded_without_special_tokens():
    class Tok:
        def get_vocab(self):
            return {"</think>": 9}

        def encode(self, text, add_special_tokens=True):
            return [1, 2] + ([0] if add_special_tokens else [])  # e.g. an appended end token

    p = SamplingParams(temperature=0.0, max_thinking_tokens=2, thinking_interruption="so")
    got = resolve_thinking(p, Tok())
    assert got.thinking_interruption == (1, 2) and got.thinking_end_token_ids == (9,)


def test_a_multi_token_end_closes_the_span_only_when_whole(ouro_rv1, ouro_ref):
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = run_core(make_core(ouro_rv1), PROMPTS[:1], [plain]).tokens["r0"]
    other = _end_id(tokens)
    whole = (tokens[0], tokens[1])  # the output's first two tokens: closed at token 2
    half = (other, tokens[1])  # only its last id comes: still open after K tokens
    params = [
        plain.replace(
            max_thinking_tokens=K, thinking_end_token_ids=end, thinking_interruption=(40,)
        )
        for end in (whole, half)
    ]
    run = run_core(make_core(ouro_rv1), PROMPTS[:1] * 2, params)
    assert run.tokens["r0"] == tokens
    assert run.tokens["r1"][: K + 3] == [*tokens[:K], 40, *half]


def test_a_text_interruption_is_refused_by_the_engine(ouro_rv1, ouro_ref):
    p = _params(ouro_ref, PROMPTS[0], thinking_interruption="Time is up.")
    with pytest.raises(ValueError, match="^thinking_interruption: the engine takes token ids"):
        make_core(ouro_rv1).make_request(None, PROMPTS[0], p)


def test_the_last_think_tag_of_a_prompt_decides_whether_it_opens_a_span():
    assert prompt_opens_thinking("<think>a</think>b<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<think>a</think>b<think>c</think>")
    assert not prompt_opens_thinking("no tags")


def test_a_text_interruption_without_a_tokenizer_is_refused_by_name():
    p = SamplingParams(
        temperature=0.0, max_thinking_tokens=2, thinking_end_token_ids=(9,),
        thinking_interruption="so",
    )  # fmt: skip
    with pytest.raises(ValueError, match="thinking_interruption: text needs a tokenizer"):
        resolve_thinking(p, None)
    ids = p.replace(thinking_interruption=(1, 2))
    assert resolve_thinking(ids, None).thinking_interruption == (1, 2)


def test_the_thinking_prefix_is_for_a_generation_prompt_only():
    from rltserve.thinking import chat_prompt_text

    class Tok:
        has_think_token = True

    think = {"enable_thinking": True}
    turn = "<|im_start|>user\nHi<|im_end|>\n"
    assert chat_prompt_text(turn, False, think, Tok()) == turn
    assert chat_prompt_text(turn, True, think, Tok()) == turn + "<think>\n"
    assert chat_prompt_text(turn, True, {"enable_thinking": False}, Tok()) == turn


def test_the_thinking_prefix_keeps_a_span_the_template_opened_or_closed():
    # Only a generation region with no <think> at all gets the prefix: a closed span there is
    # the template's "thinking off" pre-fill (Qwen3's, Nanbeige's), an open one is the span.
    turn = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    closed = turn + "<think>\n\n</think>\n\n"
    assert with_thinking_prefix(closed) == closed
    assert with_thinking_prefix(turn + "<think>\n") == turn + "<think>\n"
    assert with_thinking_prefix(turn) == turn + "<think>\n"
    # A span closed in an earlier turn (or a user's words) is not the generation region's.
    earlier = "<|im_start|>user\n<think>a</think><|im_end|>\n<|im_start|>assistant\n"
    assert with_thinking_prefix(earlier) == earlier + "<think>\n"
    assert with_thinking_prefix(closed, start=len(closed)) == closed + "<think>\n"


def test_only_the_generation_region_of_a_chat_opens_a_thinking_span(tiny):
    # A <think> in a message's words encodes to the very token a thinking template writes;
    # only the region after the messages (generation prompt, thinking prefix, a continued
    # final message) opens the answer's span.
    from rltserve.models.tokenizer import load_tokenizer
    from rltserve.thinking import ChatPrompt, chat_prompt

    tok = load_tokenizer(tiny)

    def chat(messages, generation=True, kwargs=None, continue_final=False, render=None):
        def default(turns, agp, cfm):
            return tok.apply_chat_template(
                turns, agp, tokenize=False, continue_final_message=cfm, **(kwargs or {})
            )

        render = render or default
        return chat_prompt(render, messages, generation, continue_final, kwargs or {}, tok)

    head = "<|im_start|>user\nWhat does <think> do?<|im_end|>\n<|im_start|>assistant\n"
    mention = [{"role": "user", "content": "What does <think> do?"}]
    assert chat(mention) == ChatPrompt(head, False)
    assert chat(mention, kwargs={"enable_thinking": True}) == ChatPrompt(head + "<think>\n", True)
    system = [{"role": "system", "content": "Never write <think>"}, *mention]
    assert chat(system).thinking is False
    prefill = [*mention, {"role": "assistant", "content": "<think>\nLet me"}]
    assert chat(prefill, False, continue_final=True) == ChatPrompt(head + "<think>\nLet me", True)
    closed = [*mention, {"role": "assistant", "content": "<think>a</think>b"}]
    assert chat(closed, False, continue_final=True).thinking is False
    # A template whose generation prompt pre-fills a closed span: asked to think, the prompt
    # stays as rendered (no <think> after the template's </think>), with no span open.
    off = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n"
        "</think>\n\n{% endif %}"
    )

    def thinking_off(turns, agp, cfm):
        return tok.apply_chat_template(turns, agp, tokenize=False, chat_template=off)

    rendered = thinking_off(mention, True, False)
    assert rendered.endswith("assistant\n<think>\n\n</think>\n\n")
    think = {"enable_thinking": True}
    assert chat(mention, kwargs=think, render=thinking_off) == ChatPrompt(rendered, False)
    # A template that writes no <think> itself still gets the prefix after a user's <think>.
    plain = (
        "{% for m in messages %}[{{ m.content }}]{% endfor %}"
        "{% if add_generation_prompt %}>{% endif %}"
    )

    def bare(turns, agp, cfm):
        return tok.apply_chat_template(turns, agp, tokenize=False, chat_template=plain)

    assert chat(mention, kwargs={"enable_thinking": True}, render=bare) == ChatPrompt(
        "[What does <think> do?]><think>\n", True
    )

    # A template that refuses the conversation without its generation prompt: the whole
    # prompt counts, as a raw prompt's does.
    def refusing(turns, agp, cfm):
        if not agp:
            raise ValueError("needs a generation prompt")
        return bare(turns, agp, cfm)

    assert chat(mention, render=refusing) == ChatPrompt("[What does <think> do?]>", True)


def test_llm_chat_bounds_only_a_span_its_generation_prompt_opens(tiny):
    from rltserve import LLM

    with LLM(str(tiny), in_process=True, num_blocks=64) as llm:
        end = llm.tokenizer.get_vocab()["</think>"]
        free = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        bounded = free.replace(max_thinking_tokens=2)

        def answer(messages, params, **kwargs):
            (out,) = llm.chat(messages, params, use_tqdm=False, **kwargs)
            return out.outputs[0].token_ids

        mention = [{"role": "user", "content": "What does the <think> tag do?"}]
        system = [{"role": "system", "content": "Never output <think> tags."}, mention[0]]
        for conversation in (mention, system):
            plain = answer(conversation, free)
            assert answer(conversation, bounded) == plain and end not in plain
        # Asked to think, or continuing an answer that opened <think>: the budget forces it.
        think = {"chat_template_kwargs": {"enable_thinking": True}}
        prefill = [mention[0], {"role": "assistant", "content": "<think>\nLet me"}]
        cont = {"add_generation_prompt": False, "continue_final_message": True}
        for conversation, kwargs in ((mention, think), (prefill, cont)):
            assert answer(conversation, free, **kwargs)[2] != end
            assert answer(conversation, bounded, **kwargs)[2] == end


def test_a_chats_ids_given_to_generate_are_bounded_as_chat_bounds_them(tiny):
    # Pre-tokenized chat prompts (verl's, TRL's) whose user mentions <think>: the span is the
    # generation prompt's alone, through generate as through chat.
    from rltserve import LLM

    with LLM(str(tiny), in_process=True, num_blocks=64) as llm:
        start, end = (llm.tokenizer.get_vocab()[t] for t in ("<think>", "</think>"))
        bounded = SamplingParams(
            temperature=0.0, max_tokens=8, ignore_eos=True, max_thinking_tokens=2
        )
        mention = [{"role": "user", "content": "What does the <think> tag do?"}]
        for thinking in (False, True):
            kwargs = {"enable_thinking": thinking}
            (chat,) = llm.chat(mention, bounded, use_tqdm=False, chat_template_kwargs=kwargs)
            ids = chat.prompt_token_ids
            assert ids.count(start) == 1 + thinking  # (the user's <think> is the token)
            (raw,) = llm.generate({"prompt_token_ids": ids}, bounded, use_tqdm=False)
            assert raw.outputs[0].token_ids == chat.outputs[0].token_ids
            assert (chat.outputs[0].token_ids[2] == end) is thinking


def test_a_budget_on_a_model_without_thinking_tags_is_a_no_op(tmp_path):
    # Huginn's tokenizer has neither <think> nor </think>: no prompt can open a span, so one
    # SamplingParams serves it too. Named end ids stand (the caller's own tags).
    from rltserve import LLM
    from rltserve.models.presets import make_model

    huginn = make_model("huginn-tiny", tmp_path / "huginn")
    free = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, seed=1)
    bounded = free.replace(max_thinking_tokens=2, thinking_interruption="so")
    with LLM(str(huginn), in_process=True, num_blocks=64) as llm:
        vocab = llm.tokenizer.get_vocab()
        assert "<think>" not in vocab and "</think>" not in vocab
        prompt = [[5, 6, 7]]
        plain = llm.generate(prompt, free, use_tqdm=False)[0].outputs[0].token_ids
        assert llm.generate(prompt, bounded, use_tqdm=False)[0].outputs[0].token_ids == plain
        conv = [{"role": "user", "content": "hi"}]
        (chat,) = llm.chat(conv, free, use_tqdm=False)
        assert llm.chat(conv, bounded, use_tqdm=False)[0].outputs[0].token_ids == (
            chat.outputs[0].token_ids
        )
        named = llm.generate(prompt, bounded.replace(thinking_end_token_ids=(9,)), use_tqdm=False)
        forced = [*llm.tokenizer.encode("so", add_special_tokens=False), 9]
        assert named[0].outputs[0].token_ids[2 : 2 + len(forced)] == forced


def test_resolve_thinking_needs_end_ids_only_where_a_span_can_open():
    class Tok:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return self.vocab

        def encode(self, text, add_special_tokens=True):
            return [7]

    p = SamplingParams(temperature=0.0, max_thinking_tokens=2, thinking_interruption="so")
    assert resolve_thinking(p, Tok({})).max_thinking_tokens is None  # no tags: no span
    with pytest.raises(ValueError, match=r"^thinking_end_token_ids: required \(the tokenizer"):
        resolve_thinking(p, Tok({"<think>": 3}))  # a span can open; its end is unknown
    named = resolve_thinking(p.replace(thinking_end_token_ids=(9,)), Tok({}))
    assert (named.max_thinking_tokens, named.thinking_end_token_ids) == (2, (9,))


def test_an_interruption_that_holds_the_end_is_forced_without_a_second_end(ouro_rv1, ouro_ref):
    """vLLM's forced end strings hold ``</think>`` ("Time is up.</think>"): no second end."""
    closing = (40, *_params(ouro_ref, PROMPTS[0]).thinking_end_token_ids, 41)
    p = _params(ouro_ref, PROMPTS[0], thinking_interruption=closing)
    run = run_core(make_core(ouro_rv1), PROMPTS[:1], [p])
    thinking = ouro_ref.generate(PROMPTS[0], K, kv_policy="last_exited").tokens
    rest = ouro_ref.generate(PROMPTS[0] + thinking + list(closing), 10 - K - len(closing))
    assert run.tokens["r0"] == thinking + list(closing) + rest.tokens
