"""The connections ``AsyncClient`` owns: one aiohttp session per event loop, closed when the
client is, when the loop that ``asyncio.run()`` runs ends, or quietly when the client is
collected without either."""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import AsyncGenerator

import aiohttp


def open_session(
    owner: object, max_connections: int
) -> tuple[aiohttp.ClientSession, weakref.finalize, AsyncGenerator[None] | None]:
    """A session on the running loop (``max_connections`` pooled at most, 0: no limit), the
    finaliser that closes it without awaiting when ``owner`` is collected (call it to do so
    now), and the async generator that closes it as the loop ends (None on a loop that tracks
    no async generators); ``aclose()`` that one once the session is closed. Keep all three
    with the session."""
    connector = aiohttp.TCPConnector(limit=max_connections)
    session = aiohttp.ClientSession(connector=connector)  # (timeouts: per request)
    # Never closed: let go of quietly when the owner is collected, as the OpenAI SDK's client
    # is. Not in __del__: in a reference cycle (a traceback's frames hold the owner), the
    # connector's __del__ ("Unclosed connector") may run first; weakref callbacks run before
    # any __del__ of the same garbage.
    let_go = weakref.finalize(owner, let_go_of, connector)
    if sys.get_asyncgen_hooks().firstiter is None:  # (collected unfinished, it would complain)
        return session, let_go, None
    closer = _closes_with_its_loop(session)
    # Run to its first yield here, without awaiting: the loop's first-iteration hook now
    # holds it among the async generators it shuts down before closing.
    with contextlib.suppress(StopIteration):
        closer.asend(None).send(None)
    return session, let_go, closer


async def _closes_with_its_loop(session: aiohttp.ClientSession) -> AsyncGenerator[None]:
    """Closes ``session`` as ``asyncio.run()`` shuts down its loop's async generators: the
    last moment its connections can close cleanly. Once the loop is closed, a socket still
    open is left to the collector ("unclosed transport"), and the server holds it until then."""
    try:
        yield
    finally:
        await session.close()


def let_go_of(connector: aiohttp.BaseConnector) -> None:
    """Closes a connector without awaiting (its loop may have ended or not be running): with
    ``_close``, what its own ``__del__`` calls (aiohttp has no public synchronous close), which
    closes the pooled connections (on a closed loop, marks them closed) and the session."""
    if not connector.closed:
        with contextlib.suppress(RuntimeError):  # (a callback on a closed loop: moot)
            connector._close()
