"""Where and how the server listens: a TCP address or a Unix domain socket (vLLM's ``--uds``),
with TLS and vLLM's client-certificate flags. ``check_listener`` judges the settings when the
config is built, ``check_listener_files`` the files they name before the model loads, and
``open_site`` listens."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import ssl
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from rltserve.caller_values import is_int
from rltserve.preflight import check_tls_files

if TYPE_CHECKING:
    from aiohttp import web

    from rltserve.http.config import ServerConfig

# vLLM's --ssl-cert-reqs values, the ssl module's: CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED.
CERT_REQS = {0: "none", 1: "optional", 2: "required"}
# A socket path's bytes at most: sockaddr_un.sun_path holds 108 with the terminating NUL.
UDS_MAX_BYTES = 107
# As uvicorn (vLLM's server) leaves the socket: any local user may connect, as any may reach
# a loopback port; the API key guards it the same way.
UDS_MODE = 0o666
API_SERVERS = (
    "rltserve serves the API from one process (the engine runs in its own worker process, so "
    "the API process only parses, tokenizes and streams); drop the flag or give 1, and run more "
    "servers behind a load balancer, or --replicas N, for more"
)


def check_listener(config: ServerConfig) -> None:
    """ValueError naming the field of a listening setting that cannot work."""
    if not is_int(config.port) or not 0 <= config.port <= 65535:
        raise ValueError(f"port={config.port!r}: must be an int in [0, 65535]")
    uds = config.uds
    if uds is not None:
        if not isinstance(uds, str) or not uds:
            raise ValueError(f"uds={uds!r}: must be a socket's path")
        if len(os.fsencode(uds)) > UDS_MAX_BYTES:
            raise ValueError(
                f"uds={uds!r}: longer than a Unix socket's path may be ({UDS_MAX_BYTES} bytes); "
                "use a shorter one"
            )
    if (config.ssl_certfile is None) != (config.ssl_keyfile is None):
        raise ValueError("ssl_certfile, ssl_keyfile: give both or neither")
    reqs = config.ssl_cert_reqs
    if not is_int(reqs) or reqs not in CERT_REQS:
        choices = ", ".join(f"{k} ({v})" for k, v in CERT_REQS.items())
        raise ValueError(f"ssl_cert_reqs={reqs!r}: must be one of {choices}")
    for name in ("ssl_ca_certs", "ssl_cert_reqs"):
        if getattr(config, name) and config.ssl_certfile is None:
            raise ValueError(f"{name}={getattr(config, name)!r}: only with TLS (ssl_certfile)")
    if reqs and config.ssl_ca_certs is None:
        # (without it the system's store would vouch for clients: any public CA's certificate)
        raise ValueError(
            f"ssl_cert_reqs={reqs}: needs ssl_ca_certs, the CA certificates (PEM) that client "
            "certificates are verified against"
        )
    count = config.api_server_count
    if not is_int(count) or count != 1:
        raise ValueError(f"api_server_count={count!r}: {API_SERVERS}")


def check_listener_files(config: ServerConfig) -> None:
    """Before the model loads: the TLS files exist and load, and the socket's folder takes
    it (ValueError naming the flag); a stale socket left by an earlier server is replaced, a
    live one is another server's (OSError, as a port in use)."""
    check_tls_files(config.ssl_certfile, config.ssl_keyfile)
    if config.ssl_ca_certs is not None:
        if not Path(config.ssl_ca_certs).is_file():
            raise ValueError(f"--ssl-ca-certs {config.ssl_ca_certs}: no such file")
        try:
            ssl_context(config)
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(
                f"--ssl-ca-certs {config.ssl_ca_certs}: cannot load it ({exc})"
            ) from exc
    if config.uds is not None:
        path = Path(config.uds)
        if path.exists() and not stat.S_ISSOCK(path.stat().st_mode):
            raise ValueError(f"--uds {path}: exists and is not a socket")
        folder = path.parent
        if not folder.is_dir():
            raise ValueError(f"--uds {path}: no such folder {str(folder)!r}")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise ValueError(f"--uds {path}: folder {str(folder)!r} is not writable")
        check_socket_free(config.uds)


def check_socket_free(path: str) -> None:
    """OSError (EADDRINUSE) if a server answers on the Unix socket at ``path``. Binding would
    unlink any socket file there (asyncio's create_unix_server does), so without this a second
    server would take a live server's path, and the first serve nobody."""
    if not os.path.exists(path) or not stat.S_ISSOCK(os.stat(path).st_mode):
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return  # (no one listens: a socket a killed server left, stale)
        except (TimeoutError, BlockingIOError):
            # (a server whose backlog is full: live; Linux refuses such a connection at once
            # with EAGAIN rather than let it wait out the timeout)
            pass
        except OSError:
            return  # (not ours to judge, as a folder we may not search: binding says)
    message = f"cannot listen on {path}: another server is listening on it"
    raise OSError(errno.EADDRINUSE, message)


def ssl_context(config: ServerConfig) -> ssl.SSLContext | None:
    """The server's TLS context (None without TLS). With ``ssl_ca_certs`` only those CAs vouch
    for client certificates (not the system's store), as uvicorn's context under vLLM."""
    if not config.uses_tls:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=config.ssl_ca_certs)
    context.load_cert_chain(config.ssl_certfile, config.ssl_keyfile)
    context.verify_mode = ssl.VerifyMode(config.ssl_cert_reqs)
    return context


async def open_site(runner: web.AppRunner, config: ServerConfig) -> str:
    """Listens on ``config``'s socket; returns its URL: ``scheme://host:port`` (the bound port)
    or, on a Unix socket, ``unix:PATH`` (as curl's --unix-socket names it)."""
    from aiohttp import web

    context = ssl_context(config)
    if config.uds is not None:
        check_socket_free(config.uds)
        site: web.BaseSite = web.UnixSite(runner, config.uds, ssl_context=context)
        await site.start()
        os.chmod(config.uds, UDS_MODE)
        return f"unix:{config.uds}"
    await web.TCPSite(runner, config.host, config.port, ssl_context=context).start()
    host, port = runner.addresses[0][:2]
    host = f"[{host}]" if ":" in host else host
    return f"{'https' if config.uses_tls else 'http'}://{host}:{port}"


def socket_file(config: ServerConfig) -> tuple[int, int] | None:
    """The bound Unix socket file's (device, inode): by it ``remove_socket`` knows the file at
    the path is still this server's. None on a TCP port."""
    if config.uds is None:
        return None
    found = os.stat(config.uds)
    return found.st_dev, found.st_ino


def remove_socket(config: ServerConfig, bound: tuple[int, int] | None) -> None:
    """Removes the Unix socket the server listened on (Python before 3.13 leaves it), unless
    the file at its path is no longer the one it bound (``socket_file``): a server started
    since then listens there."""
    if config.uds is None or bound is None:
        return
    with contextlib.suppress(FileNotFoundError):
        found = os.stat(config.uds)
        if (found.st_dev, found.st_ino) == bound:
            os.unlink(config.uds)
