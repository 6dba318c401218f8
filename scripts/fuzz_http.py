"""Property-based fuzzing of the HTTP API (and of SamplingParams) with hypothesis.

Every generated completion, chat, tokenize or detokenize body (wrong types, missing and unknown
fields, extreme numbers, NaN/Infinity literals, huge and empty strings, invalid UTF-8, deeply
nested JSON, token ids outside the vocabulary, sampling and loop fields at and past their limits)
must get a 2xx, or a 4xx OpenAI-style JSON error whose ``param`` names a field when the body was a
JSON object; never a 5xx, never a hang; and the engine must be idle afterwards (no running
requests, no KV blocks in use, no admission slots held).

    python scripts/fuzz_http.py --examples 2000 [--seed 7]

runs each property for that many examples against an in-process server on a freshly built tiny
checkpoint (nothing is downloaded) and prints a JSON summary; the test suite runs the same
properties for a few dozen examples each (tests/test_http_fuzz.py).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import math
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

REQUEST_TIMEOUT_S = 60.0  # one request; a hang fails the property instead of the run
VOCAB = 512  # the tiny checkpoint's; out-of-vocabulary ids are generated around it

# ---------------------------------------------------------------------- a server on a thread


@dataclass
class ServerThread:
    """An rltserve app with an in-process engine, served from its own event loop thread."""

    url: str
    host: str
    port: int
    state: Any
    loop: asyncio.AbstractEventLoop
    _stop: Callable[[], None]

    def call(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def engine_idle(self) -> bool:
        state = self.state
        frontend = state._frontend
        stats = state.client.stats if state.client is not None else None
        return (
            state.gate.in_use == 0
            and state.gate.num_queued == 0
            and (frontend is None or frontend.num_open == 0)
            and (stats is None or (stats.num_running == 0 and stats.num_waiting == 0))
            and (stats is None or stats.kv_usage == 0)
        )

    def wait_idle(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.engine_idle():
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle: {self.describe()}")
            time.sleep(0.01)

    def describe(self) -> str:
        state = self.state
        return (
            f"in_use={state.gate.in_use} queued={state.gate.num_queued} "
            f"stats={state.client.stats if state.client else None}"
        )

    def close(self) -> None:
        self._stop()


def start_server(path: Path, **server: Any) -> ServerThread:
    """Serves checkpoint ``path`` on a loopback port from a daemon thread; returns once ready."""
    from rltserve.config import EngineConfig
    from rltserve.core.stage import InProcessStageClient
    from rltserve.http.app import create_app
    from rltserve.http.config import ServerConfig
    from rltserve.http.server import start_server as start
    from rltserve.http.state import STATE

    config = ServerConfig(port=0, served_model_name="tiny", **server)
    # A short context keeps every generation short (chat without max_tokens fills it).
    engine = EngineConfig.from_flat(
        model=str(path), num_blocks=512, max_num_seqs=16, max_model_len=96
    )
    loop = asyncio.new_event_loop()
    ready: dict[str, Any] = {}
    started = threading.Event()

    async def main() -> None:
        app = create_app(config, engine, client_factory=InProcessStageClient)
        running = await start(app, config)
        await app[STATE].ready.wait()
        ready.update(server=running, state=app[STATE])
        started.set()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(main())
        loop.run_forever()

    thread = threading.Thread(target=run, name="fuzz-server", daemon=True)
    thread.start()
    if not started.wait(120):
        raise RuntimeError("the server did not start within 120 s")
    running, state = ready["server"], ready["state"]
    if state.load_error is not None:
        raise RuntimeError(state.load_error)

    def stop() -> None:
        asyncio.run_coroutine_threadsafe(running.close(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)

    host, port = running.url.removeprefix("http://").rsplit(":", 1)
    return ServerThread(running.url, host, int(port), state, loop, stop)


def tiny_checkpoint(directory: Path) -> Path:
    from rltserve.models.presets import make_model

    path = directory / "ouro-tiny-fuzz"
    if not (path / "config.json").exists():
        make_model("ouro-tiny", path)
    return path


# ---------------------------------------------------------------------- strategies

INTS = st.sampled_from(
    [0, 1, -1, 2, 4, 16, 20, 21, 63, 64, 65, 128, 129, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63)]
    + [-(2**63) - 1, 10**30]
) | st.integers(-(10**6), 10**6)
FLOATS = st.sampled_from(
    [0.0, -0.0, 1.0, 0.5, 2.0, 2.0001, -2.0, -2.5, 1e-300, 1e308, -1e308, 1e-7]
    + [math.nan, math.inf, -math.inf]
) | st.floats(allow_nan=True, allow_infinity=True)
TEXT = (
    st.text(max_size=40)
    | st.sampled_from(["", " ", "\x00", "\ud800", "\u202e", "a" * 5000, "é" * 3000])
    | st.just("x" * 300_000)  # beyond max_model_len x the longest token: a cheap 400
)
TOKEN_IDS = st.lists(
    st.integers(-3, VOCAB + 3) | st.sampled_from([2**31, 2**63, -(2**63)]), max_size=80
)
SCALARS = st.none() | st.booleans() | INTS | FLOATS | TEXT
JSON = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _wrong_or(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly values of the right shape, sometimes anything at all."""
    return st.one_of(valid, valid, valid, JSON)


