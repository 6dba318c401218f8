"""Time-to-first-token of a long prompt: wavefront chunked prefill vs plain chunked prefill
(``rltserve bench offline --wavefront-prefill --compare``).

A prompt of ``num_chunks`` chunks is measured at several chunk sizes, alone and under decode
load (other requests generating while it prefills). Plain chunked prefill needs C * D steps
before the first token, the wavefront C + D - 1, so the gain is largest where a step's cost is
mostly fixed overhead (small chunks).
"""

from __future__ import annotations

import random
import time
from typing import Any

from rltserve.config import EngineConfig
from rltserve.core.engine import EngineCore
from rltserve.models.base import LoopedModel
from rltserve.sampling import SamplingParams


def measure_ttft(
    model: LoopedModel,
    engine_kw: dict,
    prompt: list[int],
    background: list[list[int]],
    warm_steps: int,
) -> dict[str, float]:
    """Seconds and steps from adding ``prompt`` to its first token. Background requests start
    ``warm_steps`` steps earlier so that they are decoding when the prompt arrives."""
    core = EngineCore(EngineConfig.from_flat(**engine_kw), model=model)
    load = SamplingParams(
        temperature=0.0, max_tokens=256, ignore_eos=True
    )  # outlasts the probe's prefill
    for i, p in enumerate(background):
        core.add_request(f"bg{i}", p, load)
    for _ in range(warm_steps if background else 0):
        core.step()
    core.add_request(
        "probe", prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    )
    start = time.perf_counter()
    steps = 0
    while True:
        steps += 1
        if any(u.request_id == "probe" and u.new_token_ids for u in core.step()):
            break
    elapsed = time.perf_counter() - start
    for rid in list(core.scheduler.requests):
        core.abort(rid)
    core.shutdown()
    return {"ttft_s": round(elapsed, 4), "steps": steps}


def run_wcpb_compare(
    model: LoopedModel,
    engine_kw: dict,
    chunk_sizes: list[int],
    num_chunks: int = 16,
    decode_load: int = 8,
    seed: int = 0,
) -> dict[str, Any]:
    rng = random.Random(seed)
    vocab = model.spec.vocab_size
    out: dict[str, Any] = {"num_chunks": num_chunks, "decode_load": decode_load}
    for chunk in chunk_sizes:
        prompt = [rng.randrange(vocab) for _ in range(chunk * num_chunks)]
        background = [[rng.randrange(vocab) for _ in range(8)] for _ in range(decode_load)]
        budget = max(engine_kw["max_num_batched_tokens"], chunk * 4 + decode_load)
        row: dict[str, Any] = {}
        for label, bg in (("alone", []), ("under_decode_load", background)):
            cell = {}
            for wave in (False, True):
                kw = {
                    **engine_kw,
                    "prefill_chunk_size": chunk,
                    "max_num_batched_tokens": budget,
                    "max_num_seqs": max(engine_kw["max_num_seqs"], decode_load + 1),
                    "wavefront_prefill": wave,
                }
                cell["wavefront" if wave else "chunked"] = measure_ttft(model, kw, prompt, bg, 8)
            cell["ttft_ratio"] = round(cell["chunked"]["ttft_s"] / cell["wavefront"]["ttft_s"], 3)
            row[label] = cell
        out[str(chunk)] = row
    return out
