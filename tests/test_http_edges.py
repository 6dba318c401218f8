"""Edges of the HTTP front end that the other HTTP tests leave open (found by mutation testing):
echo of a text prompt, special tokens in the text, a failed add, interrupted generations, chat
with n > 1, stream_options, /tokenize of a long conversation,
/v1/update_weights' options, the group shared by n samples, token texts in logprobs and the
model check of every route. Uses the scripted stage (context of 64 tokens) and the real
ouro-tiny tokenizer. The rules that need no socket are in test_http_request_rules; chat
templates and thinking in test_http_templates."""

from __future__ import annotations

import asyncio
import threading

import orjson
import pytest
from test_http_harness import (
    Script,
    ScriptedStage,
    error_of,
    running,
    scripted_factory,
    scripted_info,
    sse_payloads,
    stage_for,
    tiny_checkpoint,
    wait_for,
)

from rltserve.core.stage import StageError

CHAT = {"messages": [{"role": "user", "content": "x"}]}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


def choices_of(raw: bytes) -> list[dict]:
    return orjson.loads(raw)["choices"]


async def test_echo_returns_a_text_prompt_as_sent(ckpt):
    """A text prompt is echoed as the client sent it, not as its token ids decode: special
    tokens spelled in the text (here ``<|im_end|>``, id 2) stay in the echo."""
    async with running(ckpt, client_factory=scripted_factory(stage_for(ckpt))) as live:
        body = {"prompt": "Hi<|im_end|>", "max_tokens": 1, "echo": True}
        status, _, raw = await live.post("/v1/completions", body)
        assert status == 200, raw
        assert choices_of(raw)[0]["text"] == "Hi<|im_end|>H"
        # token ids have no text to keep: they echo as they decode (special tokens left out)
        status, _, raw = await live.post("/v1/completions", {**body, "prompt": [44, 77, 2]})
        assert status == 200 and choices_of(raw)[0]["text"] == "HiH"


async def test_skip_special_tokens_false_keeps_them_in_the_text(ckpt):
    """``skip_special_tokens`` shapes the generated text (token 1 is ``<|im_start|>``)."""
    stage = stage_for(ckpt, tokens=(44, 1))
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        body = {"prompt": [5], "max_tokens": 2}
        status, _, raw = await live.post("/v1/completions", body)
        assert status == 200 and choices_of(raw)[0]["text"] == "H"
        kept = {**body, "skip_special_tokens": False}
        status, _, raw = await live.post("/v1/completions", kept)
        assert status == 200 and choices_of(raw)[0]["text"] == "H<|im_start|>"


class FailingAdd(ScriptedStage):
    """A stage that refuses the ``fail_at``-th request it is given (0-based), as a stage that
    died between two ``add_request`` calls does."""

    def __init__(self, info, script, fail_at: int, error: Exception | None = None) -> None:
        super().__init__(info, script)
        self.fail_at = fail_at
        self.error = error or StageError("stage is not running")
        self.calls = 0

    def add_request(self, request_id, prompt_token_ids, params, sink, group=None) -> None:
        self.calls += 1
        if self.calls - 1 == self.fail_at:
            raise self.error
        super().add_request(request_id, prompt_token_ids, params, sink, group)


async def test_a_failed_add_aborts_the_choices_already_added(ckpt):
    """n=2 and the stage fails on the second add: a 503, the first choice aborted in the
    stage, and nothing left open (shutdown would wait for it)."""
    hold = threading.Event()
    stage = FailingAdd(scripted_info(ckpt, max_model_len=64), Script([44], hold=hold), 1)
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        status, _, raw = await live.post("/v1/completions", {"prompt": [5], "n": 2})
        assert status == 503, raw
        assert error_of(raw)["message"] == "the engine is not running: stage is not running"
        assert stage.added and stage.aborted == stage.added
        assert live.state.require_frontend().num_open == 0
        hold.set()


