"""``scripts/fuzz_oracle.py``: its cases are reproducible from their seeds, span the engine
settings it claims to, and a short run finds the engine equal to the oracle."""

from __future__ import annotations

import orjson
from script_util import load_script

fuzz = load_script("fuzz_oracle")


def test_cases_are_reproducible_and_varied():
    assert fuzz.draw_case(7).describe() == fuzz.draw_case(7).describe()
    cases = [fuzz.draw_case(seed) for seed in range(300)]
    engines = [c.engine for c in cases]
    assert {c.family for c in cases} == {"ouro", "huginn", "nanbeige"}
    assert {e["kv_policy"] for e in engines} == {"full", "last_exited", "shared", "ring:2"}
    keys = (
        "preemption_mode",
        "async_scheduling",
        "wavefront_prefill",
        "max_num_seqs",
        "disaggregate",
    )
    for key in keys:
        assert any(key in e for e in engines), key
    params = [p for c in cases for p in c.params]
    criteria = {p.exit_criterion for p in params}
    assert criteria == {None, *fuzz.CRITERIA}
    assert any(p.kv_policy for p in params) and any(c.aborts for c in cases)
    assert any(p.prompt_logprobs is not None for p in params)
    assert any(c.groups for c in cases) and any(c.sampled for c in cases)
    budgets = {p.max_thinking_tokens for p in params}
    assert {0, 1, 2, 3} <= budgets and any(p.thinking_interruption == () for p in params)
    structured = [p.structured_outputs for p in params if p.structured_outputs]
    assert any(s.choice for s in structured) and any(s.regex for s in structured)
    guided = [c for c in cases if c.tokenized]
    assert {c.family for c in guided} == {"ouro", "huginn", "nanbeige"}
    assert any(c.sampled for c in guided) and any("preemption_mode" in c.engine for c in guided)
    # (A budget comes with a constraint, with penalties, and under async scheduling.)
    budgeted = [p for p in params if p.max_thinking_tokens is not None]
    assert any(p.structured_outputs for p in budgeted)
    assert any(p.repetition_penalty != 1.0 or p.presence_penalty for p in budgeted)
    lagged = [c for c in cases if c.engine.get("async_scheduling")]
    assert any(_feature(c, "max_thinking_tokens") for c in lagged)
    assert all(p.temperature > 0 for c in cases if c.sampled for p in c.params)
    # Shared/ring engines chunk prompts (the oracle runs the same chunks) but refuse wavefront
    # prefill and never share prompt blocks.
    unshared = [e for e in engines if e["kv_policy"] in ("shared", "ring:2")]
    assert any(e.get("prefill_chunk_size") for e in unshared)
    assert not any(e.get("wavefront_prefill") or e.get("enable_prefix_caching") for e in unshared)


def test_a_disaggregated_case_runs_on_two_stages_with_arrivals_and_aborts(tmp_path, monkeypatch):
    def wanted(case):
        return (
            case.engine.get("disaggregate")
            and 0 in case.aborts.values()
            and any(case.arrivals[i] for i in range(len(case.prompts)) if i not in case.aborts)
        )

    seed = next(s for s in range(1000) if wanted(fuzz.draw_case(s)))
    stages, runs = [], []
    real_client, real_stream = fuzz.PDClient, fuzz.stream_all

    def pd_client(*args):
        stages.append(real_client(*args))
        return stages[-1]

    def stream_all(*args, **kwargs):
        runs.append(real_stream(*args, **kwargs))
        return runs[-1]

    monkeypatch.setattr(fuzz, "PDClient", pd_client)
    monkeypatch.setattr(fuzz, "stream_all", stream_all)
    report = fuzz.fuzz([seed], tmp_path)
    assert report["counts"]["equal"] == 1 and len(stages) == 1
    case = fuzz.draw_case(seed)
    for i, after in case.aborts.items():  # (aborted as soon as sent: on the prefill stage)
        assert after > 0 or runs[0].finish[f"r{i}"] == "abort"
    ended = [runs[0].finish[f"r{i}"] for i in range(len(case.prompts)) if i not in case.aborts]
    assert all(reason in ("stop", "length") for reason in ended)


def test_a_short_run_equals_the_oracle(tmp_path, capsys):
    assert fuzz.main(["--cases", "8", "--seed", "0", "--json", "--work", str(tmp_path)]) == 0
    report = orjson.loads(capsys.readouterr().out)
    counts = report["counts"]
    assert counts["cases"] == 8 and not report["failures"]
    assert counts["equal"] + counts["tie"] == 8 and counts["equal"] >= 6


def test_an_aborted_request_is_compared_on_what_it_produced():
    want = ([5, 6, 7], [2, 3, 4])
    assert fuzz._same(([5, 6], [2, 3]), want, aborted=True)
    assert not fuzz._same(([5, 6], [2, 3]), want, aborted=False)
    assert not fuzz._same(([5, 9], [2, 3]), want, aborted=True)


