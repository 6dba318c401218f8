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
