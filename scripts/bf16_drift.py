#!/usr/bin/env python
"""Measurement: how far a low-precision engine drifts from float32 (DESIGN §9: bf16 differences
are measured and reported, not hidden).

    python scripts/bf16_drift.py                              # ouro-small (built once), JSON out
    python scripts/bf16_drift.py --model DIR --num-prompts 32 --out drift.json
    python scripts/bf16_drift.py --low float16

For each case (a model and a loop setting) the same greedy requests run twice through the
offline ``LLM``, in float32 (which the tests hold equal to the dense oracle) and in ``--low``:

- free running: ``matched_tokens`` (mean fraction of each output equal to float32's before the
  first difference), ``identical_outputs`` (fraction of requests whose whole output is equal),
  ``depth_agreement`` (exit depths equal, over the tokens before the first difference);
- teacher forced: float32's prompt + output scored by both engines (``prompt_logprobs``, at the
  full depth): ``top1_agreement`` (fraction of positions where the low-precision model ranks
  float32's next token first, as float32 does), ``logprob_abs_diff`` (mean and max of the
  difference of that token's logprob).

Cases: the model as given at full depth and, where it has a gate, at ``exit_threshold`` 0.5;
with ``--huginn``, also a Huginn checkpoint at a fixed depth and under a zero-shot criterion
(``--huginn-criterion``, ``kl`` by default, at ``--huginn-threshold``).
Random-weight checkpoints have nearly flat distributions, so near-ties (and so flips) are more
common than in a trained model: the numbers bound what to expect rather than predict it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rltserve import LLM, SamplingParams  # noqa: E402
from rltserve.sampling import EXIT_CRITERIA  # noqa: E402


def _workload(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def _run(model: str, dtype: str, prompts: list[list[int]], params: SamplingParams) -> list:
    with LLM(model, dtype=dtype, in_process=True) as llm:
        return [out.outputs[0] for out in llm.generate(prompts, params)]


def _scores(model: str, dtype: str, sequences: list[list[int]], max_loops: int | None) -> list:
    """Per sequence, per position after the first: (logprob, rank) of its token."""
    params = SamplingParams(
        max_tokens=1, temperature=0.0, prompt_logprobs=0, max_loops=max_loops, detokenize=False
    )
    with LLM(model, dtype=dtype, in_process=True) as llm:
        outs = llm.generate(sequences, params)
    scored = []
    for out in outs:  # (prompt_logprobs=0: each dict holds the prompt's own token alone)
        entries = [next(iter(d.values())) for d in out.prompt_logprobs[1:]]
        scored.append([(e.logprob, e.rank) for e in entries])
    return scored


def compare(
    model: str, low: str, prompts: list[list[int]], params: SamplingParams, teacher: bool = True
) -> dict:
    ref, got = _run(model, "float32", prompts, params), _run(model, low, prompts, params)
    matched, depth_equal, depth_total = [], 0, 0
    for a, b in zip(ref, got):
        n = 0
        while n < min(len(a.token_ids), len(b.token_ids)) and a.token_ids[n] == b.token_ids[n]:
            n += 1
        matched.append(n / max(len(a.token_ids), 1))
        depth_equal += sum(x == y for x, y in zip(a.exit_depths[:n], b.exit_depths[:n]))
        depth_total += n
    report = {
        "requests": len(prompts),
        "output_tokens": params.max_tokens,
        "matched_tokens": round(statistics.mean(matched), 4),
        "identical_outputs": round(sum(m == 1.0 for m in matched) / len(matched), 4),
        "depth_agreement": round(depth_equal / max(depth_total, 1), 4),
        "mean_exit_depth_float32": round(statistics.mean(d for o in ref for d in o.exit_depths), 3),
    }
    if teacher:
        # Float32's own sequences, scored by both: the position after each token is the next.
        sequences = [p + o.token_ids for p, o in zip(prompts, ref)]
        want = _scores(model, "float32", sequences, params.max_loops)
        have = _scores(model, low, sequences, params.max_loops)
        diffs, agree, total = [], 0, 0
        for w, h, p in zip(want, have, prompts):
            for (lw, rw), (lh, rh) in list(zip(w, h))[len(p) - 1 :]:  # the output's tokens
                diffs.append(abs(lw - lh))
                agree += (rh == 1) == (rw == 1)
                total += 1
        report["teacher_forced"] = {
            "positions": total,
            "top1_agreement": round(agree / max(total, 1), 4),
            "logprob_abs_diff_mean": round(statistics.mean(diffs), 5),
            "logprob_abs_diff_max": round(max(diffs), 5),
        }
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: ouro-small, built)")
    parser.add_argument("--huginn", default=None, help="also a Huginn checkpoint")
    parser.add_argument("--huginn-criterion", default="kl", choices=sorted(EXIT_CRITERIA))
    parser.add_argument(
        "--huginn-threshold", type=float, default=None, help="(default: the criterion's)"
    )
    parser.add_argument("--low", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    from rltserve.models.loader import read_config

    model = args.model
    if model is None:
        from rltserve.models.presets import make_model

        model = str(Path(tempfile.gettempdir()) / "rltserve-ouro-small")
        if not (Path(model) / "config.json").exists():
            make_model("ouro-small", model)

    def prompts_for(path: str) -> list[list[int]]:
        cfg = read_config(path)
        vocab = cfg.get("vocab_size") or cfg.get("padded_vocab_size")
        return _workload(args.num_prompts, args.input_len, min(vocab, 4096), seed=0)

    prompts = prompts_for(model)
    base = SamplingParams(
        temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False
    )
    cases = {"full_depth": compare(model, args.low, prompts, base)}
    if read_config(model).get("model_type") == "ouro":
        adaptive = base.replace(exit_threshold=0.5)
        cases["exit_threshold_0.5"] = compare(model, args.low, prompts, adaptive, teacher=False)
    if args.huginn:
        prompts = prompts_for(args.huginn)
        fixed = base.replace(init_state="zero")
        cases["huginn_full_depth"] = compare(args.huginn, args.low, prompts, fixed)
        zero_shot = fixed.replace(
            exit_criterion=args.huginn_criterion, exit_threshold=args.huginn_threshold
        )
        name = f"huginn_{args.huginn_criterion}_{zero_shot.exit_threshold}"
        cases[name] = compare(args.huginn, args.low, prompts, zero_shot, teacher=False)
    report = {"model": model, "huginn": args.huginn, "low": args.low, "cases": cases}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