def test_a_failure_reports_the_case_that_reproduces_it(tmp_path, capsys, monkeypatch):
    """Mismatches and crashes print the drawn case (JSON, int keys included: aborts, biases),
    and the exit status says so."""
    seeds = iter(range(100))
    seed = next(s for s in seeds if fuzz.draw_case(s).aborts)
    outcomes = iter(["r0: engine ([1], [2]), oracle ([3], [4])", RuntimeError("boom")])

    def run_case(case, checkpoints, refs, device):
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(fuzz, "run_case", run_case)
    monkeypatch.setattr(fuzz, "build_checkpoints", lambda work: ({}, {}))
    argv = ["--cases", "2", "--seed", str(seed), "--json", "--work", str(tmp_path)]
    assert fuzz.main(argv) == 1
    report = orjson.loads(capsys.readouterr().out)
    assert report["counts"]["mismatch"] == 1 and report["counts"]["crash"] == 1
    mismatch, crash = report["failures"]
    assert mismatch["diff"].startswith("r0: engine") and mismatch["case"]["seed"] == seed
    assert mismatch["case"]["aborts"] == {str(k): v for k, v in fuzz.draw_case(seed).aborts.items()}
    assert "RuntimeError: boom" in crash["error"] and crash["case"]["seed"] == seed + 1


def _first(wanted, start: int = 0) -> int:
    return next(s for s in range(start, start + 2000) if wanted(fuzz.draw_case(s)))


def _feature(case, name: str) -> list:
    return [p for p in case.params if getattr(p, name) is not None]


def test_thinking_and_structured_cases_equal_the_oracle(tmp_path, monkeypatch):
    """A handful of cases with thinking budgets (greedy with logprobs, K = 0 among them;
    seeded sampling, with penalties; under preemption; under async scheduling, with logprobs)
    and constraints (greedy with logprobs, sampled): each equals the oracle, logprobs
    included."""

    def budgeted(case, k=None):
        ps = _feature(case, "max_thinking_tokens")
        return any(k is None or p.max_thinking_tokens == k for p in ps)

    def lagged(case):
        return case.engine.get("async_scheduling") and not case.engine.get("disaggregate")

    def penalized(case):
        ps = _feature(case, "max_thinking_tokens")
        return any(p.repetition_penalty != 1.0 or p.presence_penalty for p in ps)

    def scored(case, k=None):
        ps = _feature(case, "max_thinking_tokens")
        return budgeted(case, k) and not case.sampled and any(p.logprobs is not None for p in ps)

    seeds = [
        _first(lambda c: scored(c, 0)),
        _first(lambda c: scored(c) and c.family == "huginn"),
        _first(lambda c: budgeted(c) and c.sampled),
        _first(lambda c: budgeted(c) and "preemption_mode" in c.engine),
        _first(lambda c: scored(c, 2) and lagged(c)),
        _first(lambda c: budgeted(c) and lagged(c) and c.sampled and penalized(c)),
        _first(lambda c: c.tokenized and not c.sampled and _feature(c, "logprobs")),
        _first(lambda c: c.tokenized and c.sampled),
    ]
    compared = []
    real = fuzz.logprobs_diff

    def spy(ref, prompt, p, steer, run, rid, policy):
        if p.logprobs is not None and steer is not None and policy in ("full", "last_exited"):
            compared.append(type(steer).__name__)
        return real(ref, prompt, p, steer, run, rid, policy)

    monkeypatch.setattr(fuzz, "logprobs_diff", spy)
    report = fuzz.fuzz(seeds, tmp_path)
    assert not report["failures"] and report["counts"]["refused"] == 0
    assert report["counts"]["equal"] + report["counts"]["tie"] == len(seeds)
    # (Forced and constrained tokens' logprobs were compared with the oracle's.)
    assert {"ThinkingBudget", "Constraint"} <= set(compared)


def test_the_new_checks_catch_what_they_are_for(tiny):
    """A forced id missing, a token outside a constraint and a forced logprob off are each
    reported."""
    from engine_util import Run
    from reference import Reference
    from reference_guided import Constraint, ThinkingBudget

    budget = ThinkingBudget(1, (40,), (300,))
    assert fuzz.output_diff(budget, [9, 40, 300, 7]) is None
    assert "not the forced 300" in fuzz.output_diff(budget, [9, 40, 301, 7])
    choice = Constraint(tiny, 0, 512, choice=["yes", "no"])
    assert "outside the constraint after 'n'" in fuzz.output_diff(choice, [82, 82])
    ref, prompt = Reference.load(tiny), [5, 6, 7]
    p = fuzz.SamplingParams(temperature=0.0, max_tokens=4, max_thinking_tokens=1, logprobs=1,
                            thinking_interruption=(40,), thinking_end_token_ids=(300,))  # fmt: skip
    out = ref.generate(prompt, 4, steer=budget)
    run = Run(tokens={"r0": out.tokens}, depths={"r0": out.exit_depths}, finish={"r0": "length"})
    from reference_parts import thinking_logprobs

    want = thinking_logprobs(ref, prompt, out.tokens, out.exit_depths, {1, 2}, 1)
    run.logprobs["r0"] = [w[0] for w in want]
    run.top_logprobs["r0"] = [w[1] for w in want]
    assert fuzz.logprobs_diff(ref, prompt, p, budget, run, "r0", "full") is None
    run.logprobs["r0"][2] += 0.01
    diff = fuzz.logprobs_diff(ref, prompt, p, budget, run, "r0", "full")
    assert diff.startswith("forced token 2: logprob")
