"""``LLM.chat`` and ``LLM.preprocess_chat`` (``llm_chat.py``): each conversation rendered with the
chat template as the server renders it, then generated; a turn without content as empty text;
a template that fails on a conversation, and a content format vLLM does not know, are
ValueErrors."""

from __future__ import annotations

import pytest

from rltserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny):
    with LLM(str(tiny), in_process=True, num_blocks=128, max_model_len=256) as llm:
        yield llm


def test_chat_renders_each_conversation_with_the_template_then_generates(llm):
    from rltserve.thinking import with_thinking_prefix

    tok = llm.tokenizer
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    p = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    (out,) = llm.chat(conv, p)  # one conversation
    text, ids = tok.apply_chat_template(conv, tokenize=False), tok.apply_chat_template(conv)
    assert out.prompt == text and out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == llm.generate([ids], p)[0].outputs[0].token_ids
    developer = [{"role": "developer", "content": "Be brief."}, conv[1]]
    assert llm.chat(developer, p)[0].prompt_token_ids == ids  # (rendered as system)
    both = llm.chat([conv, conv[1:]], p)  # a list of conversations, in order
    assert [o.prompt_token_ids for o in both] == [ids, tok.apply_chat_template(conv[1:])]
    (think,) = llm.chat(conv, p, chat_template_kwargs={"enable_thinking": True})
    want = with_thinking_prefix(tok.apply_chat_template(conv, tokenize=False, enable_thinking=True))
    assert think.prompt == want  # as the server's chat endpoint renders it
    for bad in ([], "Hi", None):
        with pytest.raises(ValueError, match="messages"):
            llm.chat(bad, p)
    # get_tokenizer: a Hugging Face tokenizer, as vLLM's, on the same files (the same ids).
    hf = llm.get_tokenizer()
    assert type(hf).__module__.startswith("transformers") and llm.get_tokenizer() is hf
    assert hf("Hi there").input_ids == tok.encode("Hi there") and len(hf) >= tok.vocab_size
    assert hf.batch_decode([ids]) == [tok.decode(ids, skip_special_tokens=False)]
    assert hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=True) == out.prompt
    # OpenAI-style content parts: text parts joined, as the server's chat endpoint joins them.
    parts = [conv[0], {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    assert llm.chat(parts, p)[0].prompt_token_ids == ids
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ValueError, match=r"messages\[0\]\[0\].content\[0\]: only text parts"):
        llm.chat(image, p)


def test_chat_renders_a_turn_without_content_as_empty_text(llm):
    """An agent history's assistant turn that only calls tools has ``"content": None`` (OpenAI's
    shape): rendered with "" as vLLM and the server's chat endpoint render it."""
    call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    conv = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "42"},
    ]
    (out,) = llm.chat(conv, GREEDY)
    empty = [conv[0], {"role": "assistant", "content": ""}, conv[2]]
    assert out.prompt == llm.tokenizer.apply_chat_template(empty, tokenize=False)


def test_a_template_that_fails_on_a_conversation_is_a_value_error(llm):
    conv = [{"role": "user", "content": "Hi"}]
    for template, message in [
        (
            "{{ raise_exception('roles must alternate') }}",
            r"^messages\[0\]: the chat template failed on this conversation: TemplateError: "
            "roles must alternate$",
        ),
        ("{{ messages[0].nope.x }}", r"^messages\[0\]: .*UndefinedError: .* 'nope'"),
        ("{% for %}", "^chat_template: the template does not compile"),
    ]:
        with pytest.raises(ValueError, match=message):
            llm.chat(conv, GREEDY, chat_template=template)
    with pytest.raises(ValueError, match=r"^messages\[1\]\[0\]: must be a message"):
        llm.chat([conv, ["Hi"]], GREEDY)


def test_preprocess_chat_gives_the_prompts_chat_generates(llm):
    messages = [{"role": "user", "content": "Hi"}]
    prompts = llm.preprocess_chat(messages)
    text = llm.tokenizer.apply_chat_template(messages, True, tokenize=False)
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    assert prompts == [{"prompt": text, "prompt_token_ids": ids}]
    assert [p["prompt_token_ids"] for p in llm.preprocess_chat([messages, messages])] == [ids] * 2
    chat = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    assert llm.generate(prompts, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == (
        chat.outputs[0].token_ids
    )
    for fmt in ("auto", "string", "openai"):
        assert llm.preprocess_chat(messages, chat_template_content_format=fmt) == prompts
    with pytest.raises(ValueError, match="chat_template_content_format='bogus': must be one"):
        llm.chat(messages, GREEDY, chat_template_content_format="bogus")


def test_tools_and_tool_call_histories_reach_the_template(llm):
    """vLLM's ``LLM.chat(tools=...)``: the definitions are the template's ``tools``, and an
    earlier answer's calls carry their JSON arguments as dicts (templates render them)."""
    template = (
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments.city }})"
        "{% endfor %}|{% endfor %}"
    )
    tool = {"type": "function", "function": {"name": "weather", "parameters": {}}}
    call = {"id": "c1", "type": "function"}
    call["function"] = {"name": "weather", "arguments": '{"city": "Oslo"}'}
    conv = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    (out,) = llm.chat(conv, GREEDY, chat_template=template, tools=[tool])
    assert out.prompt == "[weather]user:Weather?|assistant:weather(Oslo)|tool:sunny|"
    bad = [
        conv[0],
        {**conv[1], "tool_calls": [{**call, "function": {"name": "weather", "arguments": "{"}}]},
    ]
    with pytest.raises(ValueError, match=r"messages\[0\]\[1\].tool_calls\[0\].function.arguments"):
        llm.chat(bad, GREEDY, chat_template=template, tools=[tool])
