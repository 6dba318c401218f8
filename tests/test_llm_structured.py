"""Structured outputs through the offline API (vLLM's ``SamplingParams(structured_outputs=
StructuredOutputsParams(...))`` and its older ``guided_decoding=GuidedDecodingParams(...)``), on
ouro-tiny in a worker process (the compiled constraint travels with the params): a choice, a
regex and a JSON schema hold for sampled outputs that junk weights would never give; n > 1
samples each follow their own guide and seed."""

from __future__ import annotations

import json
import re
import sys

import pytest

from rltserve import LLM, GuidedDecodingParams, SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {"age": {"type": "integer"}, "color": {"enum": ["red", "green"]}},
    "required": ["age", "color"],
}
CHOICES = ["yes", "no", "maybe so"]


@pytest.fixture(scope="module")
def llm(tiny):
    with LLM(str(tiny), dtype="float32", num_blocks=256) as llm:
        yield llm


def sampled(**kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=48, **kw)


def test_constraints_hold_for_sampled_outputs(llm):
    prompts = ["Hello", "The answer is", "x"]
    outs = llm.generate(
        prompts, sampled(seed=1, structured_outputs=StructuredOutputsParams(choice=CHOICES))
    )
    assert all(o.outputs[0].text in CHOICES for o in outs)
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    regex = "[0-9]{3}-[a-z]{2}"
    outs = llm.generate(prompts, sampled(seed=2, guided_decoding=GuidedDecodingParams(regex=regex)))
    assert all(re.fullmatch(regex, o.outputs[0].text) for o in outs)
    outs = llm.generate(
        prompts, sampled(seed=3, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    )
    finished = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
    assert finished
    for out in finished:  # (checked by hand: the schema's two required fields and their types)
        value = json.loads(out.text)
        assert set(value) == {"age", "color"} and type(value["age"]) is int
        assert value["color"] in ("red", "green")
    unguided = llm.generate(prompts, sampled(seed=3))
    assert not any(o.outputs[0].text in CHOICES for o in unguided)


def test_json_object_is_any_json_object(llm):
    p = sampled(seed=4, structured_outputs=StructuredOutputsParams(json_object=True))
    for out in llm.generate(["a", "b", "c", "d"], p):
        text = out.outputs[0].text
        assert text.startswith("{")
        if out.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)


def test_n_samples_each_follow_their_guide_and_seed(llm):
    structured = StructuredOutputsParams(regex="[a-z ]{12}")
    (both,) = llm.generate(["Hi"], sampled(n=2, seed=11, structured_outputs=structured))
    texts = [c.text for c in both.outputs]
    assert all(re.fullmatch("[a-z ]{12}", t) for t in texts) and texts[0] != texts[1]
    for j, text in enumerate(texts):  # sample j draws as a request seeded seed + j does
        (one,) = llm.generate(["Hi"], sampled(seed=11 + j, structured_outputs=structured))
        assert one.outputs[0].text == text


def test_refusals_name_the_field(llm, monkeypatch):
    bad = sampled(structured_outputs=StructuredOutputsParams(json={"type": "nope"}))
    with pytest.raises(ValueError, match="json: cannot use this schema"):
        llm.generate(["x"], bad)
    with pytest.raises(ValueError, match="regex: cannot compile this constraint"):
        llm.generate(["x"], sampled(structured_outputs=StructuredOutputsParams(regex="(")))
    monkeypatch.setitem(sys.modules, "outlines_core", None)
    with pytest.raises(ValueError, match=r"pip install 'rltserve\[structured\]'"):
        llm.generate(["x"], sampled(structured_outputs=StructuredOutputsParams(regex="b")))


def test_a_constraint_crosses_to_the_worker_once(llm, monkeypatch):
    """Its compiled index (megabytes at a real vocabulary) is pickled in full with the first
    request that uses it, and by reference with its other samples and later requests."""
    from rltserve.core.guide_registry import GuidePickler, _register

    full = []
    reduce = GuidePickler.reduce

    def spy(self, index):
        out = reduce(self, index)
        full.append(out[0] is _register)
        return out

    monkeypatch.setattr(GuidePickler, "reduce", spy)
    structured = StructuredOutputsParams(regex="[a-z]{5}!")
    for seed in (21, 22):
        (out,) = llm.generate(["Hi"], sampled(n=3, seed=seed, structured_outputs=structured))
        assert all(re.fullmatch("[a-z]{5}!", c.text) for c in out.outputs)
    assert full == [True] + [False] * 5