async def test_interrupting_open_generations_aborts_them_in_the_stage(ckpt):
    """``interrupt_all`` (what a drain that runs out calls) ends each open stream with an abort
    event and tells the stage at once, not only when the stage is closed later."""
    stage = stage_for(ckpt, interval_s=0.01)
    body = {"prompt": [5], "max_tokens": 63, "stream": True}
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        async with live.stream("/v1/completions", body) as r:
            first = await r.content.readuntil(b"\n\n")
            live.state.require_frontend().interrupt_all()
            rest = await asyncio.wait_for(r.content.read(), 10)
        assert stage.aborted == stage.added and len(stage.added) == 1
        assert stage.alive  # (told by the abort, not by a close)
        assert live.state.require_frontend().num_open == 0
    events = sse_payloads(first + rest)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"] == {
        "message": "the request was aborted",
        "type": "unavailable_error",
        "param": None,
        "code": 503,
    }


async def test_chat_n_counts_the_prompt_once_and_is_bounded_by_max_concurrent(ckpt):
    """Chat with n > 1: ``prompt_tokens`` counts the conversation once (as completions count
    each prompt once), and more choices than the server runs at once is a 400 naming n."""
    async with running(
        ckpt, client_factory=scripted_factory(stage_for(ckpt)), max_concurrent=2
    ) as live:
        status, _, raw = await live.post("/tokenize", CHAT)
        assert status == 200
        prompt_tokens = orjson.loads(raw)["count"]
        status, _, raw = await live.post("/v1/chat/completions", {**CHAT, "n": 2, "max_tokens": 3})
        assert status == 200, raw
        assert orjson.loads(raw)["usage"] == {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 6,
            "total_tokens": prompt_tokens + 6,
        }
        status, _, raw = await live.post("/v1/chat/completions", {**CHAT, "n": 3})
        assert status == 400 and error_of(raw) == {
            "message": "n: 3 sequences exceed the server's limit of 2 at once "
            "(--max-concurrent); send fewer per request",
            "type": "invalid_request_error",
            "param": "n",
            "code": 400,
        }


async def test_stream_options_without_include_usage_send_no_usage(ckpt):
    async with running(ckpt, client_factory=scripted_factory(stage_for(ckpt))) as live:
        for options in ({}, {"include_usage": False}):
            body = {"prompt": [5], "max_tokens": 2, "stream": True, "stream_options": options}
            status, _, raw = await live.post("/v1/completions", body)
            assert status == 200
            events = sse_payloads(raw)[:-1]
            assert len(events) == 2 and all(e["choices"] for e in events), events
            assert all(e.get("usage") is None for e in events), events


async def test_echo_without_max_tokens_generates_the_default(ckpt):
    """echo alone (no max_tokens) is not the prompt-only request that ``max_tokens=0`` asks
    for: the prompt is echoed and 16 tokens are generated after it."""
    async with running(ckpt, client_factory=scripted_factory(stage_for(ckpt))) as live:
        status, _, raw = await live.post("/v1/completions", {"prompt": [44, 77], "echo": True})
        assert status == 200, raw
        body = orjson.loads(raw)
        (choice,) = body["choices"]
        assert choice["text"] == "Hi" + "Hi" * 8 and choice["finish_reason"] == "length"
        assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 16, "total_tokens": 18}


async def test_tokenize_counts_a_conversation_longer_than_the_context(ckpt):
    """/tokenize reports what a rendering costs even past the context, up to the character
    bound that chat completions refuse without encoding (64 tokens x 13 characters), which
    /tokenize applies too: the count is what a client needs to trim its conversation."""
    async with running(ckpt, client_factory=scripted_factory(stage_for(ckpt))) as live:
        long_chat = {"messages": [{"role": "user", "content": "x" * 700}]}
        status, _, raw = await live.post("/tokenize", long_chat)
        assert status == 200, raw
        body = orjson.loads(raw)
        assert body["max_model_len"] == 64 and body["count"] == len(body["tokens"]) > 64
        status, _, raw = await live.post("/v1/chat/completions", long_chat)
        assert status == 400 and error_of(raw)["param"] == "messages"
        hopeless = {"messages": [{"role": "user", "content": "x" * 5000}]}
        for path in ("/tokenize", "/v1/chat/completions"):
            status, _, raw = await live.post(path, hopeless)
            error = error_of(raw)
            assert status == 400 and error["param"] == "messages", path
            assert error["message"].startswith(
                "This model's maximum context length is 64 tokens. However, your request has "
                "5050 input characters, more than 832"
            ), path


