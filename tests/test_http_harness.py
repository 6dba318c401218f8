"""Shared pieces of the HTTP tests (no tests here): the tiny checkpoint, a scripted stage client,
servers on loopback sockets and SSE parsing.

``ScriptedStage`` stands in for the engine where a test needs exact, model-independent tokens
(byte-for-byte stream checks), held requests (overload) or a dying stage. It speaks the stage
client interface and calls sinks from its own thread, as the real clients do.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

from rltserve.config import EngineConfig
from rltserve.core.engine import EngineInfo, EngineStats
from rltserve.core.request import FinishReason
from rltserve.core.stage import InProcessStageClient, StageError
from rltserve.http.app import create_app
from rltserve.http.config import ServerConfig
from rltserve.http.server import RunningServer, serving
from rltserve.http.state import STATE, ServingState
from rltserve.models.tokenizer import load_tokenizer
from rltserve.updates import RequestUpdate

FIXED_CREATED = 1730000000
MODEL = "tiny"
ENGINE = {"num_blocks": 512, "max_num_seqs": 16}


def fixed_ids(prefix: str) -> str:
    return f"{prefix}-test"


def tiny_checkpoint(tmp_path_factory) -> Path:
    """ouro-tiny with its tokenizer, built once per test session."""
    from rltserve.models.presets import make_model

    path = tmp_path_factory.getbasetemp() / "ouro-tiny-http"
    if not (path / "config.json").exists():
        make_model("ouro-tiny", path)
    return path


def special_think_end_checkpoint(ckpt: Path, path: Path) -> Path:
    """A copy of ``ckpt`` whose tokenizer makes ``</think>`` a special token (as some thinking
    models' do): skip_special_tokens drops it from texts."""
    import shutil

    shutil.copytree(ckpt, path)
    for name, entries in [("tokenizer.json", "added_tokens"),
                          ("tokenizer_config.json", "added_tokens_decoder")]:  # fmt: skip
        data = json.loads((path / name).read_text())
        items = data[entries] if isinstance(data[entries], list) else data[entries].values()
        for token in items:
            token["special"] = token["special"] or token["content"] == "</think>"
        (path / name).write_text(json.dumps(data))
    return path


def engine_config(path: Path, **overrides) -> EngineConfig:
    return EngineConfig.from_flat(model=str(path), **{**ENGINE, **overrides})


@dataclass
class Script:
    """What a ScriptedStage generates: ``tokens`` cycled up to max_tokens, one per update."""

    tokens: list[int]
    interval_s: float = 0.0
    hold: threading.Event | None = None  # tokens flow only once set
    reject: str | None = None  # every request is rejected with this message
    fail: str | None = None  # after fail_after tokens the request fails (an engine error)
    fail_after: int = 0
    fail_gate: threading.Event | None = None  # the failure waits for it


@dataclass
class _Open:
    prompt: list[int]
    params: object
    sink: object
    aborted: threading.Event = field(default_factory=threading.Event)


class ScriptedStage:
    """A stage client that plays back a script (see module docstring)."""

    def __init__(self, info: EngineInfo, script: Script) -> None:
        self.info = info
        self.script = script
        self.stats: EngineStats | None = None
        self.aborted: list[str] = []
        self.added_params: list = []  # the SamplingParams of every request, in order
        self.added_prompts: list[list[int]] = []  # and their prompts
        self.added: list[str] = []
        self.weight_updates: list[list[str]] = []  # the paths of each update_weights call
        self.weight_version = 0
        self.sleeping: set[str] = set()  # (sleep mode: only recorded)
        self.cache_resets = 0
        self._open: dict[str, _Open] = {}
        self._lock = threading.Lock()
        self._dead: str | None = None
        self._closed = False

    @property
    def alive(self) -> bool:
        return self._dead is None and not self._closed

    def wait_ready(self, timeout: float | None = None) -> EngineInfo:
        return self.info

    def add_request(self, request_id, prompt_token_ids, params, sink, group=None) -> None:
        if not self.alive:
            raise StageError("stage is not running")
        with self._lock:
            self._open[request_id] = _Open(list(prompt_token_ids), params, sink)
            self.added.append(request_id)
            self.added_params.append(params)
            self.added_prompts.append(list(prompt_token_ids))
        threading.Thread(target=self._play, args=(request_id,), daemon=True).start()

    def update_weights(self, paths: list[str], abort: bool, timeout_s: float) -> int:
        """Records the update (there are no weights to load) and counts the version up."""
        self.weight_updates.append(list(paths))
        self.weight_version += 1
        return self.weight_version

    def sleep(self, level: int, timeout_s: float) -> None:
        self.sleeping = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str]) -> None:
        self.sleeping -= set(tags)

    def reset_prefix_cache(self) -> None:
        self.cache_resets += 1

    def abort(self, request_id: str) -> None:
        with self._lock:
            self.aborted.append(request_id)
            item = self._open.get(request_id)
        if item is not None:
            item.aborted.set()

    def close(self) -> None:
        self._closed = True
        for rid in list(self._open):
            self.abort(rid)

    def kill(self) -> None:
        """Dies like a crashed stage: every open request gets an ERROR update."""
        self._dead = "worker process exited (code -9)"
        with self._lock:
            items, self._open = dict(self._open), {}
        for rid, item in items.items():
            item.aborted.set()
            error = f"stage died: {self._dead}"
            item.sink(RequestUpdate(rid, finish_reason=FinishReason.ERROR, error=error))

    def _stats(self) -> EngineStats:
        running = len(self._open)
        zeros = {f.name: 0 for f in dataclasses.fields(EngineStats)}
        return EngineStats(**{**zeros, "num_running": running, "kv_usage": running / 10})

    def _finish(self, rid: str, update: RequestUpdate, item: _Open) -> None:
        with self._lock:
            if self._open.pop(rid, None) is None:
                return  # killed meanwhile: the ERROR update went out
            self.stats = self._stats()
        item.sink(update)

    def _play(self, rid: str) -> None:
        item = self._open[rid]
        script, params = self.script, item.params
        if script.reject is not None:
            error = RequestUpdate(rid, finish_reason=FinishReason.ERROR, error=script.reject)
            error.rejected = True
            self._finish(rid, error, item)
            return
        if script.hold is not None:
            while not script.hold.wait(0.01):
                if item.aborted.is_set():
                    break
        for i in range(params.max_tokens):
            if script.fail is not None and i == script.fail_after:
                if script.fail_gate is not None:
                    script.fail_gate.wait(10)
                error = RequestUpdate(rid, finish_reason=FinishReason.ERROR, error=script.fail)
                self._finish(rid, error, item)
                return
            if script.interval_s:
                item.aborted.wait(script.interval_s)
            if item.aborted.is_set():
                self._finish(rid, RequestUpdate(rid, finish_reason=FinishReason.ABORT), item)
                return
            token = script.tokens[i % len(script.tokens)]
            finish = None
            stops = set(params.stop_token_ids) | (
                set() if params.ignore_eos else set(self.info.eos_token_ids)
            )
            if token in stops:
                finish = FinishReason.STOP
            elif i + 1 == params.max_tokens:
                finish = FinishReason.LENGTH
            top = [(token, -0.5), (token + 1, -1.5)][: params.logprobs or 0]
            update = RequestUpdate(rid, [token], [i % 4 + 1], [-0.5], [top], finish)
            if finish is not None:
                self._finish(rid, update, item)
                return
            self.stats = self._stats()
            item.sink(update)