SMALL_TOKENS = st.integers(-2, 70) | st.sampled_from([0, 1, 64, 65, 2**31, 10**12])
GENERATION_FIELDS: dict[str, st.SearchStrategy] = {
    "model": _wrong_or(st.sampled_from(["tiny", "other", ""])),
    "temperature": _wrong_or(FLOATS | st.sampled_from([0, 1, 2, 3])),
    "top_p": _wrong_or(FLOATS),
    "n": _wrong_or(st.integers(-1, 5) | st.sampled_from([0, 128, 129, 2**63])),
    "stream": _wrong_or(st.booleans()),
    "stream_options": _wrong_or(
        st.fixed_dictionaries(
            {}, optional={"include_usage": JSON, "continuous_usage_stats": st.booleans()}
        )
    ),
    "stop": _wrong_or(TEXT | st.lists(TEXT, max_size=20)),
    "seed": _wrong_or(INTS),
    "presence_penalty": _wrong_or(FLOATS),
    "frequency_penalty": _wrong_or(FLOATS),
    "logit_bias": _wrong_or(st.dictionaries(st.text(max_size=4), FLOATS, max_size=2)),
    "user": _wrong_or(TEXT),
    "top_k": _wrong_or(INTS),
    "min_p": _wrong_or(FLOATS),
    "repetition_penalty": _wrong_or(FLOATS),
    "ignore_eos": _wrong_or(st.booleans()),
    "min_tokens": _wrong_or(SMALL_TOKENS),
    "stop_token_ids": _wrong_or(TOKEN_IDS),
    "min_loops": _wrong_or(st.integers(-1, 10) | INTS),
    "max_loops": _wrong_or(st.integers(-1, 10) | INTS),
    "num_steps": _wrong_or(st.integers(-1, 10)),
    "exit_threshold": _wrong_or(FLOATS),
    "priority": _wrong_or(INTS),
    "return_exit_depths": _wrong_or(st.booleans()),
    "return_token_ids": _wrong_or(st.booleans()),
    "truncate_prompt_tokens": _wrong_or(st.integers(-3, 70)),
    "cache_salt": _wrong_or(st.none() | st.text(max_size=3)),
}
PROMPTS = TEXT | TOKEN_IDS | st.lists(TEXT, max_size=3) | st.lists(TOKEN_IDS, max_size=3)
MESSAGE = st.fixed_dictionaries(
    {"role": _wrong_or(st.sampled_from(["system", "user", "assistant", "tool", "robot"]))},
    optional={
        "content": _wrong_or(
            TEXT
            | st.lists(
                st.fixed_dictionaries(
                    {"type": st.sampled_from(["text", "image_url"])}, optional={"text": TEXT}
                ),
                max_size=3,
            )
        ),
        "name": _wrong_or(TEXT),
    },
)
MESSAGES = st.lists(MESSAGE, max_size=4)
EXTRA = st.dictionaries(st.sampled_from(["foo", "tools_x", "logit", "échec"]), JSON, max_size=2)


def _body(required: dict, optional: dict) -> st.SearchStrategy:
    fields = st.fixed_dictionaries(required, optional=optional)
    return st.builds(lambda a, b: {**b, **a}, fields, EXTRA) | st.just({})


