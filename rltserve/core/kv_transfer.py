"""A prompt's KV moved from a prefill stage to a decode stage on one host (DESIGN §8, PD).

The prefill stage computes the prompt and, as its request finishes, writes the KV of the
prompt's cached full blocks (every plane, the boundary plane too) to a file the client named:
a safetensors file, in shared memory where the host has it, whose metadata holds the blocks'
chained hashes. The decode stage keeps the file while the request waits and reads it when it
admits the request, once its pool has room for the prompt (DESIGN §8's admission contract:
blocks cached as the request is added would be evicted while a burst waits): into fresh blocks
of its own pool, cached under those hashes, which admission at once finds as any prefix-cache
hit; it computes only the rest of the prompt (at least its last token, as every hit does).

Exactness does not depend on the transfer: the hashes cover everything the KV depends on (the
cache salt: model, weights version, dtype, device type, loops, Huginn's initial state,
the client's ``cache_salt``), so a file written under other conditions matches none of the
request's hashes and is ignored, and blocks the decode pool cannot take are computed there
instead. Output equals a single stage's.

File layout: tensor ``kv`` = ``pool.index_select(2, slots)`` of the entries' blocks, entry by
entry, each entry's blocks in ``KVManager.planes_of`` order, each block's slots in order:
[L, 2, entries * planes * block_size, Hkv, hd].
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from rltserve.core.kv_cache import KVManager
from rltserve.core.prompt_sharing import reusable_blocks
from rltserve.core.request import Request
from rltserve.core.runner import ModelRunner

log = logging.getLogger(__name__)
Slots = Callable[[list[int]], torch.Tensor]  # blocks -> their slots on the device (``with_kv``)


def cacheable_prefix(kv: KVManager, request: Request) -> list[bytes]:
    """The hashes of the request's prompt blocks that a prefix hit may cover: the full blocks
    before its last prompt token (none when it does not reuse prompt KV)."""
    if request.block_hashes is None or not request.reuses_prompt:
        return []
    return request.block_hashes[: reusable_blocks(request, kv.block_size)]


def export_prompt(kv: KVManager, runner: ModelRunner, request: Request, path: str) -> int:
    """Writes the KV of the request's cached prompt blocks (the longest cached prefix) to
    ``path``; returns the blocks written per plane (0: no file is written, as when the file
    system refuses it: a full or missing transfer directory costs the decode stage the prompt's
    computation and one log line, not a traceback per request)."""
    prefix = cacheable_prefix(kv, request)
    entries = kv.cache.lookup(prefix, len(prefix))
    if not entries:
        return 0
    blocks = [b for entry in entries for b in entry.blocks]
    metadata = {
        "hashes": ",".join(entry.key.hex() for entry in entries),
        # (What the decode stage reports as reused: ``Request.prefill_cached_tokens``.)
        "cached_tokens": str(request.num_cached_tokens or 0),
    }

    written = [0]

    def write(pool: torch.Tensor, slots: Slots) -> None:  # pool: [L, 2, num_slots, Hkv, hd]
        data = pool.index_select(2, slots(blocks))
        try:
            save_file({"kv": data.cpu().contiguous()}, path, metadata=metadata)
        except (OSError, SafetensorError) as exc:  # (safetensors reports I/O errors as its own)
            log.warning("prompt KV of request %s not exported: %s", request.request_id, exc)
            with contextlib.suppress(OSError):
                os.remove(path)
            return
        written[0] = len(entries)

    runner.with_kv(write)
    return written[0]


def import_prompt(kv: KVManager, runner: ModelRunner, request: Request, path: str) -> int:
    """Reads a file ``export_prompt`` wrote for the request's prompt into the decode pool's
    prefix cache and deletes it; returns the request's leading prompt blocks (per plane)
    cached now, moved or found here (0 when the file matched nothing), and sets the request's
    ``prefill_cached_tokens``: admission counts blocks hit here as reused only where the prefill
    stage reused them. A missing, unreadable or non-matching file imports nothing (the prompt
    is computed here instead)."""
    try:
        with safe_open(path, "pt") as f:
            metadata = f.metadata() or {}
            hashes = [bytes.fromhex(h) for h in metadata.get("hashes", "").split(",") if h]
            cached = int(metadata.get("cached_tokens", 0))
            data = f.get_tensor("kv")
    except FileNotFoundError:
        return 0
    except Exception as exc:  # a torn or foreign file: the prompt is computed instead
        log.warning("prompt KV for request %s not imported: %s", request.request_id, exc)
        return 0
    finally:
        with contextlib.suppress(OSError):
            os.remove(path)
    request.transfer_tokens = len(hashes) * kv.block_size  # (moved, whether used or not)
    wanted = cacheable_prefix(kv, request)
    n = 0
    while n < min(len(hashes), len(wanted)) and hashes[n] == wanted[n]:
        n += 1
    planes = len(kv.planes_of(request.num_loops))
    pool_shape = runner.kv.shape
    expected = (*pool_shape[:2], len(hashes) * planes * kv.block_size, *pool_shape[3:])
    if n == 0 or tuple(data.shape) != expected or data.dtype != runner.kv.dtype:
        return 0
    held = kv.cache.lookup(wanted, n)  # already cached here: only the rest is read
    start = len(held) * planes * kv.block_size

    def write(blocks: list[int]) -> None:
        end = start + len(blocks) * kv.block_size

        def read(pool: torch.Tensor, slots: Slots) -> None:
            pool.index_copy_(2, slots(blocks), data[:, :, start:end].to(pool.device))

        runner.with_kv(read)

    # The prompt's KV was computed on the prefill stage: its reuse is what that stage reused.
    request.prefill_cached_tokens = cached
    return len(held) + kv.adopt_cached(wanted[len(held) : n], request.num_loops, held, write)


def admit_import(kv: KVManager, runner: ModelRunner, request: Request, path: str) -> None:
    """``import_prompt`` as admission takes the request (``Admission.importer``); a failure
    (nothing cached) costs the prompt's computation here and a log entry."""
    try:
        import_prompt(kv, runner, request, path)
    except Exception:
        log.exception("importing the prompt KV of %s failed", request.request_id)
