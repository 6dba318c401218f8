"""CORS as vLLM's server (Starlette's ``CORSMiddleware``) does it: ``--allowed-origins``,
``--allowed-methods``, ``--allowed-headers`` (comma-separated or JSON lists, ``*`` by default)
and ``--allow-credentials``; every preflight answered before the API key is checked, an
allowed one with 204, a refused one with a 400 naming what was refused."""

from __future__ import annotations

import orjson
import pytest
from test_http_harness import (
    Script,
    ScriptedStage,
    running,
    scripted_factory,
    scripted_info,
)

from rltserve.http.config import ServerConfig

KEY = "sk-very-secret-0123456789"
CHAT = "/v1/chat/completions"
BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
PREFLIGHT = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}  # fmt: skip


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from test_http_harness import tiny_checkpoint

    return tiny_checkpoint(tmp_path_factory)


def scripted(ckpt):
    return scripted_factory(ScriptedStage(scripted_info(ckpt), Script([44, 45, 46])))


async def _options(live, path: str, headers: dict) -> tuple[int, dict, bytes]:
    async with live.session.options(live.url + path, headers=headers) as r:
        return r.status, r.headers, await r.read()


async def test_browsers_on_allowed_origins_may_call_the_api(ckpt):
    """CORS as vLLM's server allows it by default: a preflight is answered before the key is
    checked (browsers send none with it) and every answer to an allowed origin says so."""
    chat, preflight = CHAT, PREFLIGHT
    async with running(ckpt, client_factory=scripted(ckpt), api_key=KEY) as live:
        async with live.session.options(live.url + chat, headers=preflight) as r:
            assert r.status == 204
            assert r.headers["Access-Control-Allow-Origin"] == "*"
            assert r.headers["Access-Control-Allow-Methods"] == "POST"
            assert r.headers["Access-Control-Allow-Headers"] == "authorization,content-type"
        body = {**BODY, "stream": True}
        headers = {"Origin": "https://app.example", "Authorization": f"Bearer {KEY}"}
        status, got, _ = await live.post(chat, body, headers=headers)
        assert status == 200 and got["Access-Control-Allow-Origin"] == "*"
        origin = {"Origin": "https://app.example"}  # (no key: refused, readable by the page)
        status, got, _ = await live.post(chat, body, headers=origin)
        assert status == 401 and got["Access-Control-Allow-Origin"] == "*"
    only = {"allowed_origins": "https://app.example, https://b.example"}
    async with running(ckpt, client_factory=scripted(ckpt), **only) as live:
        status, got, _ = await live.post(chat, BODY, headers={"Origin": "https://b.example"})
        assert got["Access-Control-Allow-Origin"] == "https://b.example" and got["Vary"] == "Origin"
        status, got, _ = await live.post(chat, BODY, headers={"Origin": "https://c.example"})
        assert status == 200 and "Access-Control-Allow-Origin" not in got
        status, _, raw = await _options(live, chat, {**preflight, "Origin": "https://c.example"})
        assert status == 400  # (vLLM's: the browser then refuses the call)
        assert orjson.loads(raw)["error"]["message"] == "Disallowed CORS origin"
    with pytest.raises(ValueError, match="allowed_origins=3: must be a string"):
        ServerConfig(allowed_origins=3)


async def test_allowed_origins_take_vllms_json_list(ckpt):
    """``--allowed-origins '["*"]'`` (vLLM's spelling, its manifests') allows any origin: taken
    as one comma-separated origin it turned CORS off without a word."""
    chat = CHAT
    assert ServerConfig(allowed_origins='["*"]').origins == {"*"}
    assert ServerConfig(allowed_origins=" []").origins == frozenset()
    two = '["https://app.example", "https://b.example"]'
    assert ServerConfig(allowed_origins=two).origins == {"https://app.example", "https://b.example"}
    for bad in ('["*"', "[3]", '["a"], ["b"]'):
        with pytest.raises(ValueError, match=r"^allowed_origins=.*: not a JSON list of strings"):
            ServerConfig(allowed_origins=bad)
    async with running(ckpt, client_factory=scripted(ckpt), allowed_origins='["*"]') as live:
        origin = {"Origin": "https://app.example"}
        status, got, _ = await live.post(chat, BODY, headers=origin)
        assert status == 200 and got["Access-Control-Allow-Origin"] == "*"