def completion_bodies() -> st.SearchStrategy:
    optional = {
        **GENERATION_FIELDS,
        "max_tokens": _wrong_or(SMALL_TOKENS),
        "logprobs": _wrong_or(st.integers(-1, 22)),
        "echo": _wrong_or(st.booleans()),
        "best_of": _wrong_or(st.integers(-1, 5)),
        "suffix": _wrong_or(TEXT),
    }
    return _body({"prompt": _wrong_or(PROMPTS)}, optional)


def chat_bodies() -> st.SearchStrategy:
    optional = {
        **GENERATION_FIELDS,
        "max_tokens": _wrong_or(SMALL_TOKENS),
        "max_completion_tokens": _wrong_or(SMALL_TOKENS),
        "logprobs": _wrong_or(st.booleans()),
        "top_logprobs": _wrong_or(st.integers(-1, 22)),
        "chat_template_kwargs": _wrong_or(st.dictionaries(st.text(max_size=6), JSON, max_size=2)),
        "add_generation_prompt": _wrong_or(st.booleans()),
        "tools": _wrong_or(st.lists(st.dictionaries(st.text(max_size=3), JSON), max_size=1)),
        "tool_choice": _wrong_or(st.sampled_from(["none", "auto", "required"])),
        "response_format": _wrong_or(st.sampled_from([{"type": "text"}, {"type": "json"}, {}])),
    }
    return _body({"messages": _wrong_or(MESSAGES)}, optional)


def tokenize_bodies() -> st.SearchStrategy:
    optional = {
        "model": _wrong_or(st.sampled_from(["tiny", "x"])),
        "prompt": _wrong_or(TEXT),
        "messages": _wrong_or(MESSAGES),
        "add_special_tokens": _wrong_or(st.booleans()),
        "add_generation_prompt": _wrong_or(st.booleans()),
        "chat_template_kwargs": _wrong_or(st.dictionaries(st.text(max_size=6), JSON, max_size=2)),
    }
    return _body({}, optional)


def detokenize_bodies() -> st.SearchStrategy:
    return _body({"tokens": _wrong_or(TOKEN_IDS)}, {"model": _wrong_or(st.just("tiny"))})


ENDPOINTS: dict[str, Callable[[], st.SearchStrategy]] = {
    "/v1/completions": completion_bodies,
    "/v1/chat/completions": chat_bodies,
    "/tokenize": tokenize_bodies,
    "/detokenize": detokenize_bodies,
}


def encode(body: object) -> bytes:
    """JSON text with NaN/Infinity literals where the body has them (invalid JSON: a 400)."""
    return json.dumps(body, allow_nan=True, ensure_ascii=False).encode("utf-8", "surrogatepass")