class RecordingUpdates(ScriptedStage):
    """A scripted stage that records each weight update's arguments."""

    def __init__(self, info, script) -> None:
        super().__init__(info, script)
        self.update_calls: list[tuple] = []

    def update_weights(self, paths, abort, timeout_s) -> int:
        self.update_calls.append((paths, abort, timeout_s))
        return super().update_weights(paths, abort, timeout_s)


async def test_update_weights_hands_its_options_to_the_stage(ckpt):
    stage = RecordingUpdates(scripted_info(ckpt), Script([44]))
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        body = {"model_path": "/ckpt/a", "abort": True, "timeout": 5}
        status, _, raw = await live.post("/v1/update_weights", body)
        assert status == 200 and orjson.loads(raw) == {"weight_version": "1"}
        status, _, raw = await live.post("/v1/update_weights", {"model_path": "/ckpt/b"})
        assert status == 200 and orjson.loads(raw) == {"weight_version": "2"}
    assert stage.update_calls == [(["/ckpt/a"], True, 5.0), (["/ckpt/b"], False, 300.0)]


async def test_a_hub_snapshot_is_served_by_its_repo_id_and_updates_take_repo_ids(
    ckpt, tmp_path, monkeypatch
):
    """A snapshot directory's name is a commit hash: the repo id names the model instead.
    ``model_path`` takes a repo id in the server's local cache (--download-dir's, else the
    default), as --model does."""
    import huggingface_hub.constants

    entry = tmp_path / "hub" / "models--someorg--ouro-tiny"
    snapshot = entry / "snapshots" / ("ab" * 20)
    snapshot.mkdir(parents=True)
    for f in ckpt.iterdir():
        (snapshot / f.name).symlink_to(f)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text("ab" * 20)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    stage = RecordingUpdates(scripted_info(snapshot), Script([44]))
    factory = scripted_factory(stage)
    engine = {"download_dir": str(tmp_path / "hub")}  # (the default cache holds nothing)
    async with running(
        snapshot, client_factory=factory, served_model_name=None, engine=engine
    ) as live:
        status, _, raw = await live.get("/v1/models")
        assert [m["id"] for m in orjson.loads(raw)["data"]] == ["someorg/ouro-tiny"]
        body = {"model_path": "someorg/ouro-tiny"}
        status, _, raw = await live.post("/v1/update_weights", body)
        assert status == 200 and orjson.loads(raw) == {"weight_version": "1"}
        status, _, raw = await live.post("/v1/update_weights", {"model_path": "someorg/none"})
        assert status == 400 and error_of(raw)["param"] == "model_path"
        hub = tmp_path / "hub"
        assert error_of(raw)["message"].startswith(
            "model_path='someorg/none': no such directory, nor a Hugging Face repo id in the "
            f"local cache ({hub}); rltserve never downloads (`hf download someorg/none "
            f"--cache-dir {hub}`"
        )
    assert stage.update_calls == [([str(snapshot)], False, 300.0)]


async def test_max_loops_may_be_the_models_cap(ckpt):
    """``max_loops`` up to the model's cap (8 here) is accepted and reaches the stage."""
    stage = stage_for(ckpt)
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        body = {"prompt": [5], "max_tokens": 1, "max_loops": 8}
        status, _, raw = await live.post("/v1/completions", body)
        assert status == 200, raw
        assert stage.added_params[-1].max_loops == 8


