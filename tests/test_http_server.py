"""The server with its default, spawned stage process (the production path), TLS, and the small
endpoints (/v1/models with one or several served names, /version, /ping, /load, request-id
passthrough)."""

from __future__ import annotations

import shutil
import ssl
import stat
import subprocess

import aiohttp
import orjson
import pytest
from test_http_harness import (
    Script,
    ScriptedStage,
    running,
    scripted_factory,
    scripted_info,
    sse_payloads,
    tiny_checkpoint,
    wait_for,
)

from rltserve import __version__
from rltserve.core.stage import StageClient


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


async def test_spawned_stage_serves_and_dies_cleanly(ckpt):
    async with running(ckpt, client_factory=StageClient, stage_restarts=0) as live:
        client = live.state.client
        body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
        status, _, raw = await live.post("/v1/completions", body)
        assert status == 200
        assert orjson.loads(raw)["usage"]["completion_tokens"] == 4
        stream = {**body, "max_tokens": 1500, "ignore_eos": True, "stream": True}
        async with live.stream("/v1/completions", stream) as r:
            first = await r.content.readuntil(b"\n\n")
            client.kill()  # the stage process crashes mid-stream
            rest = await r.content.read()
        assert first.startswith(b"data: {")
        assert b'"code":503' in rest and rest.endswith(b"data: [DONE]\n\n")
        await wait_for(lambda: not client.alive)
        assert (await live.get("/health"))[0] == 503
        status, _, raw = await live.post("/v1/completions", body)
        assert status == 503


