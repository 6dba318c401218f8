"""``rltserve serve --replicas 1`` without an address starts a local Ray cluster, serves through
it, and on SIGTERM exits 0 leaving none of its processes (Ray's daemons, the replica) behind:
SIGTERM to the server alone, and to its whole process group (as systemd stops a service: Ray's
daemons stop at the same moment, and a Serve call would then wait for them until Ray aborts the
process). Skipped without Ray."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from test_http_harness import tiny_checkpoint

pytest.importorskip("ray.serve")
ROOT = Path(__file__).resolve().parents[1]


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("group", [False, True], ids=["server", "process-group"])
async def test_serve_with_replicas_stops_its_local_cluster(tmp_path_factory, group):
    ckpt = tiny_checkpoint(tmp_path_factory)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "rltserve.cli", "serve", "--model", str(ckpt), "--port", str(port)]
    cmd += ["--replicas", "1", "--log-level", "warning", "--num-blocks", "256"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    process = subprocess.Popen(
        cmd, env=env, stderr=subprocess.PIPE, text=True, start_new_session=group
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + 240
            while True:
                # (An early exit says why: its error output.)
                assert process.poll() is None, f"serve exited: {process.stderr.read()}"
                assert time.monotonic() < deadline
                try:
                    async with session.get(url + "/health") as r:
                        if r.status == 200:
                            assert (await r.json())["replicas"] == {"live": 1, "configured": 1}
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.5)
            body = {"prompt": [5, 6, 7], "max_tokens": 4}
            async with session.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200
        ours = descendants(process.pid)
        assert ours  # Ray's daemons and the replica
        if group:
            os.killpg(process.pid, signal.SIGTERM)
        else:
            process.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(process.wait, 120)
        errors = process.stderr.read()
        assert code == 0, errors
        assert "Failed to connect to GCS" not in errors
        deadline = time.monotonic() + 30
        while any(alive(p) for p in ours):
            assert time.monotonic() < deadline, [p for p in ours if alive(p)]
            await asyncio.sleep(0.2)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
