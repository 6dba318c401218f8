"""``scripts/bf16_drift.py`` (DESIGN §9: low-precision differences measured): its report's
shape, and that float32 against itself agrees everywhere."""

from __future__ import annotations

from script_util import load_script


def _script():
    return load_script("bf16_drift")


def test_float32_against_itself_agrees_everywhere(ouro_rv1, huginn_rv1, tmp_path):
    out = tmp_path / "drift.json"
    report = _script().main([
        "--model", str(ouro_rv1), "--huginn", str(huginn_rv1), "--low", "float32",
        "--num-prompts", "3", "--input-len", "5", "--output-len", "4",
        "--huginn-criterion", "entropy-diff", "--huginn-threshold", "0.6", "--out", str(out),
    ])  # fmt: skip
    assert out.exists() and report["low"] == "float32"
    cases = report["cases"]
    names = {"full_depth", "exit_threshold_0.5", "huginn_full_depth", "huginn_entropy-diff_0.6"}
    assert set(cases) == names
    for name, case in cases.items():
        assert (case["matched_tokens"], case["identical_outputs"]) == (1.0, 1.0), name
        assert case["depth_agreement"] == 1.0, name
        if "teacher_forced" in case:
            forced = case["teacher_forced"]
            assert forced["positions"] == 3 * 4 and forced["top1_agreement"] == 1.0
            assert forced["logprob_abs_diff_max"] == 0.0
    assert cases["huginn_entropy-diff_0.6"]["mean_exit_depth_float32"] < 4  # (early exits)