async def test_models_version_and_request_id(ckpt):
    stage = ScriptedStage(scripted_info(ckpt), Script([44]))
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        _, _, raw = await live.get("/v1/models")
        assert orjson.loads(raw) == {
            "object": "list",
            "data": [
                {
                    "id": "tiny",
                    "object": "model",
                    "created": 1730000000,
                    "owned_by": "rltserve",
                    "root": "tiny",
                    "parent": None,
                    "max_model_len": 64,
                    "permission": [
                        {  # (vLLM's ModelPermission, its defaults)
                            "id": "modelperm-test",
                            "object": "model_permission",
                            "created": 1730000000,
                            "allow_create_engine": False,
                            "allow_sampling": True,
                            "allow_logprobs": True,
                            "allow_search_indices": False,
                            "allow_view": True,
                            "allow_fine_tuning": False,
                            "organization": "*",
                            "group": None,
                            "is_blocking": False,
                        }
                    ],
                    "vocab_size": 512,
                    "weight_version": "0",
                }
            ],
        }
        assert list(orjson.loads(raw)["data"][0])[:8] == [  # (vLLM ModelCard's order)
            "id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission",
        ]  # fmt: skip
        card = orjson.loads(raw)["data"][0]
        # the SDK's models.retrieve; an id with a slash reaches the handler (repo ids have one)
        status, _, raw = await live.get("/v1/models/tiny")
        assert status == 200 and orjson.loads(raw) == card
        for missing in ("other", "org/tiny"):
            status, _, raw = await live.get(f"/v1/models/{missing}")
            assert status == 404 and orjson.loads(raw)["error"] == {
                "message": f"The model `{missing}` does not exist.",
                "type": "not_found_error",
                "param": "model",
                "code": 404,
            }
        assert orjson.loads((await live.get("/version"))[2]) == {"version": __version__}
        chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
        for stream in (False, True):
            completion = {"prompt": [5], "max_tokens": 1, "stream": stream}
            for path, body, prefix in (
                ("/v1/completions", completion, "cmpl"),
                ("/v1/chat/completions", {**chat, "stream": stream}, "chatcmpl"),
            ):
                _, headers, raw = await live.post(path, body, headers={"X-Request-Id": "abc-1"})
                assert headers["X-Request-Id"] == "abc-1"
                # the response's id is named after it, as vLLM names it
                first = sse_payloads(raw)[0] if stream else orjson.loads(raw)
                assert first["id"] == f"{prefix}-abc-1", path
        _, headers, _ = await live.post(
            "/v1/completions", {"prompt": []}, headers={"X-Request-Id": "e"}
        )
        assert headers["X-Request-Id"] == "e"  # on errors too


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl binary")
async def test_tls(ckpt, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    stage = ScriptedStage(scripted_info(ckpt), Script([44]))
    tls = {"ssl_certfile": str(cert), "ssl_keyfile": str(key)}
    async with running(ckpt, client_factory=scripted_factory(stage), **tls) as live:
        assert live.url.startswith("https://")
        context = ssl.create_default_context(cafile=str(cert))
        context.check_hostname = False
        assert (await live.get("/health", ssl=context))[0] == 200


async def test_a_unix_socket_serves_requests(ckpt, tmp_path):
    """vLLM's --uds: the server listens on the socket (open to local users, 0666, as uvicorn
    leaves it), not on a port, and removes it when it stops."""
    path = tmp_path / "api.sock"
    stage = ScriptedStage(scripted_info(ckpt), Script([44]))
    async with running(ckpt, client_factory=scripted_factory(stage), uds=str(path)) as live:
        assert live.url == f"unix:{path}"
        assert stat.S_ISSOCK(path.stat().st_mode) and stat.S_IMODE(path.stat().st_mode) == 0o666
        connector = aiohttp.UnixConnector(path=str(path))
        async with aiohttp.ClientSession(connector=connector) as session:
            body = {"prompt": [5], "max_tokens": 1}
            async with session.post("http://localhost/v1/completions", json=body) as r:
                assert r.status == 200
                assert (await r.json())["usage"]["completion_tokens"] == 1
            async with session.get("http://localhost/health") as r:
                assert r.status == 200
    assert not path.exists()


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _certificate(folder, name: str, ca: str | None = None) -> tuple[str, str]:
    """A key and certificate for ``name`` (CN), signed by CA ``ca`` (a name made before) or
    by itself."""
    cert, key = str(folder / f"{name}.pem"), str(folder / f"{name}.key")
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    if ca is None:
        _openssl("req", "-x509", *ec, "-days", "1", "-subj", f"/CN={name}", "-keyout", key,
                 "-out", cert)  # fmt: skip
        return cert, key
    request = str(folder / f"{name}.csr")
    _openssl("req", *ec, "-subj", f"/CN={name}", "-keyout", key, "-out", request)
    _openssl("x509", "-req", "-in", request, "-CA", str(folder / f"{ca}.pem"), "-CAkey",
             str(folder / f"{ca}.key"), "-CAcreateserial", "-days", "1", "-out", cert)  # fmt: skip
    return cert, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl binary")
async def test_client_certificates_are_verified_against_the_given_cas(ckpt, tmp_path):
    """vLLM's --ssl-ca-certs and --ssl-cert-reqs 2: a client must show a certificate the given
    CA signed; none, or one only the client vouches for, ends the connection."""
    server_cert, server_key = _certificate(tmp_path, "127.0.0.1")
    ca, _ = _certificate(tmp_path, "ca")
    good = _certificate(tmp_path, "client", ca="ca")
    rogue = _certificate(tmp_path, "rogue")
    stage = ScriptedStage(scripted_info(ckpt), Script([44]))
    tls = {"ssl_certfile": server_cert, "ssl_keyfile": server_key, "ssl_ca_certs": ca,
           "ssl_cert_reqs": 2}  # fmt: skip
    async with running(ckpt, client_factory=scripted_factory(stage), **tls) as live:

        def context(client: tuple[str, str] | None) -> ssl.SSLContext:
            made = ssl.create_default_context(cafile=server_cert)
            made.check_hostname = False
            if client is not None:
                made.load_cert_chain(*client)
            return made

        assert (await live.get("/health", ssl=context(good)))[0] == 200
        for client in (None, rogue):
            with pytest.raises(aiohttp.ClientError):
                await live.get("/health", ssl=context(client))


async def test_several_served_model_names(ckpt):
    """vLLM's --served-model-name a b: requests may name either, /v1/models lists both, and
    the first names the model in /metrics and in responses to requests that name none."""
    stage = ScriptedStage(scripted_info(ckpt), Script([44]))
    names = {"served_model_name": ("first", "org/second")}
    async with running(ckpt, client_factory=scripted_factory(stage), **names) as live:
        _, _, raw = await live.get("/v1/models")
        cards = orjson.loads(raw)["data"]
        assert [(c["id"], c["root"]) for c in cards] == [
            ("first", "first"),
            ("org/second", "first"),
        ]
        status, _, raw = await live.get("/v1/models/org/second")
        assert status == 200 and orjson.loads(raw) == cards[1]
        for model, answered in ((None, "first"), ("first", "first"), ("org/second", "org/second")):
            body = {"prompt": [5], "max_tokens": 1, **({"model": model} if model else {})}
            status, _, raw = await live.post("/v1/completions", body)
            assert (status, orjson.loads(raw)["model"]) == (200, answered)
        status, _, _ = await live.post("/v1/completions", {"prompt": [5], "model": "tiny"})
        assert status == 404  # (the checkpoint directory's name is not served any more)
        metrics = (await live.get("/metrics"))[2].decode()
        assert 'model_name="first"' in metrics and "org/second" not in metrics


async def test_ping_is_health_for_sagemaker(ckpt):
    stage = ScriptedStage(scripted_info(ckpt), Script([44]))
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        for call in (live.get("/ping"), live.post("/ping", None)):
            status, _, raw = await call
            assert (status, orjson.loads(raw)) == (200, {"status": "ok"})  # /health's answer


@pytest.mark.parametrize("tracking", [False, True])
async def test_load_counts_generating_requests_in_flight_when_tracked(ckpt, tracking):
    """vLLM's GET /load: with enable_server_load_tracking the completion and chat requests in
    flight, a stream until its end, a refused one no more once answered; without it 0."""
    stage = ScriptedStage(scripted_info(ckpt), Script([44, 45, 46], interval_s=0.05))
    flags = {"enable_server_load_tracking": tracking}
    async with running(ckpt, client_factory=scripted_factory(stage), **flags) as live:

        async def server_load() -> dict:
            status, headers, raw = await live.get("/load")
            assert status == 200 and headers["Content-Type"] == "application/json"
            return orjson.loads(raw)

        assert await server_load() == {"server_load": 0}
        body = {"prompt": [5], "max_tokens": 3, "stream": True}
        chat = {**body, "messages": [{"role": "user", "content": "x"}]}
        del chat["prompt"]
        async with (
            live.stream("/v1/completions", body) as one,
            live.stream("/v1/chat/completions", chat) as two,
        ):
            await one.content.readuntil(b"\n\n")
            await two.content.readuntil(b"\n\n")
            assert await server_load() == {"server_load": 2 if tracking else 0}
            await one.read()
            await two.read()
        await wait_for(lambda: live.state.server_load == 0)  # (handlers end after the EOF)
        assert (await live.post("/v1/completions", {"prompt": [5], "n": 0}))[0] == 400
        assert await server_load() == {"server_load": 0}
        assert live.state.server_load == 0
