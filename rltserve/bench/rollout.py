"""RL rollout benchmark: training steps of (new weights, then rollouts), in place vs restart.

A step is what an RL trainer does between optimizer updates: hand the engine its new weights,
then sample ``n`` completions of each of ``num_prompts`` prompts. Two ways, in one run:

- ``in_place``: one ``LLM`` for the whole run; each step calls ``update_weights`` with the
  weights as ``(name, tensor)`` pairs (as a trainer's ``state_dict()`` gives them) and
  generates. Engine start-up is paid once and reported apart.
- ``restart``: what trainers do without in-place updates: each step saves the weights as a
  checkpoint directory, starts a new ``LLM`` on it, generates and closes it.

Both arms sample the same prompts with the same seeds (``seed`` = step) and ignore EOS, so they
produce the same number of tokens. The weights are the checkpoint's own each step (the
benchmark measures the update path, not a trainer). Reported per arm: mean and per-step wall
time, the update (or save + start-up) share, and rollout tokens/s over generation time; and
``step_speedup``, the restart arm's mean step time over the in-place arm's.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from rltserve.progress import progress_bar
from rltserve.sampling import SamplingParams

# The CLI imports this module for its parser; ``rltserve.llm`` is imported where it is used.


def _llm_kwargs(engine_kw: dict) -> dict:
    from rltserve.llm import LLM

    accepted = inspect.signature(LLM.__init__).parameters
    return {k: v for k, v in engine_kw.items() if k in accepted}


def _prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(length)]} for _ in range(num)]


def _params(args: argparse.Namespace, step: int) -> SamplingParams:
    return SamplingParams(
        n=args.n,
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        exit_threshold=args.exit_threshold,
        ignore_eos=True,
        seed=step,
    )


def _tokens(outputs) -> int:
    return sum(len(c.token_ids) for o in outputs for c in o.outputs)


def _summary(steps: list[dict[str, float]], extra: dict) -> dict[str, Any]:
    walls = [s["wall_s"] for s in steps]
    gen = sum(s["generate_s"] for s in steps)
    tokens = sum(s["tokens"] for s in steps)
    return {
        "mean_step_s": round(sum(walls) / len(walls), 4),
        "steps_s": [round(w, 4) for w in walls],
        "mean_weights_s": round(sum(s["weights_s"] for s in steps) / len(steps), 4),
        "rollout_tokens_per_s": round(tokens / gen, 2) if gen else 0.0,
        "tokens_per_step": int(tokens / len(steps)),
        **extra,
    }


def _in_place(args, llm_kw: dict, tensors: dict, prompts: list[dict]) -> dict[str, Any]:
    from rltserve.llm import LLM

    start = time.perf_counter()
    llm = LLM(**llm_kw)
    startup = time.perf_counter() - start
    steps = []
    bar = progress_bar(args.steps, "in place", getattr(args, "progress", False), unit="step")
    try:
        for step in range(args.steps):
            t0 = time.perf_counter()
            llm.update_weights(tensors.items())
            t1 = time.perf_counter()
            outputs = llm.generate(prompts, _params(args, step), use_tqdm=False)
            t2 = time.perf_counter()
            steps.append(
                {
                    "wall_s": t2 - t0,
                    "weights_s": t1 - t0,
                    "generate_s": t2 - t1,
                    "tokens": _tokens(outputs),
                }  # fmt: skip
            )
            bar.update()
        version = llm.weight_version
    finally:
        bar.close()
        llm.close()
    return _summary(steps, {"startup_s": round(startup, 4), "weight_version": version})


def _restart(args, llm_kw: dict, tensors: dict, prompts: list[dict]) -> dict[str, Any]:
    from safetensors.torch import save_file

    from rltserve.llm import LLM

    source = Path(llm_kw["model"])
    steps = []
    bar = progress_bar(args.steps, "restart", getattr(args, "progress", False), unit="step")
    for step in range(args.steps):
        folder = Path(tempfile.mkdtemp(prefix="rltserve-rollout-"))
        try:
            t0 = time.perf_counter()
            # The trainer's save: weights plus the files a checkpoint directory needs.
            for f in source.iterdir():
                if f.is_file() and not f.name.endswith(".safetensors") and f.suffix != ".json":
                    continue
                if f.suffix == ".json" and "index" not in f.name:
                    shutil.copy(f, folder / f.name)
            save_file(tensors, str(folder / "model.safetensors"))
            with LLM(**{**llm_kw, "model": str(folder)}) as llm:
                t1 = time.perf_counter()
                outputs = llm.generate(prompts, _params(args, step), use_tqdm=False)
                t2 = time.perf_counter()
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        steps.append(
            {
                "wall_s": time.perf_counter() - t0,
                "weights_s": t1 - t0,
                "generate_s": t2 - t1,
                "tokens": _tokens(outputs),
            }  # fmt: skip
        )
        bar.update()
    bar.close()
    return _summary(steps, {})


def check_workload(args: argparse.Namespace, model: str | None) -> None:
    """Refuses, before any engine starts, what the engine would only refuse once started: the
    sampling flags, and prompts that leave no room to generate in ``model``'s context (the
    demo model's, ``model`` None, is left to the engine)."""
    if not 0.0 <= args.temperature < math.inf:
        raise ValueError(f"--temperature {args.temperature:g}: must be a finite number >= 0")
    if not args.exit_threshold > 0.0:
        raise ValueError(
            f"--exit-threshold {args.exit_threshold:g}: must be > 0 (1 or more: full depth)"
        )
    _params(args, 0)  # (SamplingParams' own checks)
    config = Path(model) / "config.json" if model is not None else None
    if config is None or not config.is_file():
        return
    cfg = json.loads(config.read_text())
    context = args.max_model_len or cfg.get("max_position_embeddings", cfg.get("block_size"))
    if context is not None and args.input_len >= context:
        raise ValueError(
            f"--input-len {args.input_len}: leaves no room to generate within the context "
            f"limit of {context} tokens"
        )


