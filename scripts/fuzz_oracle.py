"""Differential fuzzing of the engine against the dense oracle (``tests/reference.py``).

Each case (one seed) draws an engine: model family, KV policy, chunked or wavefront prefill,
async scheduling with delayed exits, a preemption mode on a pool so small that requests are
preempted again and again, prompt-sharing groups, prefix caching, the scheduler's other choices
(budgets, lockstep cohorts, carried rows, token pipelining, time slices, priority), sometimes
prefill and decode on two stages; and a workload: random prompts, arrivals and aborts, the
family's exit rule (Ouro's gate, Huginn's zero-shot criteria, a fixed depth), loop bounds, a
request's own KV policy, stops, biases, prompt logprobs, zero or seeded random initial states,
thinking budgets (K = 0 included) and structured outputs (a choice or a regex, on the family's
tiny preset, which has a tokenizer), with logprobs (``tests/fuzz_features.py``). It runs the
case with ``tests/engine_util.run_core`` (which fails on a leaked KV block) and compares every
greedy request's token ids, exit depths and prompt logprobs with the oracle's (a steered one's
logprobs too, as the oracle scores its output: a forced token's is the model's raw score);
in some cases the requests sample (seeded, with top-k/top-p/min-p and penalties) and each is
compared with itself run alone on a plain engine (its forced ids, constraint and logprobs
checked by the oracle's rules, ``tests/reference_guided.py``). Combinations the engine refuses (a
``ValueError`` naming them) are counted, not failed; so are differences within float32 rounding
of a decision (``Tie``).

    python scripts/fuzz_oracle.py --cases 200 --seed 0 --json

prints one JSON object: the counts, and for every mismatch or crash the case (seed, engine
settings, prompts and params) that reproduces it: ``--case-seed N`` runs that case alone;
``--device cuda`` runs the engine there (the oracle stays on the CPU). The checkpoints are the
tiny random ones the tests use, built under ``--work`` (a temporary directory by default).
About 0.2 s a case on one CPU core.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import orjson  # noqa: E402
import torch  # noqa: E402
from engine_util import (  # noqa: E402
    Run,
    make_core,
    oracle_run,
    run_core,
    stream_all,
    tight_blocks,
    wait_pd_idle,
)
from fuzz_features import (  # noqa: E402
    chosen_logits,
    draw_guided,
    draw_thinking,
    engine_params,
    logprobs_diff,
    output_diff,
    steer_for,
)
from recipe import build_huginn_rv1, build_ouro_rv1  # noqa: E402
from reference import Reference  # noqa: E402

from rltserve.config import EngineConfig, SchedulerConfig  # noqa: E402
from rltserve.core.pd import PDClient  # noqa: E402
from rltserve.core.stage import InProcessStageClient  # noqa: E402
from rltserve.models.presets import make_model  # noqa: E402
from rltserve.sampling import REQUEST_KV_POLICIES, SamplingParams  # noqa: E402

FAMILIES = ("ouro", "huginn", "nanbeige")
# Thresholds at which the tiny random checkpoints' tokens exit at varied depths.
GATE_THRESHOLDS = (0.3, 0.5, 0.7, 0.9, 1.0)
CRITERIA = {
    "kl": (0.999,),
    "minp-kl": (0.63,),
    "entropy-diff": (0.6,),
    "latent-diff": (0.97,),
    "argmax-stability": (2, 3),
    "none": (1.0,),
}


@dataclasses.dataclass
class Case:
    seed: int
    family: str
    engine: dict
    prompts: list[list[int]]
    params: list[SamplingParams]
    arrivals: list[int]
    groups: list[str | None] | None
    lag: int
    # request -> the step it is aborted at (disaggregated: the tokens it has); its output is
    # then a prefix
    aborts: dict[int, int]
    # Seeded sampling: the oracle is greedy, so each request is compared with itself run alone
    # on a plain engine (same KV policy and exit mode) instead.
    sampled: bool = False
    # Structured outputs need a tokenizer: the case runs on the family's tiny preset.
    tokenized: bool = False

    @property
    def model(self) -> str:
        """The checkpoint's key in ``build_checkpoints``'."""
        return f"{self.family}-tok" if self.tokenized else self.family

    def describe(self) -> dict:
        """The case as JSON takes it: each request's params that are set (a 0 that is not the
        default, as a thinking budget of 0 or ``logprobs=0``, included)."""
        defaults = {f.name: f.default for f in dataclasses.fields(SamplingParams)}

        def shown(k, v) -> bool:
            return bool(v) or isinstance(v, (int, float)) and v != defaults[k]

        params = [
            {k: v for k, v in dataclasses.asdict(p).items() if shown(k, v)} for p in self.params
        ]
        return {**dataclasses.asdict(self), "params": params}


def draw_case(seed: int) -> Case:
    rng = random.Random(seed)
    family = rng.choice(FAMILIES)
    engine: dict = {"kv_policy": rng.choice(["full", "last_exited", "last_exited", "shared"])}
    if family == "huginn" and rng.random() < 0.2:
        engine["kv_policy"] = "ring:2"
    prefill = rng.choice(["whole", "chunked", "wavefront"])
    per_depth = engine["kv_policy"] in REQUEST_KV_POLICIES
    if prefill != "whole":
        # (Under shared/ring a later chunk reads an earlier one's last versions: the oracle
        # runs the same chunks, and the engine refuses wavefront prefill.)
        engine["prefill_chunk_size"] = rng.choice([2, 4])
        engine["wavefront_prefill"] = prefill == "wavefront" and per_depth
    lag = 0
    if rng.random() < 0.35:
        engine.update(async_scheduling=True, exit_mode="delayed")
        lag = 1
    if rng.random() < 0.4:
        engine["preemption_mode"] = rng.choice(["recompute", "swap"])
        if rng.random() < 0.5:  # (admission on the first chunk alone: more preemptions)
            engine["kv_watermark"] = 0.0
    if rng.random() < 0.3 and per_depth:
        engine["enable_prefix_caching"] = True
    if rng.random() < 0.3:
        engine["max_num_seqs"] = rng.randint(1, 3)
    if rng.random() < 0.3:  # (chunks prompts)
        budget = engine["max_num_batched_tokens"] = rng.randint(4, 12)
        engine["prefill_chunk_size"] = min(engine.get("prefill_chunk_size", budget), budget)
    n = rng.randint(1, 6)
    shared = [rng.randrange(384) for _ in range(rng.randint(0, 6))]
    prompts = [shared + [rng.randrange(384) for _ in range(rng.randint(1, 8))] for _ in range(n)]
    params = [draw_params(rng, family, engine["kv_policy"]) for _ in range(n)]
    groups = None
    if n > 1 and rng.random() < 0.3:  # (a group shares one prompt)
        prompts = [prompts[0]] * n
        groups = ["g"] * n
    arrivals = [rng.randint(0, 4) for _ in range(n)]
    aborts = {i: arrivals[i] + rng.randint(0, 12) for i in range(n) if rng.random() < 0.15}
    params = draw_scheduling(random.Random(seed + 10**6), family, engine, params)
    params, sampled = draw_sampling(random.Random(seed + 2 * 10**6), params)
    if per_depth and random.Random(seed + 3 * 10**6).random() < 0.1:
        # Prefill/decode disaggregation: two in-process stages, prompts long enough to move KV.
        # Arrivals and aborts count tokens, not steps (the stages step on their own threads):
        # a request is sent once the run has produced ``arrivals[i]`` tokens and aborted once
        # it has ``aborts[i]`` (0: while its prompt is on the prefill stage or moving).
        engine["disaggregate"] = True
        engine.pop("enable_prefix_caching", None)
        prompts = [prompt * 3 for prompt in prompts]
        pd = random.Random(seed + 4 * 10**6)
        arrivals = [pd.choice([0, 0, pd.randint(1, 12)]) for _ in range(n)]
        aborts = {i: pd.choice([0, pd.randint(1, 6)]) for i in range(n) if pd.random() < 0.2}
        lag = 0
    params = draw_thinking(random.Random(seed + 5 * 10**6), params)
    params, tokenized = draw_guided(random.Random(seed + 6 * 10**6), params)
    return Case(
        seed, family, engine, prompts, params, arrivals, groups, lag, aborts, sampled, tokenized
    )


def draw_sampling(rng: random.Random, params: list[SamplingParams]):
    """Seeded sampling in some cases: temperature, top-k/top-p/min-p and the penalties (whose
    history a preempted request gets back)."""
    if rng.random() >= 0.3:
        return params, False
    sampled = [
        p.replace(
            temperature=rng.choice([0.6, 1.0, 1.3]),
            seed=rng.randrange(10**6),
            top_k=rng.choice([-1, 5, 50]),
            top_p=rng.choice([1.0, 0.9]),
            min_p=rng.choice([0.0, 0.05]),
            repetition_penalty=rng.choice([1.0, 1.2]),
            presence_penalty=rng.choice([0.0, 0.5]),
            frequency_penalty=rng.choice([0.0, 0.3]),
        )
        for p in params
    ]
    return sampled, True


def draw_scheduling(
    rng: random.Random, family: str, engine: dict, params: list[SamplingParams]
) -> list[SamplingParams]:
    """The scheduler's other choices (drawn apart, so the draws above stay as they were):
    lockstep cohorts, decode without carried rows, token pipelining (Ouro, per-depth KV),
    time slices under preemption, priority order (with the requests' priorities)."""
    if rng.random() < 0.1 and not engine.get("wavefront_prefill"):
        engine["scheduling"] = "no_refill"
    if rng.random() < 0.15:
        engine["carry_decode"] = False
    per_depth = engine["kv_policy"] in REQUEST_KV_POLICIES
    if family == "ouro" and per_depth and rng.random() < 0.2:
        engine.update(speculative_tokens=rng.randint(1, 3), draft_loops=rng.randint(1, 3))
    if "preemption_mode" in engine and rng.random() < 0.3:
        engine["preemption_time_slice"] = rng.randint(2, 6)
    if rng.random() < 0.2:
        engine["scheduling_policy"] = "priority"
        params = [p.replace(priority=rng.randint(-2, 2)) for p in params]
    return params


def draw_params(rng: random.Random, family: str, engine_policy: str) -> SamplingParams:
    loops = rng.choice(
        {"ouro": [None, 2, 3], "huginn": [None, None, 2, 3, 6], "nanbeige": [None, 1, 3, 4]}[family]
    )
    kw: dict = {"max_loops": loops, "min_loops": rng.choice([1, 1, 2])}
    if loops is not None:
        kw["min_loops"] = min(kw["min_loops"], loops)
    if family == "ouro":
        kw["exit_threshold"] = rng.choice(GATE_THRESHOLDS)
    else:
        criterion = rng.choice([*CRITERIA, None])
        if criterion is not None:
            kw["exit_criterion"] = criterion
            kw["exit_threshold"] = rng.choice(CRITERIA[criterion])
        if family == "huginn":  # (its recurrent state starts at zero or random)
            kw["init_state"] = rng.choice(["zero", "random"])
            kw["seed"] = rng.randrange(1000) if kw["init_state"] == "random" else None
    if engine_policy in REQUEST_KV_POLICIES and rng.random() < 0.3:
        kw["kv_policy"] = rng.choice(REQUEST_KV_POLICIES)
    if rng.random() < 0.2:  # (stops where the greedy output has these ids, or not at all)
        kw.update(ignore_eos=False, stop_token_ids=[rng.randrange(384) for _ in range(40)])
        kw["min_tokens"] = rng.choice([0, 2])
    if rng.random() < 0.15:
        kw["logit_bias"] = {rng.randrange(384): rng.choice([-5.0, 5.0]) for _ in range(3)}
    if rng.random() < 0.15:
        kw["prompt_logprobs"] = rng.choice([0, 3])
    kw.setdefault("ignore_eos", True)
    max_tokens = rng.randint(max(1, kw.get("min_tokens", 0)), 6)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def run_case(case: Case, checkpoints: dict, refs: dict, device: str = "cpu") -> str | None:
    """None when the engine (on ``device``; the oracle runs on the CPU) equals the oracle;
    else what differs. Raises ValueError for a combination the engine refuses."""
    path = checkpoints[case.model]
    case = dataclasses.replace(case, params=engine_params(case.params, path))
    engine = {**case.engine, "device": device}
    if device.startswith("cuda") and random.Random(case.seed).random() < 0.5:
        engine["cuda_graphs"] = True  # (decode-only steps replay graphs)
    if "preemption_mode" in engine:
        engine["block_size"] = 4
        engine["num_blocks"] = tight_blocks(path, case.prompts, case.params, **_policy(engine))
    if engine.get("disaggregate"):
        run = _run_disaggregated(case, path, engine)
        return _compare(case, path, run, engine, refs)
    core = make_core(path, **engine)
    try:
        run = run_core(
            core, case.prompts, case.params, arrivals=case.arrivals, lag=case.lag,
            groups=case.groups, aborts=case.aborts,
        )  # fmt: skip
    finally:
        core.shutdown()
    return _compare(case, path, run, engine, refs)


def _compare(case: Case, path, run, engine: dict, refs: dict) -> str | None:
    exit_mode = engine.get("exit_mode", "gate")
    ref = refs[case.model]
    if case.sampled:
        return _against_alone(case, path, run, exit_mode, engine["device"], ref)
    for i, (prompt, p) in enumerate(zip(case.prompts, case.params)):
        policy = p.kv_policy or engine["kv_policy"]
        kw = {"exit_mode": exit_mode, "kv_policy": policy, "prompt_chunks": _chunks(prompt, case)}
        kw["steer"] = steer = steer_for(p, ref, path)
        want = oracle_run(ref, prompt, p, **kw)
        got = (run.tokens[f"r{i}"], run.depths[f"r{i}"])
        aborted = run.finish.get(f"r{i}") == "abort"  # (what it produced before the abort)
        if not _same(got, (want.tokens, want.exit_depths), aborted):
            diff = f"r{i}: engine {got}, oracle {(want.tokens, want.exit_depths)}"
            if _tie(ref, prompt, p, got, want, aborted, kw):
                raise Tie(diff)
            return diff
        scored = p.prompt_logprobs is not None and got[0]  # (they come with the first token)
        got_scores = run.prompt_logprobs.get(f"r{i}")
        if scored and (diff := _prompt_logprobs_diff(got_scores, want.prompt_logits, prompt, p)):
            return f"r{i}: {diff}"
        if diff := logprobs_diff(ref, prompt, p, steer, run, f"r{i}", policy):
            return f"r{i}: {diff}"
    return None


_CHUNKING = ("prefill_chunk_size", "max_num_batched_tokens", "max_num_seqs")  # (whole chunks)


def _chunks(prompt: list[int], case: Case) -> list[int] | None:
    """The prompt's chunk starts where they matter (shared/ring: a chunk reads an earlier one's
    last versions); the engine cuts chunks at multiples of ``whole_chunk_size``."""
    if case.engine["kv_policy"] in REQUEST_KV_POLICIES:
        return None
    sched = SchedulerConfig(**{k: case.engine[k] for k in _CHUNKING if k in case.engine})
    return list(range(0, len(prompt), sched.whole_chunk_size))


def _prompt_logprobs_diff(got, logits, prompt: list[int], p: SamplingParams) -> str | None:
    """What differs between an update's prompt logprobs and the oracle's prompt logits (each
    prompt token's logprob and the top ``prompt_logprobs``, within float32 noise); ids of
    equal values may come in either order, so the values are compared. Float32 noise grows with
    a logprob's size (a tiny random checkpoint's reach -30): the tolerance is relative."""

    def near(a: float, b: float) -> bool:
        return abs(a - b) <= 1e-4 * (1 + abs(b))

    if got is None:
        return "no prompt logprobs"
    if len(got) != len(prompt) - 1:
        return f"{len(got)} prompt logprobs for {len(prompt)} prompt tokens"
    want = torch.log_softmax(logits.float(), dim=-1)  # [T - 1, V]
    for q, (lp, top, _) in enumerate(got):
        expected = float(want[q, prompt[q + 1]])
        if not near(lp, expected):
            return f"prompt logprob {q}: {lp} vs the oracle's {expected}"
        values = want[q].topk(p.prompt_logprobs).values.tolist()
        if len(top) != len(values) or not all(near(v, w) for (_, v), w in zip(top, values)):
            return f"prompt top logprobs {q}: {top} vs the oracle's {values}"
    return None


def _run_disaggregated(case: Case, path, engine: dict) -> Run:
    """The case on a prefill and a decode stage (``PDClient``, in-process stages); both end
    idle with no KV held and no transfer file left."""
    engine.setdefault("num_blocks", 512)
    engine.setdefault("block_size", 4)
    config = EngineConfig.from_flat(model=str(path), **engine)
    client = PDClient(config, InProcessStageClient)
    try:
        client.wait_ready(120)
        run = stream_all(
            client, case.prompts, case.params, timeout=120, groups=case.groups,
            arrivals=case.arrivals, aborts=case.aborts,
        )  # fmt: skip
        wait_pd_idle(client)
    finally:
        client.close()
    return run


def _against_alone(case: Case, path, run, exit_mode: str, device: str, ref) -> str | None:
    for i, (prompt, p) in enumerate(zip(case.prompts, case.params)):
        policy = p.kv_policy or case.engine["kv_policy"]
        kw = {"kv_policy": policy, "exit_mode": exit_mode, "device": device}
        if policy not in REQUEST_KV_POLICIES:  # (the same chunks)
            kw.update({k: case.engine[k] for k in _CHUNKING if k in case.engine})
        core = make_core(path, **kw)
        try:  # (alone, priority orders nothing: the fcfs engine refuses one other than 0)
            alone = run_core(core, [prompt], [p.replace(priority=0)])
        finally:
            core.shutdown()
        got = (run.tokens[f"r{i}"], run.depths[f"r{i}"])
        want = (alone.tokens["r0"], alone.depths["r0"])
        if not _same(got, want, run.finish.get(f"r{i}") == "abort"):
            return f"r{i}: engine {got}, alone {want}"
        steer = steer_for(p, ref, path)
        if diff := output_diff(steer, got[0]):
            return f"r{i}: {diff}"
        if diff := logprobs_diff(ref, prompt, p, steer, run, f"r{i}", policy):
            return f"r{i}: {diff}"
    return None


class Tie(Exception):
    """The engine and the oracle differ where the oracle itself is within rounding of a
    decision: two logits within ``TIE`` of each other, or an exit value within a relative
    ``TIE`` of its threshold. Batching changes a float32 result's last bits (reduction order),
    so such a case decides nothing."""


TIE = 1e-5


def _same(got: tuple, want: tuple, aborted: bool) -> bool:
    """``got`` and ``want``: (token ids, exit depths); an aborted request's is a prefix."""
    tokens, depths = want
    if aborted:
        tokens, depths = tokens[: len(got[0])], depths[: len(got[1])]
    return got == (tokens, depths)


def _tie(ref, prompt, p: SamplingParams, got: tuple, want, aborted: bool, kw: dict) -> bool:
    k = next(
        (j for j, pair in enumerate(zip(*got)) if pair != (want.tokens[j], want.exit_depths[j])),
        min(len(got[0]), len(want.tokens)) - 1,
    )
    if 0 <= k < len(want.logits):
        logits = chosen_logits(kw.get("steer"), want.tokens[:k], want.logits[k].float())
        top = logits.topk(2).values
        if float(top[0] - top[1]) < TIE * max(1.0, float(top[0].abs())):
            return True
    if not p.adaptive_exit or p.exit_criterion == "argmax-stability":
        return False
    for scale in (1 - TIE, 1 + TIE):
        near = p.replace(exit_threshold=p.exit_threshold * scale)
        other = oracle_run(ref, prompt, near, **kw)
        if _same(got, (other.tokens, other.exit_depths), aborted):
            return True
    return False


def _policy(engine: dict) -> dict:
    return {k: engine[k] for k in ("kv_policy", "kv_watermark") if k in engine}


def build_checkpoints(work: Path) -> tuple[dict, dict]:
    checkpoints = {
        "ouro": build_ouro_rv1(work / "ouro"),
        "huginn": build_huginn_rv1(work / "huginn"),
        "nanbeige": make_model("nanbeige-tiny", work / "nanbeige"),
        "ouro-tok": make_model("ouro-tiny", work / "ouro-tok"),
        "huginn-tok": make_model("huginn-tiny", work / "huginn-tok"),
    }
    checkpoints["nanbeige-tok"] = checkpoints["nanbeige"]  # (it has a tokenizer)
    return checkpoints, {name: Reference.load(p) for name, p in checkpoints.items()}


def fuzz(seeds: list[int], work: Path, progress: bool = False, device: str = "cpu") -> dict:
    checkpoints, refs = build_checkpoints(work)
    counts = {"cases": 0, "equal": 0, "refused": 0, "tie": 0, "mismatch": 0, "crash": 0}
    failures = []
    for seed in seeds:
        case = draw_case(seed)
        counts["cases"] += 1
        try:
            diff = run_case(case, checkpoints, refs, device)
        except Tie as tie:
            counts["tie"] += 1
            if progress:
                print(f"case {seed}: tie: {tie}", file=sys.stderr)
            continue
        except ValueError as exc:  # (a combination the engine refuses, naming it)
            counts["refused"] += 1
            if progress:
                print(f"case {seed}: refused: {exc}", file=sys.stderr)
            continue
        except Exception:  # noqa: BLE001 - every crash is a finding
            counts["crash"] += 1
            failures.append({"kind": "crash", "error": traceback.format_exc(limit=8),
                             "case": case.describe()})  # fmt: skip
            continue
        if diff is None:
            counts["equal"] += 1
        else:
            counts["mismatch"] += 1
            failures.append({"kind": "mismatch", "diff": diff, "case": case.describe()})
        if progress:
            print(f"case {seed}: {'ok' if diff is None else diff}", file=sys.stderr)
    return {"counts": counts, "failures": failures}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0, help="the first case's seed")
    ap.add_argument("--case-seed", type=int, default=None, help="run this one case")
    ap.add_argument("--work", type=Path, default=None, help="where the checkpoints are built")
    ap.add_argument("--json", action="store_true", help="JSON only (no progress lines)")
    ap.add_argument("--device", default="cpu", help="the engine's (the oracle runs on the CPU)")
    args = ap.parse_args(argv)
    seeds = (
        [args.case_seed]
        if args.case_seed is not None
        else list(range(args.seed, args.seed + args.cases))
    )
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        report = fuzz(seeds, args.work or Path(tmp), progress=not args.json, device=args.device)
    report["device"] = args.device
    report["seconds"] = round(time.monotonic() - start, 1)
    sys.stdout.write(
        orjson.dumps(report, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode() + "\n"
    )
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