def test_a_pydantic_schema_with_bounds_and_any_holds(llm):
    """``Field(ge=1, le=5)`` and an ``Any`` field, as pydantic writes them: every finished answer
    is JSON within the bounds (outlines-core's own translation let 900 and ``{ }}`` through)."""
    schema = {
        "properties": {
            "stars": {"maximum": 5, "minimum": 1, "title": "Stars", "type": "integer"},
            "extra": {"title": "Extra"},
        },
        "required": ["stars", "extra"],
        "title": "Review",
        "type": "object",
    }
    params = sampled(n=6, seed=5, structured_outputs=StructuredOutputsParams(json=schema))
    (out,) = llm.generate(["Rate it"], params)
    finished = [c.text for c in out.outputs if c.finish_reason == "stop"]
    assert finished
    for text in finished:
        value = json.loads(text)
        assert set(value) == {"stars", "extra"} and value["stars"] in range(1, 6), text


def test_a_pydantic_schema_with_float_bounds_holds(llm):
    """``Field(ge=0, le=1)``, ``Field(gt=0)`` and ``confloat(ge=-50.5, le=60)``: every finished
    answer parses with the model (outlines-core's own translation let confidence 2.36 through,
    finish_reason "stop", and ``model_validate_json`` raised)."""
    pydantic = pytest.importorskip("pydantic")

    class Reading(pydantic.BaseModel):
        confidence: float = pydantic.Field(ge=0, le=1)
        price: float = pydantic.Field(gt=0)
        temperature: pydantic.confloat(ge=-50.5, le=60)

    structured = StructuredOutputsParams(json=Reading.model_json_schema())
    (out,) = llm.generate(["Read it"], sampled(n=6, seed=7, structured_outputs=structured))
    finished = [c.text for c in out.outputs if c.finish_reason == "stop"]
    assert finished
    for text in finished:
        Reading.model_validate_json(text)


def test_a_thinking_chat_answers_in_its_constraint_after_a_bounded_span(llm):
    """vLLM's ``thinking_token_budget`` with a constraint, on a chat whose template opens
    ``<think>``: at most 6 thinking tokens, the interruption and ``</think>`` (forced), then
    the answer in the constraint; each of n = 2 seeded samples is a request seeded seed + j.
    A prompt that opens no span: the budget never spends, the constraint holds from the
    first token."""
    regex = "[0-9]{3}-[a-z]{2}"
    p = sampled(
        n=2, seed=5, thinking_token_budget=6, thinking_interruption=" Time is up.",
        structured_outputs=StructuredOutputsParams(regex=regex),
    )  # fmt: skip
    think = {"chat_template_kwargs": {"enable_thinking": True}}
    messages = [{"role": "user", "content": "Your code?"}]
    (out,) = llm.chat(messages, p, use_tqdm=False, **think)
    tok = llm.tokenizer
    end = tok.get_vocab()["</think>"]
    forced = [*tok.encode(" Time is up.", add_special_tokens=False), end]
    for j, sample in enumerate(out.outputs):
        ids = list(sample.token_ids)
        assert ids[6 : 6 + len(forced)] == forced and sample.finish_reason == "stop"
        assert re.fullmatch(regex, tok.decode(ids[6 + len(forced) :])), sample.text
        (alone,) = llm.chat(messages, p.replace(n=1, seed=5 + j), use_tqdm=False, **think)
        assert alone.outputs[0].token_ids == sample.token_ids
    (plain,) = llm.generate(["Hello"], p.replace(n=1))
    assert re.fullmatch(regex, plain.outputs[0].text) and end not in plain.outputs[0].token_ids


def test_a_thinking_chat_thinks_freely_before_its_constraint(llm):
    """Without a budget, as the server: where the chat's template opens ``<think>`` the
    constraint waits for ``</think>``; until then the output is the unconstrained one's."""
    think = {"chat_template_kwargs": {"enable_thinking": True}}
    messages = [{"role": "user", "content": "Your code?"}]
    p = SamplingParams(max_tokens=24, temperature=0.0)
    (free,) = llm.chat(messages, p, use_tqdm=False, **think)
    guided = p.replace(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    (out,) = llm.chat(messages, guided, use_tqdm=False, **think)
    free_ids, ids = list(free.outputs[0].token_ids), list(out.outputs[0].token_ids)
    end = llm.tokenizer.get_vocab()["</think>"]
    span = free_ids.index(end) + 1 if end in free_ids else len(free_ids)
    assert ids[:span] == free_ids[:span] and span > 0
    (plain,) = llm.chat(messages, guided, use_tqdm=False)  # (thinking off: from the start)
    assert plain.outputs[0].text in ("yes", "no")