def run_rollout_bench(args: argparse.Namespace, engine_kw: dict) -> dict[str, Any]:
    """Both arms on ``engine_kw``'s model; see the module doc."""
    from safetensors.torch import load_file

    from rltserve.models.demo import model_or_demo

    engine_kw = {**engine_kw, "model": model_or_demo(engine_kw.get("model"))}
    model = Path(engine_kw["model"])
    files = sorted(model.glob("*.safetensors"))
    tensors: dict = {}
    for f in files:
        tensors.update(load_file(str(f)))
    vocab = json.loads((model / "config.json").read_text()).get("vocab_size", 256)
    prompts = _prompts(args.num_prompts, args.input_len, vocab)
    llm_kw = _llm_kwargs(engine_kw)
    in_place = _in_place(args, llm_kw, tensors, prompts)
    restart = _restart(args, llm_kw, tensors, prompts)
    return {
        "workload": {
            "model": str(model),
            "num_prompts": args.num_prompts,
            "n": args.n,
            "input_len": args.input_len,
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "exit_threshold": args.exit_threshold,
            "steps": args.steps,
        },
        "in_place": in_place,
        "restart": restart,
        "step_speedup": round(restart["mean_step_s"] / in_place["mean_step_s"], 2),
    }


def add_rollout_parser(bench_sub) -> argparse.ArgumentParser:
    p = bench_sub.add_parser(
        "rollout", help="RL rollout steps: in-place weight updates vs an engine restart per step"
    )
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per step (default: 8)")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--input-len", type=int, default=32, help="prompt length in tokens")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens (default: 32)")
    p.add_argument(
        "--temperature", type=float, default=1.0, help="sampling temperature (default: 1.0)"
    )
    p.add_argument(
        "--exit-threshold",
        type=float,
        default=1.0,
        help="adaptive exit below 1 (default: 1.0, full depth)",
    )
    p.add_argument("--steps", type=int, default=3, help="training steps per arm")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bars on stderr")
    return p
