"""Structured outputs' params and compilation (``structured``, ``guide_index``): each constraint
as a regex, the refusals naming their field, vLLM's names, the vocabulary built from the local
tokenizer, the bounded cache of compiled indexes, and the error without outlines-core."""

from __future__ import annotations

import re
import sys

import pytest

from rltserve.guide_index import (
    GuideCompiler,
    bind,
    check_bound,
    compiled_index,
    token_bytes_table,
)
from rltserve.models.tokenizer import load_tokenizer
from rltserve.sampling import SamplingParams
from rltserve.structured import (
    GuidedDecodingParams,
    StructuredOutputsParams,
    StructuredOutputsUnavailable,
)


@pytest.fixture(scope="module")
def tok(tiny):
    return load_tokenizer(tiny)


def test_each_constraint_is_a_regex():
    choice = StructuredOutputsParams(choice=["a b", "x.y", "c-d+"]).pattern()
    assert [bool(re.fullmatch(choice, s)) for s in ("a b", "x.y", "c-d+", "xzy", "a")] == [
        True,
        True,
        True,
        False,
        False,
    ]
    assert StructuredOutputsParams(regex="[0-9]{3}").pattern() == "[0-9]{3}"
    # (\d as vLLM's default backend reads it: outlines-core's took any script's digits)
    digits = StructuredOutputsParams(regex=r"\d{3}[\w.]").pattern()
    assert re.fullmatch(digits, "123a") and not re.fullmatch(digits, "\u0661\u0662\u0663a")
    given = StructuredOutputsParams(choice=(c for c in ("yes", "no")))  # (any iterable)
    assert given.choice == ["yes", "no"] and re.fullmatch(given.pattern(), "no")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    pattern = StructuredOutputsParams(json=schema).pattern()
    assert re.fullmatch(pattern, '{"n": 12}') and not re.fullmatch(pattern, '{"n": "x"}')
    assert StructuredOutputsParams(json='{"type": "integer"}').pattern()  # (a JSON string)
    any_object = StructuredOutputsParams(json_object=True).pattern()
    assert re.fullmatch(any_object, '{"a": {"b": 1}, "c": [1, "x", null]}')
    assert not re.fullmatch(any_object, "[1]")
    tight = StructuredOutputsParams(json=schema, disable_any_whitespace=True).pattern()
    assert re.fullmatch(tight, '{"n":12}') and not re.fullmatch(tight, '{"n": 12}')
    lines = StructuredOutputsParams(json=schema, whitespace_pattern="\n?").pattern()
    assert re.fullmatch(lines, '{"n":\n12}') and not re.fullmatch(lines, '{"n": 12}')
    tight = StructuredOutputsParams(json_object=True, disable_any_whitespace=True).pattern()
    assert re.fullmatch(tight, '{"a":[1]}') and not re.fullmatch(tight, '{"a": [1]}')


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "give exactly one of"),
        ({"regex": "a", "choice": ["b"]}, r"got regex, choice"),
        ({"choice": []}, "choice=.*non-empty list of strings"),
        ({"choice": "ab"}, "choice=.*non-empty list of strings"),
        ({"choice": ["a", 3]}, "choice=.*non-empty list of strings"),
        ({"json": 3}, "json=3: must be a JSON schema"),
        ({"regex": ""}, "regex=.*non-empty string"),
        ({"grammar": "root ::= x"}, "grammar: context-free grammars are not supported"),
        ({"json_object": True, "disable_fallback": True}, "disable_fallback: not supported"),
        ({"json_object": "yes"}, "json_object='yes': must be a bool"),
        ({"regex": "a", "disable_any_whitespace": 1}, "disable_any_whitespace: must be a bool"),
        ({"regex": "a", "whitespace_pattern": 3}, "whitespace_pattern=3: must be a string"),
        ({"regex": "a", "structural_tag": "{}"}, "structural_tag: not supported"),
    ],
)
def test_bad_params_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_a_schema_outlines_cannot_translate_names_the_field():
    with pytest.raises(ValueError, match="guided_json: cannot use this schema: .*nope"):
        StructuredOutputsParams(json={"type": "nope"}).pattern("guided_json")


