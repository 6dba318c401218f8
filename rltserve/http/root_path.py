"""vLLM's ``--root-path``: the API served under the path prefix a path-based proxy passes
requests on with (an nginx ``location /llm/ { proxy_pass http://rltserve:8000; }``, an
ingress path without a rewrite).

A request whose path is under the prefix is served as the same request without it. The prefix
comes off as the request is made, before routing, so that every route, the API-key rules of
the probes, ``--disable-access-log-for-endpoints`` and the ``handler`` label of ``/metrics`` see
the path they would see without the proxy; the access line keeps the path as sent. A path
outside the prefix is served as it is, as Starlette routes vLLM's ``root_path``: probes and
scrapers that reach the pod directly go on working.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from aiohttp.http_parser import RawRequestMessage
from yarl import URL

# The prefix a request was served without (absent: it came without one), for its access line.
ROOT_PATH = web.RequestKey("rltserve.root_path", str)

RequestFactory = Callable[..., web.BaseRequest]


def normal_root_path(value: object) -> str | None:
    """``value`` as a prefix: a path of its own segments, no trailing slash ('/' and '' are no
    prefix); ValueError for anything else."""
    if not isinstance(value, str) or (value and not value.startswith("/")):
        raise ValueError(f"root_path={value!r}: must be a path starting with / (as '/llm')")
    if "?" in value or "#" in value or "//" in value:
        raise ValueError(f"root_path={value!r}: must be a plain path (as '/llm')")
    return value.rstrip("/") or None


def strip_root_path(message: RawRequestMessage, prefix: str) -> RawRequestMessage:
    """``message`` with ``prefix`` (the root path percent-encoded, as paths are compared as
    sent) off the front of its URL's path (the same message when its path is not under it). Its
    raw request target (``message.path``) stays as sent."""
    url = message.url
    path = url.raw_path
    if path != prefix and not path.startswith(prefix + "/"):
        return message
    rest = path[len(prefix) :] or "/"
    return message._replace(url=url.with_path(rest, encoded=True, keep_query=True))


def under_root_path(factory: RequestFactory, root: str) -> RequestFactory:
    """A request factory (``web.Server.request_factory``) that serves the requests under
    ``root`` without it, marking them with ``ROOT_PATH``."""

    prefix = URL.build(path=root).raw_path  # (once, not per request)

    def make_request(message, *args, **kwargs) -> web.BaseRequest:
        stripped = strip_root_path(message, prefix)
        request = factory(stripped, *args, **kwargs)
        if stripped is not message:
            request[ROOT_PATH] = root
        return request

    return make_request
