"""Where the server listens (``rltserve.http.listener``): a Unix socket (vLLM's ``--uds``) is
this server's alone while it runs: a second server started on a live socket's path is refused
as on a port in use, a stale socket a killed server left is replaced, and a server removes the
socket on exit only while the file is still the one it bound."""

from __future__ import annotations

import errno
import os
import socket

import aiohttp
import pytest
from aiohttp import web

from rltserve.http.config import ServerConfig
from rltserve.http.listener import UDS_MAX_BYTES, check_listener_files, check_socket_free
from rltserve.http.server import serving


def _app(name: str) -> web.Application:
    app = web.Application()

    async def who(request: web.Request) -> web.Response:
        return web.Response(text=name)

    app.router.add_get("/who", who)
    return app


async def _who(path: str) -> str:
    connector = aiohttp.UnixConnector(path=path)
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        session.get("http://localhost/who") as r,
    ):
        return await r.text()


@pytest.fixture
def sock_path(tmp_path) -> str:
    return str(tmp_path / "api.sock")  # (tmp_path is short enough for a socket's path)


async def test_a_live_socket_is_not_taken_by_a_second_server(sock_path):
    config = ServerConfig(uds=sock_path)
    async with serving(_app("first"), config):
        with pytest.raises(OSError, match="another server is listening on it") as caught:
            check_listener_files(config)  # (the CLI's check, before the model loads)
        assert caught.value.errno == errno.EADDRINUSE
        with pytest.raises(OSError, match=f"cannot listen on {sock_path}: another server"):
            async with serving(_app("second"), config):
                pass
        assert await _who(sock_path) == "first"
    assert not os.path.exists(sock_path)


async def test_a_stale_socket_a_killed_server_left_is_replaced(sock_path):
    """SIGKILL leaves the socket file with no one listening: the restarted server takes it."""
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(sock_path)
    stale.close()  # (the file stays: no one listens on it)
    config = ServerConfig(uds=sock_path)
    check_listener_files(config)
    async with serving(_app("restarted"), config):
        assert await _who(sock_path) == "restarted"
    assert not os.path.exists(sock_path)


async def test_a_server_leaves_a_later_servers_socket_in_place(sock_path):
    """An operator removed the first server's socket and started another on the path: the
    first's exit must not remove the second's socket."""
    config = ServerConfig(uds=sock_path)
    async with serving(_app("first"), config) as first:
        os.unlink(sock_path)
        async with serving(_app("second"), config):
            await first.close()
            assert await _who(sock_path) == "second"
    assert not os.path.exists(sock_path)


async def test_any_local_user_may_connect_to_the_socket(sock_path):
    """As uvicorn leaves it (the API key guards it, as a loopback port), whatever the umask."""
    old = os.umask(0o077)
    try:
        async with serving(_app("open"), ServerConfig(uds=sock_path)):
            assert os.stat(sock_path).st_mode & 0o777 == 0o666
    finally:
        os.umask(old)


def test_a_socket_path_may_have_as_many_bytes_as_a_socket_takes():
    ServerConfig(uds="/" + "s" * (UDS_MAX_BYTES - 1))
    with pytest.raises(ValueError, match="longer than a Unix socket's path may be"):
        ServerConfig(uds="/" + "s" * UDS_MAX_BYTES)


def test_a_server_too_busy_to_accept_is_live(sock_path):
    """A connection that times out (the server's backlog full) is a live server's, not a stale
    socket to replace."""
    busy = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    busy.bind(sock_path)
    busy.listen(0)
    waiting = []
    try:
        while True:  # (until the backlog is full)
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            client.setblocking(False)
            waiting.append(client)
            try:
                client.connect(sock_path)
            except BlockingIOError:
                break
        with pytest.raises(OSError, match="another server is listening on it"):
            check_socket_free(sock_path)
    finally:
        for client in waiting:
            client.close()
        busy.close()


async def test_an_ipv6_address_is_bracketed_in_the_url():
    async with serving(_app("six"), ServerConfig(host="::1", port=0)) as server:
        assert server.url.startswith("http://[::1]:")
        port = int(server.url.rsplit(":", 1)[1])
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://[::1]:{port}/who") as r,
        ):
            assert await r.text() == "six"