def test_sampling_params_take_vllms_names():
    regex = StructuredOutputsParams(regex="a+")
    assert GuidedDecodingParams is StructuredOutputsParams
    p = SamplingParams(guided_decoding=regex)
    assert p.structured_outputs is regex and p.guided_decoding is None
    assert SamplingParams(structured_outputs={"choice": ["x"]}).structured_outputs.choice == ["x"]
    assert p.clone().structured_outputs == regex
    with pytest.raises(ValueError, match="guided_decoding: differs from structured_outputs"):
        SamplingParams(guided_decoding=regex, structured_outputs=StructuredOutputsParams(regex="b"))
    with pytest.raises(ValueError, match="structured_outputs=.*StructuredOutputsParams"):
        SamplingParams(structured_outputs="a+")
    with pytest.raises(ValueError, match="structured_outputs: .*unexpected keyword"):
        SamplingParams(structured_outputs={"regexp": "a"})
    from rltserve import sampling_params

    assert sampling_params.StructuredOutputsParams is StructuredOutputsParams
    assert sampling_params.GuidedDecodingParams is StructuredOutputsParams


def test_the_vocabulary_is_each_tokens_bytes(tok):
    """Every regular token's bytes are what it decodes to in context (byte-level BPE); special
    tokens and the stop ids are left out; the end id is the tokenizer's first stop id."""
    table, eos = token_bytes_table(tok)
    assert eos == tok.eos_token_ids[0]
    ids = {i: data for data, group in table.items() for i in group}
    assert not set(ids) & (set(tok.special_ids) | set(tok.eos_token_ids))
    assert len(ids) > 400
    text = 'Hello, world: {"a": 12}'
    encoded = tok.encode(text, add_special_tokens=False)
    assert b"".join(ids[i] for i in encoded).decode() == text


def test_compiled_indexes_are_cached_per_pattern_and_bounded(tok):
    compiler = GuideCompiler(tok, cache_size=2)
    first = compiler.compile("(ab|cd)")
    assert compiler.compile("(ab|cd)") is first
    compiler.compile("x")
    assert compiler.compile("(ab|cd)") is first  # (used again: now the most recent)
    compiler.compile("y")
    assert compiler.compile("(ab|cd)") is first  # ("x" went)
    compiler.compile("x")
    compiler.compile("y")
    assert compiler.compile("(ab|cd)") is not first  # (dropped: least recently used)
    with pytest.raises(ValueError, match="guided_regex: cannot compile this constraint"):
        compiler.compile("(", "guided_regex")
    with pytest.raises(ValueError, match="guided_regex: this model has no tokenizer"):
        GuideCompiler(None).compile("x", "guided_regex")


def test_bind_compiles_once_and_takes_bounded_thinking(tok):
    p = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    bound = bind(p, tok)
    guide = compiled_index(bound.structured_outputs)
    assert guide is not None and guide.eos == tok.eos_token_ids[0]
    assert bind(bound, tok) is bound and bound.clone().structured_outputs == p.structured_outputs
    assert compiled_index(bound.clone().structured_outputs) is guide
    assert bind(SamplingParams(), tok) == SamplingParams()
    # (The constraint then applies after the thinking span: ``core.guide.Guide.of``.)
    thinking = bind(bound.replace(max_thinking_tokens=4), tok)
    assert compiled_index(thinking.structured_outputs) is guide
    check_bound(thinking)  # (the engine's check)
    assert compiled_index(bind(p.replace(max_thinking_tokens=0), tok).structured_outputs)
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        bind(p, None)


@pytest.mark.parametrize(
    ("structured", "texts"),
    [
        (StructuredOutputsParams(choice=["1", "10", "100"]), ["1", "10", "100"]),
        (StructuredOutputsParams(choice=["yes sir", "y", "yes"]), ["y", "yes", "yes sir"]),
        (StructuredOutputsParams(choice=["a", "a.b"]), ["a", "a.b"]),
        (StructuredOutputsParams(regex=r"[0-9]+(\.[0-9]+)?"), ["3", "3.25", "12.5"]),
        (StructuredOutputsParams(regex="[a-z]+-?$"), ["ab", "ab-"]),
        (StructuredOutputsParams(regex=r"[0-9]+\$"), ["12$", "7$"]),  # (a dollar sign, escaped)
        (StructuredOutputsParams(json={"type": "number"}), ["3", "3.25", "-1.5e+10"]),
    ],
)
def test_what_a_match_may_go_on_to_is_reachable(tok, structured, texts):
    """Each text the constraint matches can be spelled token by token under the guide, and may
    end there, also where a shorter match comes first ("1" before "10", "3" before "3.25":
    outlines-core's own index drops a one-byte step out of a full match)."""
    from rltserve.core.guide import Guide

    compiled = GuideCompiler(tok).compile(structured.pattern())
    for text in texts:
        guide = Guide(compiled)
        for token in tok.encode(text, add_special_tokens=False):
            assert token in guide.allowed(), (text, tok.decode([token]))
            guide.advance(token)
        assert compiled.eos in guide.allowed() and guide.state is not None, text
        guide.advance(compiled.eos)
        assert guide.state is None and guide.allowed() == [compiled.eos]
    assert compiled.eos not in Guide(compiled).allowed()  # (nothing matched yet)


