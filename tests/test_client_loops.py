"""AsyncClient's connections across event loops: a module-level client under one
``asyncio.run()`` after another closes each loop's connections as that loop ends, not when
the collector finds their sockets."""

from __future__ import annotations

import asyncio
import gc
import warnings

from test_client_retries import server_thread, texts_of_one

from rltserve.client import AsyncClient


def unclosed_sockets(caught: list[warnings.WarningMessage]) -> list[str]:
    """asyncio's "unclosed transport" and the socket module's "unclosed <socket ...>"."""
    said = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    return [s for s in said if s.startswith("unclosed")]


def test_each_asyncio_run_closes_the_connections_it_opened():
    with server_thread() as (url, received), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        client = AsyncClient(url)  # (module-level in a script or a notebook)
        for n in (1, 2):
            assert asyncio.run(client.complete("x")) == {"n": n}
            gc.collect()  # (a socket left open would be found here)
        assert asyncio.run(texts_of_one(client)) == ["a"]
        asyncio.run(client.close())  # (on a loop the connections were not made on)
        never_closed = AsyncClient(url)
        assert asyncio.run(never_closed.complete("y")) == {"n": 4}
        del never_closed
        gc.collect()
    assert unclosed_sockets(caught) == []
    assert received == ["x", "x", "s", "y"]


async def test_requests_run_side_by_side_up_to_max_connections():
    """``max_connections`` bounds the requests in flight at once (the pool's size)."""
    from aiohttp import web
    from test_client_sse import serve

    flight = {"now": 0, "most": 0}

    async def completions(request: web.Request) -> web.Response:
        flight["now"] += 1
        flight["most"] = max(flight["most"], flight["now"])
        await asyncio.sleep(0.1)
        flight["now"] -= 1
        return web.json_response({"n": 1})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    for limit, most in ((1, 1), (3, 3)):
        flight["most"] = 0
        async with serve(app) as url, AsyncClient(url, max_connections=limit) as client:
            await asyncio.gather(*(client.complete("x") for _ in range(3)))
        assert flight["most"] == most, limit