async def test_a_refused_preflight_is_a_400_not_the_routes_401_or_405(ckpt):
    """Under --api-key, a preflight from an origin, or for a method or header, the policy
    refuses got the route's 401 (``Missing API key``: no browser sends one with a preflight)
    or, without a key, its 405: an operator reading either looked for the wrong fault.
    vLLM's (Starlette's) answer: 400 naming what is refused, before auth."""
    policy = {
        "allowed_origins": '["https://app.example"]',
        "allowed_methods": '["GET", "POST"]',
        "allowed_headers": "Authorization",
    }
    async with running(ckpt, client_factory=scripted(ckpt), api_key=KEY, **policy) as live:
        status, got, _ = await _options(live, CHAT, PREFLIGHT)
        assert status == 204 and got["Access-Control-Allow-Origin"] == "https://app.example"
        assert got["Access-Control-Allow-Methods"] == "POST"
        assert got["Access-Control-Allow-Headers"] == (
            "accept, accept-language, authorization, content-language, content-type"
        )
        cases = [
            ({"Origin": "https://evil.example"}, "Disallowed CORS origin"),
            ({"Access-Control-Request-Method": "DELETE"}, "Disallowed CORS method"),
            ({"Access-Control-Request-Headers": "x-custom"}, "Disallowed CORS headers"),
            (
                {"Origin": "https://evil.example", "Access-Control-Request-Method": "PUT"},
                "Disallowed CORS origin, method",
            ),
        ]
        for change, message in cases:
            for path in (CHAT, "/health", "/no-such-route"):
                status, got, raw = await _options(live, path, {**PREFLIGHT, **change})
                assert status == 400, (change, path)
                assert orjson.loads(raw)["error"]["message"] == message
                refused_origin = "origin" in message  # (else the page may read the 400)
                assert ("Access-Control-Allow-Origin" in got) != refused_origin
        # (an OPTIONS that is no preflight is its route's business: a 401 without the key)
        status, _, _ = await _options(live, CHAT, {"Origin": "https://app.example"})
        assert status == 401


async def test_allow_credentials_names_the_origin(ckpt):
    """--allow-credentials: every answer to an allowed origin says so, and names the origin
    rather than ``*`` (which browsers refuse with credentials), with ``Vary: Origin``."""
    async with running(ckpt, client_factory=scripted(ckpt), allow_credentials=True) as live:
        status, got, _ = await _options(live, CHAT, PREFLIGHT)
        assert status == 204
        assert got["Access-Control-Allow-Origin"] == "https://app.example"
        assert got["Access-Control-Allow-Credentials"] == "true"
        status, got, _ = await live.post(CHAT, BODY, headers={"Origin": "https://app.example"})
        assert status == 200 and got["Access-Control-Allow-Origin"] == "https://app.example"
        assert got["Access-Control-Allow-Credentials"] == "true" and got["Vary"] == "Origin"
    async with running(ckpt, client_factory=scripted(ckpt)) as live:
        status, got, _ = await live.post(CHAT, BODY, headers={"Origin": "https://app.example"})
        assert got["Access-Control-Allow-Origin"] == "*"
        assert "Access-Control-Allow-Credentials" not in got


def test_cors_lists_are_checked_when_the_config_is_built():
    config = ServerConfig(allowed_methods="GET, POST", allowed_headers='["X-Trace", "*"]')
    assert config.cors.methods == {"GET", "POST"} and config.cors.headers == {"x-trace", "*"}
    for name in ("allowed_methods", "allowed_headers"):
        with pytest.raises(ValueError, match=rf"^{name}=.*: not a JSON list of strings"):
            ServerConfig(**{name: '["GET"'})
        with pytest.raises(ValueError, match=rf"^{name}=3: must be a string"):
            ServerConfig(**{name: 3})
    with pytest.raises(ValueError, match="allow_credentials='yes': must be a bool"):
        ServerConfig(allow_credentials="yes")