def test_json_object_takes_what_json_dumps_writes(tok):
    """Objects within json_object's depth, as ``json.dumps`` writes them (non-ASCII as
    ``\\uXXXX`` escapes by default, DEL raw otherwise, compact or not), and "1e5"; spelled
    under the guide too; a value outside JSON is refused."""
    import json
    import random

    from rltserve.core.guide import Guide

    pattern = StructuredOutputsParams(json_object=True).pattern()
    rng = random.Random(0)
    scalars = [0, -1, 2.5, 1e20, -2.5e-7, True, None, "", "é", 'q"t', "b\\s", "\x7f", "😀", "日本"]
    for _ in range(300):
        obj = {
            f"k{j}": rng.choice([rng.choice(scalars), [rng.choice(scalars)], {"x": 1}])
            for j in range(rng.randint(0, 3))
        }
        for kw in ({}, {"ensure_ascii": False}, {"separators": (",", ":")}):
            text = json.dumps(obj, **kw)
            assert re.fullmatch(pattern, text), text
    assert re.fullmatch(pattern, '{"n": 1e5}') and not re.fullmatch(pattern, '{"n": 01}')
    assert not re.fullmatch(pattern, '{"s": "\\x"}') and not re.fullmatch(pattern, '{"a": NaN}')
    compiled = GuideCompiler(tok).compile(pattern)
    guide = Guide(compiled)
    for token in tok.encode('{"k": "\\u00e9", "n": 1e5}', add_special_tokens=False):
        assert token in guide.allowed(), tok.decode([token])
        guide.advance(token)
    assert compiled.eos in guide.allowed()


def test_a_pickled_index_is_one_object_per_process(tok):
    """Each request's params reach a worker process pickled on their own: the requests of one
    constraint restore one index there (not a copy of megabytes each), which still masks as the
    compiled one, with the serialized form made once."""
    import pickle

    p = bind(SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True)), tok)
    guide = compiled_index(p.structured_outputs)
    blobs = [pickle.dumps(("add", f"r{i}", [1, 2], p)) for i in range(3)]
    restored = [compiled_index(pickle.loads(b)[3].structured_outputs) for b in blobs]
    assert restored[0] is restored[1] is restored[2] and restored[0] is not guide
    index, original = restored[0].index, guide.index
    state = original.get_initial_state()
    assert index.get_allowed_tokens(state) == original.get_allowed_tokens(state)
    assert (restored[0].pattern, restored[0].eos) == (guide.pattern, guide.eos)
    other = bind(SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9]+")), tok)
    assert compiled_index(pickle.loads(pickle.dumps(other)).structured_outputs) is not index


def test_without_outlines_core_the_error_says_what_to_install(tok, monkeypatch):
    monkeypatch.setitem(sys.modules, "outlines_core", None)  # (an import of it fails)
    p = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
    with pytest.raises(StructuredOutputsUnavailable, match=r"pip install 'rltserve\[structured\]'"):
        bind(p, tok)
    with pytest.raises(ValueError, match="outlines-core"):
        StructuredOutputsParams(json={"type": "object"}).pattern()


def test_a_schema_of_any_object_is_json_objects_regex():
    """``{"type": "object"}`` (MCP tools' parameters, a bare response_format schema): outlines'
    translation compiled for seconds on a 512-token vocabulary; it is json_object's regex."""
    generic = StructuredOutputsParams(json_object=True).pattern()
    for schema in (
        {"type": "object"},
        '{"type": "object", "description": "any arguments"}',
        {"type": "object", "title": "Args", "additionalProperties": True},
    ):
        assert StructuredOutputsParams(json=schema).pattern() == generic
    for schema in (
        {"type": "object", "properties": {"a": {"type": "integer"}}},
        {"type": "object", "properties": {}},
        {"type": "object", "additionalProperties": {"type": "integer"}},
    ):
        assert StructuredOutputsParams(json=schema).pattern() != generic


def test_sentencepiece_pieces_are_their_bytes():
    """A SentencePiece vocabulary's byte tokens (``<0x0A>``) are that one byte, and its ``▁``
    a space; a byte-level vocabulary's pieces map through GPT-2's alphabet."""
    from rltserve.guide_index import _byte_alphabet, _piece_bytes

    assert _piece_bytes("<0x0A>", True, {}) == b"\n"
    assert _piece_bytes("<0xF0>", True, {}) == bytes([0xF0])
    assert _piece_bytes("\u2581the", True, {}) == b" the"
    assert _piece_bytes("<0xZZ>", True, {}) == b"<0xZZ>"  # (not a byte token)
    assert _piece_bytes("\u0120the", False, _byte_alphabet()) == b" the"
