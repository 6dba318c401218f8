"""Prefix caching and prompt sharing benchmarks (``rltserve bench offline --shared-prefix-len P``
and ``--n K``), on one loaded model in one process so that ratios come from one run.

- ``--shared-prefix-len P``: ``--num-prompts`` requests whose prompts are one P-token prefix
  plus a distinct ``--input-len``-token suffix, all added at once, caching off vs on: mean time
  to first token (from the moment they were added) and output tokens/s.
- ``--n K``: ``--num-prompts / K`` prompts of ``--input-len`` tokens, K seeded samples each
  (``seed + j``), as groups vs as independent requests, both with caching off so that only the
  group sharing differs: prompt tokens computed, TTFT and tokens/s.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from rltserve.config import EngineConfig
from rltserve.core.engine import EngineCore
from rltserve.models.base import LoopedModel
from rltserve.progress import progress_bar
from rltserve.sampling import SamplingParams


def shared_prefix_prompts(
    num: int, prefix_len: int, suffix_len: int, vocab: int, seed: int = 0
) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(vocab) for _ in range(suffix_len)] for _ in range(num)]


def run_timed(
    model: LoopedModel,
    engine_kw: dict,
    prompts: list[list[int]],
    params: list[SamplingParams],
    groups: list[str | None] | None = None,
    desc: str = "engine",
    show: bool = False,
) -> dict[str, Any]:
    """Adds every request at once and runs them to completion, timing first tokens."""
    core = EngineCore(EngineConfig.from_flat(**engine_kw), model=model)
    total = sum(p.max_tokens for p in params)
    first: dict[str, float] = {}
    tokens = 0
    with progress_bar(total, desc, show, unit="tok") as bar:
        start = time.perf_counter()
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            core.add_request(f"b{i}", prompt, p, groups[i] if groups else None)
        while core.has_work():
            for update in core.step():
                if update.new_token_ids and update.request_id not in first:
                    first[update.request_id] = time.perf_counter() - start
                tokens += len(update.new_token_ids)
                bar.update(len(update.new_token_ids))
        elapsed = time.perf_counter() - start
    stats = core.stats()
    core.shutdown()
    prompt_tokens = sum(len(p) for p in prompts)
    return {
        "output_tokens": tokens,
        "seconds": round(elapsed, 3),
        "output_tokens_per_s": round(tokens / elapsed, 2),
        "mean_ttft_s": round(sum(first.values()) / max(len(first), 1), 4),
        "prompt_tokens": prompt_tokens,
        "prompt_tokens_computed": prompt_tokens - stats.prefix_cache_hits,
        "prefix_cache_hit_rate": round(stats.prefix_cache_hits / max(prompt_tokens, 1), 4),
        "steps": stats.num_steps,
        "rows": stats.num_rows,
    }


def _ratios(before: dict, after: dict) -> dict[str, float]:
    return {
        "ttft_reduction": round(before["mean_ttft_s"] / max(after["mean_ttft_s"], 1e-9), 2),
        "throughput_gain": round(
            after["output_tokens_per_s"] / max(before["output_tokens_per_s"], 1e-9), 2
        ),
        "prompt_tokens_computed_ratio": round(
            after["prompt_tokens_computed"] / max(before["prompt_tokens_computed"], 1), 4
        ),
    }


def run_prefix_compare(model: LoopedModel, engine_kw: dict, args: argparse.Namespace) -> dict:
    show = getattr(args, "progress", False)
    vocab = model.spec.vocab_size
    out: dict[str, Any] = {}
    params = SamplingParams(
        temperature=0.0,
        max_tokens=args.output_len,
        ignore_eos=True,
        exit_threshold=args.exit_threshold,
    )
    prefix_len = getattr(args, "shared_prefix_len", 0)
    if prefix_len:
        prompts = shared_prefix_prompts(args.num_prompts, prefix_len, args.input_len, vocab)
        each = [params] * len(prompts)
        off = run_timed(
            model, {**engine_kw, "enable_prefix_caching": False}, prompts, each, None, "off", show
        )
        on = run_timed(
            model, {**engine_kw, "enable_prefix_caching": True}, prompts, each, None, "on", show
        )
        out["shared_prefix"] = {
            "prefix_len": prefix_len,
            "suffix_len": args.input_len,
            "caching_off": off,
            "caching_on": on,
            "ratios": _ratios(off, on),
        }
    n = getattr(args, "n", 1)
    if n > 1:
        distinct = max(1, args.num_prompts // n)
        rng = random.Random(1)
        base = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(distinct)]
        prompts = [p for p in base for _ in range(n)]
        sampled = params.replace(temperature=1.0)
        each = [sampled.replace(seed=100 * (i // n) + i % n) for i in range(len(prompts))]
        groups = [f"g{i // n}" for i in range(len(prompts))]
        kw = {**engine_kw, "enable_prefix_caching": False}
        alone = run_timed(model, kw, prompts, each, None, "independent", show)
        grouped = run_timed(model, kw, prompts, each, groups, f"n={n}", show)
        out["n_sharing"] = {
            "n": n,
            "prompts": distinct,
            "independent": alone,
            "grouped": grouped,
            "ratios": _ratios(alone, grouped),
        }
    return out