@st.composite
def raw_bodies(draw, path: str) -> bytes:
    """Bytes that are not (quite) JSON: invalid UTF-8 inside strings, truncations, deep nesting,
    other top-level values."""
    body = encode(draw(ENDPOINTS[path]()))
    kind = draw(st.sampled_from(["utf8", "truncate", "nest", "top", "empty", "same"]))
    if kind == "utf8":
        at = draw(st.integers(0, len(body)))
        return body[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80"])) + body[at:]
    if kind == "truncate":
        return body[: draw(st.integers(0, max(0, len(body) - 1)))]
    if kind == "nest":
        depth = draw(st.sampled_from([10, 500, 1025, 100_000]))
        inner = b"[" * depth + b"]" * depth
        return b'{"prompt": ' + inner + b', "tokens": ' + inner + b"}"
    if kind == "top":
        return draw(st.sampled_from([b"[]", b"null", b"1", b'"x"', b"true", b"NaN"]))
    if kind == "empty":
        return b""
    return body


# ---------------------------------------------------------------------- the properties


def post(server: ServerThread, path: str, raw: bytes, headers: dict | None = None):
    """POSTs raw bytes; returns (status, headers, body). Raises on a hang or a dropped
    connection (both are failures)."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=REQUEST_TIMEOUT_S)
    try:
        conn.request("POST", path, raw, {"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def check_response(status: int, headers: dict, data: bytes, sent_object: bool) -> None:
    """2xx, or an OpenAI-style 4xx naming the field of a JSON-object body; never a 5xx."""
    assert status < 500, (status, data[:500])
    if status < 300:
        if headers.get("Content-Type", "").startswith("text/event-stream"):
            assert data.endswith(b"data: [DONE]\n\n"), data[-200:]
            assert b'"error"' not in data, data[-500:]
        else:
            json.loads(data)
        return
    error = json.loads(data)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == status and isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in error["message"], error
    if status == 400 and sent_object:
        assert error["param"], error  # a JSON object's error names its field


def check_body(server: ServerThread, path: str, body: object) -> int:
    status, headers, data = post(server, path, encode(body))
    sent_object = isinstance(body, dict) and _is_plain_json(body)
    check_response(status, headers, data, sent_object)
    return status


def check_raw(server: ServerThread, path: str, raw: bytes) -> int:
    status, headers, data = post(server, path, raw)
    check_response(status, headers, data, sent_object=False)
    return status


def _is_plain_json(value: object) -> bool:
    """Whether the body is JSON the server can parse (no NaN/Infinity literals, no lone
    surrogates, which orjson rejects as invalid UTF-8)."""
    try:
        json.dumps(value, allow_nan=False, ensure_ascii=False).encode("utf-8")
        return True
    except (ValueError, UnicodeEncodeError):
        return False


def check_sampling_params(kwargs: dict) -> None:
    """SamplingParams builds, or raises a ValueError whose message starts with the field."""
    from rltserve.sampling import SamplingParams

    try:
        SamplingParams(**kwargs)
    except ValueError as exc:
        field = str(exc).split("=", 1)[0].split(":", 1)[0]
        assert field in kwargs, (field, exc)


SAMPLING_FIELDS = {
    name: strategy
    for name, strategy in GENERATION_FIELDS.items()
    if name
    not in (
        *("model", "n", "stream", "stream_options", "logit_bias", "user", "num_steps"),
        *("return_exit_depths", "return_token_ids"),
    )
} | {
    "max_tokens": _wrong_or(SMALL_TOKENS),
    "logprobs": _wrong_or(st.integers(-1, 22)),
    "init_state": _wrong_or(st.sampled_from(["random", "zero", "ones"])),
    "speculative": _wrong_or(st.booleans() | st.none()),
}
SAMPLING_KWARGS = st.fixed_dictionaries({}, optional=SAMPLING_FIELDS)


# ---------------------------------------------------------------------- the long run


def _bind(check: Callable[[ServerThread, str, Any], int], server: ServerThread, path: str):
    def prop(**drawn: Any) -> None:  # hypothesis passes the one drawn value by keyword
        (value,) = drawn.values()
        check(server, path, value)

    return prop


def run(examples: int, seed: int | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(tiny_checkpoint(Path(tmp)))
        results: dict[str, Any] = {"examples_per_property": examples, "properties": {}}
        fuzz = settings(
            max_examples=examples,
            deadline=None,
            derandomize=seed is None,
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        properties: dict[str, Callable[[], None]] = {}
        for path, strategy in ENDPOINTS.items():
            properties[path] = given(body=strategy())(_bind(check_body, server, path))
            properties[path + " raw"] = given(raw=raw_bodies(path))(_bind(check_raw, server, path))
        properties["SamplingParams"] = given(kwargs=SAMPLING_KWARGS)(check_sampling_params)
        try:
            for name, prop in properties.items():
                started = time.monotonic()
                test = fuzz(prop)
                if seed is not None:
                    from hypothesis import seed as with_seed

                    test = with_seed(seed)(test)
                try:
                    test()
                    outcome = "passed"
                except Exception as exc:  # noqa: BLE001 - reported, the run goes on
                    causes = [exc, *getattr(exc, "exceptions", ())]
                    outcome = "FAILED: " + " | ".join(
                        f"{type(e).__name__}: {str(e)[:800]}" for e in causes
                    )
                server.wait_idle()
                results["properties"][name] = {
                    "outcome": outcome,
                    "seconds": round(time.monotonic() - started, 1),
                }
                print(name, outcome, file=sys.stderr, flush=True)
        finally:
            server.close()
    results["failures"] = sum(1 for r in results["properties"].values() if r["outcome"] != "passed")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=200, help="examples per property")
    parser.add_argument(
        "--seed", type=int, default=None, help="random seed (default: derandomized)"
    )
    args = parser.parse_args(argv)
    results = run(args.examples, args.seed)
    print(json.dumps(results, indent=2))
    return 1 if results["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