async def test_logprobs_name_tokens_by_their_text_special_tokens_included(ckpt, tmp_path):
    """Logprob entries show a token's text with special tokens spelled out (token 1 is
    ``<|im_start|>``, which the generated text leaves out), or ``token_id:N`` without a
    tokenizer."""
    stage = stage_for(ckpt, tokens=(1,))
    body = {"prompt": [5], "max_tokens": 1, "logprobs": 1}
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        status, _, raw = await live.post("/v1/completions", body)
        assert status == 200, raw
        (choice,) = choices_of(raw)
        assert choice["text"] == ""
        assert choice["logprobs"]["tokens"] == ["<|im_start|>"]
        assert choice["logprobs"]["top_logprobs"] == [{"<|im_start|>": -0.5}]
    stage = ScriptedStage(scripted_info(tmp_path), Script([44]))
    async with running(tmp_path, client_factory=scripted_factory(stage)) as live:
        status, _, raw = await live.post("/v1/completions", body)
        assert status == 200, raw
        logprobs = choices_of(raw)[0]["logprobs"]
        assert logprobs["tokens"] == ["token_id:44"]
        assert logprobs["top_logprobs"] == [{"token_id:44": -0.5}]


async def test_update_weights_timeout_may_be_the_maximum(ckpt):
    """``timeout`` is in [0, 3600] seconds, both ends included."""
    stage = RecordingUpdates(scripted_info(ckpt), Script([44]))
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        for timeout in (3600, 0):
            body = {"model_path": "/ckpt/a", "timeout": timeout}
            status, _, raw = await live.post("/v1/update_weights", body)
            assert status == 200, raw
        status, _, raw = await live.post("/v1/update_weights", {**body, "timeout": 3600.5})
        assert status == 400 and error_of(raw) == {
            "message": "timeout=3600.5: must be in [0, 3600] seconds",
            "type": "invalid_request_error",
            "param": "timeout",
            "code": 400,
        }
    assert stage.update_calls == [(["/ckpt/a"], False, 3600.0), (["/ckpt/a"], False, 0.0)]


class RecordingGroups(ScriptedStage):
    """A scripted stage that records the group of each request (the n samples of a prompt
    share one, so that the engine shares the prompt's cache among them)."""

    def __init__(self, info, script) -> None:
        super().__init__(info, script)
        self.groups: list[str | None] = []

    def add_request(self, request_id, prompt_token_ids, params, sink, group=None) -> None:
        self.groups.append(group)
        super().add_request(request_id, prompt_token_ids, params, sink, group)


async def test_the_samples_of_a_prompt_share_a_group(ckpt):
    stage = RecordingGroups(scripted_info(ckpt), Script([44]))
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        body = {"prompt": [[5], [6]], "max_tokens": 1, "n": 2}
        status, _, raw = await live.post("/v1/completions", body)
        assert status == 200, raw
        first, second = stage.groups[:2], stage.groups[2:]
        assert len(set(first)) == len(set(second)) == 1 and first != second
        assert first[0] is not None and first[0].endswith("-0") and second[0].endswith("-1")
        status, _, raw = await live.post("/v1/chat/completions", {**CHAT, "n": 2})
        assert status == 200, raw
        assert len(set(stage.groups[4:])) == 1 and stage.groups[4] is not None
        status, _, raw = await live.post("/v1/completions", {"prompt": [5], "max_tokens": 1})
        assert status == 200 and stage.groups[6:] == [None]


async def test_every_model_taking_route_refuses_another_model(ckpt):
    """``model`` names the served model (or is left out) on every route that takes one."""
    async with running(ckpt, client_factory=scripted_factory(stage_for(ckpt))) as live:
        for path, body in (
            ("/detokenize", {"tokens": [44]}),
            ("/tokenize", {"prompt": "Hi"}),
            ("/v1/completions", {"prompt": [5], "max_tokens": 1}),
            ("/v1/chat/completions", {**CHAT, "max_tokens": 1}),
        ):
            status, _, raw = await live.post(path, {**body, "model": "tiny"})
            assert status == 200, (path, raw)
            status, _, raw = await live.post(path, {**body, "model": "gpt-4"})
            assert status == 404 and error_of(raw) == {
                "message": "The model `gpt-4` does not exist.",
                "type": "not_found_error",
                "param": "model",
                "code": 404,
            }, path