def scripted_info(path: Path, max_model_len: int = 64) -> EngineInfo:
    return EngineInfo(str(path), "ouro", 4, 8, max_model_len, 512, (0, 2), 64, 16, "last_exited")


def stage_for(path: Path, tokens=(44, 77), **script) -> ScriptedStage:
    """A scripted stage of a 64-token context that plays ``tokens`` ("Hi" on ouro-tiny)."""
    return ScriptedStage(scripted_info(path), Script(list(tokens), **script))


def scripted_factory(stage: ScriptedStage):
    return lambda config: stage


@dataclass
class Live:
    """A running app, its state and an HTTP session to talk to it."""

    server: RunningServer
    state: ServingState
    session: aiohttp.ClientSession

    @property
    def url(self) -> str:
        return self.server.url

    async def post(self, path: str, body: object, **kw) -> tuple[int, dict, bytes]:
        """POSTs JSON; returns (status, headers, raw body)."""
        return await post(self.session, self.url + path, body, **kw)

    async def get(self, path: str, **kw) -> tuple[int, dict, bytes]:
        async with self.session.get(self.url + path, **kw) as r:
            return r.status, r.headers, await r.read()

    def stream(self, path: str, body: object):
        """An open streaming response (an aiohttp response context manager)."""
        return self.session.post(self.url + path, json=body)


@contextlib.asynccontextmanager
async def running(
    path: Path,
    *,
    client_factory=InProcessStageClient,
    wait: bool = True,
    engine: dict | None = None,
    **server,
) -> AsyncIterator[Live]:
    """An app on a loopback port with fixed ids and clock; yields once the engine is ready."""
    config = ServerConfig(**{"port": 0, "served_model_name": MODEL, **server})
    app = create_app(
        config,
        engine_config(path, **(engine or {})),
        client_factory=client_factory,
        ids=fixed_ids,
        clock=lambda: FIXED_CREATED,
    )
    async with serving(app, config) as srv, aiohttp.ClientSession() as session:
        state = app[STATE]
        if wait:
            await state.ready.wait()
            assert state.load_error is None, state.load_error
        yield Live(srv, state, session)


def error_of(raw: bytes) -> dict:
    """The ``error`` object of an OpenAI-style error body (which holds nothing else)."""
    body = orjson.loads(raw)
    assert list(body) == ["error"] and list(body["error"]) == ["message", "type", "param", "code"]
    return body["error"]


def sse_payloads(raw: bytes) -> list:
    """The decoded ``data:`` payloads of an SSE body (``[DONE]`` kept as the string)."""
    assert raw.endswith(b"\n\n"), raw[-50:]
    out = []
    for event in raw[:-2].split(b"\n\n"):
        assert event.startswith(b"data: "), event
        payload = event[len(b"data: ") :]
        out.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    return out


async def post(session: aiohttp.ClientSession, url: str, body: object, **kw):
    """POSTs JSON; returns (status, headers, raw body)."""
    headers = {"Content-Type": "application/json", **kw.pop("headers", {})}
    try:
        data = orjson.dumps(body)
    except TypeError:  # (integers beyond 64 bits, which clients may send)
        data = json.dumps(body).encode()
    async with session.post(url, data=data, headers=headers, **kw) as r:
        return r.status, r.headers, await r.read()


async def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def metric(text: str, name: str) -> float:
    """The value of the one series named ``name`` in a ``/metrics`` text (any labels)."""
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    assert match, name
    return float(match.group(1))


def hi_token_ids(ckpt: Path) -> list[int]:
    """Token ids of " Hi!": four byte-level tokens whatever the merges."""
    tok = load_tokenizer(ckpt)
    ids = tok.encode(" Hi!")
    assert [tok.decode([i]) for i in ids] == [" ", "H", "i", "!"]
    return ids


class RewritingStage(ScriptedStage):
    """A scripted stage whose updates pass through ``rewrite`` on their way to the server:
    values the script never makes (-inf logprobs, cached prompt tokens, prompt logprobs)."""

    def __init__(self, info, script, rewrite) -> None:
        super().__init__(info, script)
        self.rewrite = rewrite

    def add_request(self, request_id, prompt_token_ids, params, sink, group=None) -> None:
        rewrite = self.rewrite
        super().add_request(request_id, prompt_token_ids, params, lambda u: sink(rewrite(u)), group)


def first_updates(change):
    """A ``rewrite`` that applies ``change`` to the first update of each request."""
    seen: set[str] = set()

    def rewrite(update: RequestUpdate) -> RequestUpdate:
        if update.request_id not in seen:
            seen.add(update.request_id)
            change(update)
        return update

    return rewrite


def body_of(raw: bytes) -> dict:
    """A non-streaming body read with the SSE parser."""
    return sse_payloads(b"data: " + raw + b"\n\n")[0]