async def test_without_a_served_name_the_checkpoint_path_names_the_model_too(ckpt):
    # (vLLM serves a checkpoint under --model as given; the listed name is the directory's)
    body = {"prompt": [5], "max_tokens": 1}
    factory = scripted_factory(stage_for(ckpt))
    async with running(ckpt, client_factory=factory, served_model_name=None) as live:
        for name in (ckpt.name, str(ckpt)):
            status, _, raw = await live.post("/v1/completions", {**body, "model": name})
            assert status == 200 and orjson.loads(raw)["model"] == name, raw  # (as asked)
        status, _, raw = await live.post("/v1/completions", body)
        assert orjson.loads(raw)["model"] == ckpt.name
        status, _, raw = await live.get("/v1/models")
        assert [m["id"] for m in orjson.loads(raw)["data"]] == [ckpt.name]
    async with running(ckpt, client_factory=factory, served_model_name="svc") as live:
        for name in (str(ckpt), ckpt.name):  # a served name is the only one
            status, _, raw = await live.post("/v1/completions", {**body, "model": name})
            assert status == 404, raw


async def test_a_relative_model_path_is_named_for_the_folder_it_names(ckpt, monkeypatch):
    """``--model .`` run inside the checkpoint (or ``--model ../ckpt``) is named for that
    folder: the name of "." itself is "", which /v1/models listed and responses repeated."""
    body = {"prompt": [5], "max_tokens": 1}
    monkeypatch.chdir(ckpt)
    for given in (".", f"../{ckpt.name}"):
        factory = scripted_factory(stage_for(ckpt))
        async with running(given, client_factory=factory, served_model_name=None) as live:
            status, _, raw = await live.get("/v1/models")
            assert status == 200, raw
            assert [m["id"] for m in orjson.loads(raw)["data"]] == [ckpt.name]
            status, _, raw = await live.post("/v1/completions", body)
            assert status == 200 and orjson.loads(raw)["model"] == ckpt.name, raw
            status, _, raw = await live.post("/v1/completions", {**body, "model": given})
            assert status == 200 and orjson.loads(raw)["model"] == given, raw  # (as given)


class DeafStage(ScriptedStage):
    """A stage that takes aborts without ever answering them (a wedged or dying stage)."""

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


async def test_an_interrupted_generation_ends_even_when_the_stage_never_answers(ckpt):
    """``interrupt_all`` ends each open request itself: the drain that calls it must not wait
    for an abort update a wedged stage never sends."""
    hold = threading.Event()  # (no token ever comes either)
    stage = DeafStage(scripted_info(ckpt, max_model_len=64), Script([44], hold=hold))
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        reply = asyncio.create_task(live.post("/v1/completions", {"prompt": [5], "n": 2}))
        await wait_for(lambda: len(stage.added) == 2)
        live.state.require_frontend().interrupt_all()
        status, _, raw = await asyncio.wait_for(reply, 10)
        assert status == 503 and error_of(raw)["message"] == "the request was aborted"
        assert stage.aborted == stage.added
        assert live.state.require_frontend().num_open == 0
        hold.set()


async def test_an_unexpected_add_failure_aborts_the_choices_already_added(ckpt):
    """Any other error from the second ``add_request`` (a bug, an id clash) is a 500 and, as
    for a stage that died, the first choice is aborted and nothing is left open."""
    hold = threading.Event()
    error = RuntimeError("boom")
    stage = FailingAdd(scripted_info(ckpt, max_model_len=64), Script([44], hold=hold), 1, error)
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        status, _, raw = await live.post("/v1/completions", {"prompt": [5], "n": 2})
        assert status == 500, raw
        assert stage.added and stage.aborted == stage.added
        assert live.state.require_frontend().num_open == 0
        hold.set()
