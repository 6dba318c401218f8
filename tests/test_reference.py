"""Tests of the dense oracle ``tests/reference.py`` against the Hugging Face vectors and itself."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from recipe import build_huginn_rv1, build_nanbeige, build_ouro_rv1, load_vectors, tensor_sums
from reference import Reference
from reference_parts import (
    Criterion,
    ExitRule,
    exit_depth_from_gates,
    parse_kv_policy,
    plane_of,
)

VECTORS = load_vectors()
PROMPTS = VECTORS["prompts"]

# Engine settings that reproduce each HF case (TESTVECTORS.md).
OURO_CASES = {
    "ouro_full_depth": {},
    "ouro_threshold_0.5": {"exit_threshold": 0.5, "min_loops": 1, "kv_policy": "full"},
    "ouro_threshold_0.3": {"exit_threshold": 0.3, "min_loops": 1, "kv_policy": "full"},
    "ouro_exit_at_depth_2": {"max_loops": 2, "kv_policy": "full"},
}


@pytest.fixture(scope="module")
def ckpt_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rv1")
    return {
        "ouro": build_ouro_rv1(root / "ouro"),
        "huginn": build_huginn_rv1(root / "huginn"),
        "nanbeige": build_nanbeige(root / "nanbeige"),
    }


@pytest.fixture(scope="module")
def ouro(ckpt_dirs) -> Reference:
    return Reference.load(ckpt_dirs["ouro"])


@pytest.fixture(scope="module")
def huginn(ckpt_dirs) -> Reference:
    return Reference.load(ckpt_dirs["huginn"])


@pytest.fixture(scope="module")
def nanbeige(ckpt_dirs) -> Reference:
    return Reference.load(ckpt_dirs["nanbeige"])


def decode_exits(prompt_len: int, depth: int, out_exits: list[int], seq_len: int) -> list[int]:
    """Per-position exit depths of prompt + generated[:-1]."""
    return [depth] * (prompt_len - 1) + out_exits[: seq_len - prompt_len + 1]


def check_cached_equals_recompute(
    ref: Reference, prompt: list[int], max_tokens: int, recompute_policy: str = "full", **kw
) -> None:
    out = ref.generate(prompt, max_tokens, **kw)
    seq = list(prompt) + out.tokens[:-1]
    cap, depth = ref.depths(kw.get("max_loops"))
    exits = decode_exits(len(prompt), depth, out.exit_depths, len(seq))
    rec = ref.full_recompute(
        seq,
        exits,
        prompt_len=len(prompt),
        kv_policy=recompute_policy,
        max_loops=kw.get("max_loops"),
        init_state=kw.get("init_state", "zero"),
        seed=kw.get("seed"),
    )
    n = len(prompt)
    for k, logits in enumerate(out.logits):
        # 1e-5 relative to the logit scale (Huginn's tied, embed-scaled head gives |logits| ~ 30;
        # the two paths differ only by fp32 reduction order).
        atol = 1e-5 * max(1.0, float(logits.abs().max()))
        torch.testing.assert_close(rec.logits[n - 1 + k], logits, atol=atol, rtol=1e-5)
        assert int(torch.argmax(rec.logits[n - 1 + k])) == out.tokens[k]
    if rec.gate_logits is not None and kw.get("exit_mode", "gate") in ("gate", "delayed"):
        for k, e in enumerate(out.exit_depths):
            got = exit_depth_from_gates(
                rec.gate_logits[:, n - 1 + k],
                cap=cap,
                exit_mode=kw.get("exit_mode", "gate"),
                min_loops=kw.get("min_loops", 1),
                exit_threshold=kw.get("exit_threshold", 1.0),
            )
            assert got == e


# --------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_rv1_tensor_sums(ckpt_dirs, family):
    got = tensor_sums(ckpt_dirs[family])
    for name, expected in VECTORS["tensor_sums"][family].items():
        assert abs(round(got[name], 6) - expected) <= 1e-6, name


# --------------------------------------------------------------------------- HF vectors


@pytest.mark.parametrize("case", sorted(OURO_CASES))
def test_ouro_reproduces_hf_vectors(ouro, case):
    expected = VECTORS["cases"][case]
    for i, prompt in enumerate(PROMPTS):
        out = ouro.generate(prompt, 16, **OURO_CASES[case])
        assert out.tokens == expected["tokens"][i], (case, i)
        assert out.exit_depths == expected["exit_depths"][i], (case, i)


def test_huginn_reproduces_hf_vectors(huginn):
    expected = VECTORS["cases"]["huginn_4_loops_zero_state"]
    for i, prompt in enumerate(PROMPTS):
        out = huginn.generate(prompt, 12, max_loops=4, init_state="zero")
        assert out.tokens == expected["tokens"][i], i
        assert out.exit_depths == expected.get("exit_depths", [[4] * 12] * 5)[i]


def test_default_depths(ouro, huginn, nanbeige):
    assert (ouro.num_loops, huginn.num_loops, nanbeige.num_loops) == (4, 4, 2)
    assert ouro.depths(None) == (4, 4)
    assert ouro.depths(2) == (2, 4)  # Ouro keeps D planes
    assert ouro.depths(6) == (6, 6)
    assert huginn.depths(2) == (2, 2)
    assert huginn.depths(7) == (7, 7)


# --------------------------------------------------------------------------- cached vs recompute


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"exit_threshold": 0.5},
        {"exit_threshold": 0.3, "min_loops": 2},
        {"max_loops": 2},
        {"max_loops": 6, "exit_threshold": 0.6},
        {"exit_mode": "delayed", "exit_threshold": 0.5},
        {"exit_mode": "trace", "trace_depths": [3, 1, 2, 4, 1, 1, 3, 2, 4, 2]},
    ],
    ids=["default", "q0.5", "q0.3-min2", "cap2", "cap6", "delayed", "trace"],
)
def test_ouro_cached_equals_full_recompute(ouro, kw):
    for prompt in (PROMPTS[0], PROMPTS[3]):
        check_cached_equals_recompute(ouro, prompt, 10, kv_policy="full", **kw)


@pytest.mark.parametrize(
    "kw",
    [
        {"exit_threshold": 0.5},
        {"exit_threshold": 0.3},
        {"exit_mode": "trace", "trace_depths": [2, 1, 3, 1, 2, 4, 1, 2, 1, 3]},
    ],
    ids=["q0.5", "q0.3", "trace"],
)
def test_ouro_last_exited_equals_direct_formulation(ouro, kw):
    for prompt in (PROMPTS[1], PROMPTS[2]):
        check_cached_equals_recompute(
            ouro, prompt, 10, kv_policy="last_exited", recompute_policy="last_exited", **kw
        )


@pytest.mark.parametrize(
    "kw",
    [
        {"max_loops": 4},
        {"max_loops": 3, "init_state": "random", "seed": 11},
        {"exit_mode": "trace", "trace_depths": [2, 4, 1, 3, 3, 1, 2, 4]},
    ],
    ids=["zero", "random", "trace"],
)
def test_huginn_cached_equals_full_recompute(huginn, kw):
    for prompt in (PROMPTS[0], PROMPTS[2]):
        check_cached_equals_recompute(huginn, prompt, 8, kv_policy="full", **kw)


def test_huginn_last_exited_equals_direct_formulation(huginn):
    kw = {"exit_mode": "trace", "trace_depths": [3, 1, 2, 4, 2, 1, 3, 1]}
    check_cached_equals_recompute(
        huginn, PROMPTS[1], 8, kv_policy="last_exited", recompute_policy="last_exited", **kw
    )


def test_nanbeige_cached_equals_full_recompute(nanbeige):
    assert nanbeige.head_dim == 32 and nanbeige.num_kv_heads == 2
    for prompt in (PROMPTS[0], PROMPTS[4]):
        check_cached_equals_recompute(nanbeige, prompt, 10, kv_policy="full")
        out = nanbeige.generate(prompt, 10)  # no gate, no criterion: its loop count
        assert out.exit_depths == [2] * 10
        assert out.gate_logits == [[]] * 10
    check_cached_equals_recompute(nanbeige, PROMPTS[1], 8, max_loops=3)
    trace = {"exit_mode": "trace", "trace_depths": [1, 2, 1, 1, 2, 1, 2, 1]}
    check_cached_equals_recompute(
        nanbeige, PROMPTS[1], 8, kv_policy="last_exited", recompute_policy="last_exited", **trace
    )


# --------------------------------------------------------------------------- KV policies


def test_policies_equal_full_depth_at_threshold_one(ouro):
    expected = VECTORS["cases"]["ouro_full_depth"]
    for i in (0, 1, 4):
        ref = ouro.generate(PROMPTS[i], 16)
        for policy in ("last_exited", "ring:4", "ring:6"):
            out = ouro.generate(PROMPTS[i], 16, kv_policy=policy)
            assert out.tokens == expected["tokens"][i], policy
            assert out.exit_depths == [4] * 16
            for a, b in zip(out.logits, ref.logits):
                assert torch.equal(a, b)


def test_shared_and_ring_policies(ouro, huginn):
    prompt = PROMPTS[1]
    for ref in (ouro, huginn):
        shared = ref.generate(prompt, 8, kv_policy="shared", exit_threshold=0.5)
        again = ref.generate(prompt, 8, kv_policy="shared", exit_threshold=0.5)
        ring1 = ref.generate(prompt, 8, kv_policy="ring:1", exit_threshold=0.5)
        full = ref.generate(prompt, 8, kv_policy="full", exit_threshold=0.5)
        assert shared.tokens == again.tokens == ring1.tokens
        for a, b, c in zip(shared.logits, again.logits, ring1.logits):
            assert torch.equal(a, b) and torch.equal(a, c)
        # The prompt is full depth under every policy: the first token is the same.
        assert shared.exit_depths[0] == full.exit_depths[0]
        torch.testing.assert_close(shared.logits[0], full.logits[0], atol=1e-5, rtol=1e-5)
        # Decode tokens read stale versions at shallow depths: later logits differ.
        assert any(not torch.allclose(a, b, atol=1e-4) for a, b in zip(shared.logits, full.logits))


def test_prompt_chunks_matter_where_a_chunk_reads_last_versions(ouro, huginn):
    prompt, starts = PROMPTS[1], [0, 3, 5]
    assert len(prompt) > 6
    for ref in (ouro, huginn):
        for policy in ("full", "last_exited"):  # a plane per depth: chunks change nothing
            whole = ref.generate(prompt, 4, kv_policy=policy, exit_threshold=0.5)
            chunked = ref.generate(
                prompt, 4, kv_policy=policy, exit_threshold=0.5, prompt_chunks=starts
            )
            assert (chunked.tokens, chunked.exit_depths) == (whole.tokens, whole.exit_depths)
            # (Float32 rounding only: other matrix shapes.)
            torch.testing.assert_close(
                chunked.prompt_logits, whole.prompt_logits, atol=5e-4, rtol=1e-4
            )
        whole = ref.generate(prompt, 4, kv_policy="shared", prompt_chunks=[0])
        chunked = ref.generate(prompt, 4, kv_policy="shared", prompt_chunks=starts)
        # The first chunk reads only itself; later ones read its last versions at every loop.
        torch.testing.assert_close(
            chunked.prompt_logits[:3], whole.prompt_logits[:3], atol=5e-4, rtol=1e-4
        )
        assert not torch.allclose(chunked.prompt_logits[3:], whole.prompt_logits[3:], atol=1e-3)
    for bad in ([1], [0, 0], [0, len(prompt)], [0, 4, 2]):
        with pytest.raises(ValueError, match="prompt_chunks"):
            ouro.generate(prompt, 2, prompt_chunks=bad)


def test_last_exited_vs_full_with_early_exit(ouro):
    differs = False
    for prompt in PROMPTS:
        full = ouro.generate(prompt, 12, kv_policy="full", exit_threshold=0.5)
        le = ouro.generate(prompt, 12, kv_policy="last_exited", exit_threshold=0.5)
        le2 = ouro.generate(prompt, 12, kv_policy="last_exited", exit_threshold=0.5)
        assert le.tokens == le2.tokens and le.exit_depths == le2.exit_depths
        assert le.tokens[0] == full.tokens[0] and le.exit_depths[0] == full.exit_depths[0]
        torch.testing.assert_close(le.logits[0], full.logits[0], atol=1e-6, rtol=1e-6)
        # Identical until a decode token exits before the last depth.
        for k in range(1, 12):
            if le.tokens[k] != full.tokens[k]:
                break
            if k == 1 or min(le.exit_depths[1:k]) == 4:
                torch.testing.assert_close(le.logits[k], full.logits[k], atol=1e-5, rtol=1e-5)
            else:
                differs = differs or not torch.allclose(le.logits[k], full.logits[k], atol=1e-4)
    assert differs


def test_kv_policy_parsing():
    assert parse_kv_policy("full", 4) == ("full", 4)
    assert parse_kv_policy("last_exited", 6) == ("last_exited", 6)
    assert parse_kv_policy("shared", 4) == ("shared", 1)
    assert parse_kv_policy("ring:3", 8) == ("ring", 3)
    assert [plane_of("ring", 3, d) for d in range(1, 8)] == [0, 1, 2, 0, 1, 2, 0]
    assert [plane_of("last_exited", 4, d) for d in range(1, 5)] == [0, 1, 2, 3]
    for bad in ("ring:0", "ring:x", "paged"):
        with pytest.raises(ValueError):
            parse_kv_policy(bad, 4)


# --------------------------------------------------------------------------- exit rule


def test_exit_rule_hand_made_gates():
    zeros = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]  # lam = 1/2: CDF 0.5, 0.75, 0.875, 0.9375 (exact)

    def depth(gates=zeros, **kw):
        return exit_depth_from_gates(gates, **{"cap": 4, **kw})

    assert depth() == 4  # threshold 1.0: fixed depth
    assert depth(exit_threshold=1.5) == 4
    assert depth(cap=2) == 2
    assert depth(cap=6, exit_threshold=0.97) == 6
    assert depth(exit_threshold=0.5) == 1
    assert depth(exit_threshold=0.75) == 2  # CDF >= q, equality counts
    assert depth(exit_threshold=0.76) == 3
    assert depth(exit_threshold=0.9) == 4
    assert depth(exit_threshold=0.95) == 4  # cap forces the exit
    assert depth(exit_threshold=0.5, min_loops=3) == 3
    assert depth(exit_threshold=0.5, min_loops=9) == 4
    assert depth(exit_threshold=0.5, cap=1) == 1
    # Delayed: the same decision one loop later, capped.
    assert depth(exit_mode="delayed", exit_threshold=0.5) == 2
    assert depth(exit_mode="delayed", exit_threshold=0.76) == 4
    assert depth(exit_mode="delayed", exit_threshold=0.76, cap=3) == 3
    assert depth(exit_mode="delayed", exit_threshold=0.5, min_loops=2) == 3
    assert depth(exit_mode="delayed") == 4
    # Trace: replay, clamped to [1, cap].
    assert depth(exit_mode="trace", trace_depth=2, exit_threshold=0.5) == 2
    assert depth(exit_mode="trace", trace_depth=0) == 1
    assert depth(exit_mode="trace", trace_depth=9) == 4
    # Survival matters: lam = sigmoid(-3) ~ 0.047, then sigmoid(3) ~ 0.953 of what is left.
    g = [-3.0, 3.0, -3.0, 0.0]
    lam = [1 / (1 + math.exp(-x)) for x in g]
    cdf2 = lam[0] + (1 - lam[0]) * lam[1]
    assert depth(g, exit_threshold=cdf2 - 1e-4) == 2
    assert lam[2] * (1 - cdf2) > 1e-3
    assert depth(g, exit_threshold=cdf2 + 1e-4) == 3
    assert depth(g, exit_threshold=0.04) == 1
    # Models without a gate: fixed depth at the cap (or the trace).
    assert exit_depth_from_gates(None, cap=3, exit_threshold=0.1) == 3
    assert exit_depth_from_gates(None, cap=3, exit_mode="delayed", exit_threshold=0.1) == 3
    assert exit_depth_from_gates(None, cap=3, exit_mode="trace", trace_depth=2) == 2


def test_exit_rule_cdf_matches_cumsum():
    g = torch.tensor([0.3, -1.2, 2.5, 0.7])
    rule = ExitRule("gate", 4)
    for t in range(4):
        rule.update(t + 1, g[t])
    lam = torch.sigmoid(g)
    pdf, s = [], torch.ones(())
    for t in range(3):
        pdf.append(lam[t] * s)
        s = s * (1.0 - lam[t])
    pdf.append(s)
    cdf = torch.cumsum(torch.stack(pdf), 0)
    assert rule.cdfs[:3] == cdf[:3].tolist()
    assert rule.gate_logits == g.tolist()


def _exit_by_hand(gates: list[float], q: float, cap: int) -> tuple[int, list[float]]:
    """First depth whose CDF (sum of lam_t * prod_{i<t} (1 - lam_i), float64) reaches q."""
    cdf, survival, cdfs = 0.0, 1.0, []
    for t, g in enumerate(gates[:cap], start=1):
        lam = 1.0 / (1.0 + math.exp(-g))
        cdf, survival = cdf + lam * survival, survival * (1.0 - lam)
        cdfs.append(cdf)
        if cdf >= q:
            return t, cdfs
    return cap, cdfs


def test_gate_values_reported(ouro):
    prompt = PROMPTS[0]
    out = ouro.generate(prompt, 6, kv_policy="last_exited", exit_threshold=0.5)
    # The reported gate logits, checked against a whole-sequence recompute (a different
    # computation path), and the exit depths against the CDF rule written out by hand.
    seq = prompt + out.tokens[:-1]
    exits = decode_exits(len(prompt), 4, out.exit_depths, len(seq))
    whole = ouro.full_recompute(seq, exits, prompt_len=len(prompt), kv_policy="last_exited")
    for k, (e, gates, cdfs) in enumerate(zip(out.exit_depths, out.gate_logits, out.cdfs)):
        pos = len(prompt) - 1 + k
        assert gates == pytest.approx(whole.gate_logits[: len(gates), pos].tolist(), abs=1e-4)
        want_e, want_cdfs = _exit_by_hand(gates, 0.5, 4)
        assert e == want_e, f"token {k}"
        assert cdfs[:e] == pytest.approx(want_cdfs[:e], abs=1e-6)
    full = ouro.generate(prompt, 6)
    assert all(len(g) == 4 for g in full.gate_logits)


def test_delayed_is_gate_plus_one(ouro):
    for prompt in PROMPTS[:3]:
        out = ouro.generate(prompt, 8, exit_mode="delayed", exit_threshold=0.5, kv_policy="full")
        for e, gates in zip(out.exit_depths, out.gate_logits):
            assert e == min(exit_depth_from_gates(gates, cap=4, exit_threshold=0.5) + 1, 4)


# --------------------------------------------------------------------------- zero-shot criteria


def test_criterion_values_by_hand():
    v = 8
    logits = torch.tensor([2.0, 1.0, 0.0, 0.0, -1.0, 0.5, 0.25, 3.0])
    p = torch.softmax(logits, -1)
    state = torch.ones(1, 4)
    kl = Criterion("kl", 5e-4, v, state)
    # From the uniform: KL(U || p) = -log V - mean(log p); the same distribution again: 0.
    assert not kl.below(state, logits)
    assert kl.values[0] == pytest.approx(-math.log(v) - float(p.log().mean()), rel=1e-5)
    assert kl.below(state, logits) and abs(kl.values[1]) < 1e-6
    ent = Criterion("entropy-diff", 1e-3, v, state)
    h = float(-(p * p.log()).sum())
    assert not ent.below(state, logits) and ent.values[0] == pytest.approx(100 - h, rel=1e-5)
    assert ent.below(state, logits)
    lat = Criterion("latent-diff", 0.6, v, state)
    assert lat.below(2 * state, None) and lat.values[0] == pytest.approx(0.5)  # |s - 2s| / |2s|
    assert not lat.below(8 * state, None)  # |2s - 8s| / |8s| = 0.75
    minp = Criterion("minp-kl", 1e-6, v, state)
    minp.below(state, logits)
    floored = torch.where(p < 0.1 * p.max(), torch.tensor(1 / v), p)
    floored = floored / floored.sum()
    want = float((torch.full((v,), 1 / v) * (math.log(1 / v) - floored.log())).sum())
    assert minp.values[0] == pytest.approx(want, rel=1e-5)
    # argmax-stability counts the loops in a row whose argmax is the loop before's (Hugging
    # Face starts from -1: 0 at loop 1) and exits when the count reaches the threshold.
    stable = Criterion("argmax-stability", 2, v, state)
    other = logits.flip(0)
    flags = [stable.below(state, x) for x in (logits, logits, other, other, other, other)]
    assert stable.values == [0, 1, 0, 1, 2, 3] and flags == [False] * 4 + [True] * 2


@pytest.mark.parametrize("criterion", ["kl", "minp-kl", "entropy-diff", "latent-diff"])
@pytest.mark.parametrize("kv_policy", ["full", "last_exited"])
def test_criterion_exits_replay_as_a_trace(huginn, criterion, kv_policy):
    """The exits a criterion picks, replayed as a trace, give the same tokens and logits: the
    codas a criterion runs at every loop leave each position's coda K/V its exit's."""
    threshold = {"kl": 0.999, "minp-kl": 0.63, "entropy-diff": 0.6, "latent-diff": 0.97}[criterion]
    depths = []
    for prompt in PROMPTS:
        kw = {"kv_policy": kv_policy, "init_state": "zero"}
        out = huginn.generate(prompt, 8, exit_threshold=threshold, exit_criterion=criterion, **kw)
        assert out.exit_depths[0] == huginn.num_loops  # the prompt never exits early
        traced = huginn.generate(prompt, 8, exit_mode="trace", trace_depths=out.exit_depths, **kw)
        assert traced.tokens == out.tokens
        assert all(torch.equal(a, b) for a, b in zip(traced.logits, out.logits))
        depths += out.exit_depths
    assert min(depths) < huginn.num_loops  # (the thresholds make tokens exit early)


def test_criterion_delayed_exits_one_loop_later(huginn):
    for prompt in PROMPTS[:3]:
        kw = {"exit_threshold": 0.6, "exit_criterion": "entropy-diff", "init_state": "zero"}
        now = huginn.generate(prompt, 8, kv_policy="full", **kw)
        late = huginn.generate(prompt, 8, kv_policy="full", exit_mode="delayed", **kw)
        # Under ``full`` every token runs every loop, so the values (and a token's decision)
        # are the same until the first token whose exit moved changes what follows.
        for a, b in zip(now.exit_depths[1:], late.exit_depths[1:]):
            assert b == min(a + 1, huginn.num_loops)
            if b != a:
                break


# --------------------------------------------------------------------------- misc semantics


def test_stop_tokens_and_trace(ouro):
    expected = VECTORS["cases"]["ouro_full_depth"]["tokens"][0]
    out = ouro.generate(PROMPTS[0], 16, stop_token_ids=(expected[3],))
    assert out.tokens == expected[: expected.index(expected[3]) + 1]
    assert ouro.generate(PROMPTS[0], 0).tokens == []
    out = ouro.generate(PROMPTS[0], 5, exit_mode="trace", trace_depths=[0, 2, 9, 3, 1])
    assert out.exit_depths == [1, 2, 4, 3, 1]
    with pytest.raises(ValueError):
        ouro.generate(PROMPTS[0], 5, exit_mode="trace", trace_depths=[1, 2])


def test_huginn_random_state_is_seeded(huginn):
    a = huginn.generate(PROMPTS[0], 4, init_state="random", seed=5)
    b = huginn.generate(PROMPTS[0], 4, init_state="random", seed=5)
    c = huginn.generate(PROMPTS[0], 4, init_state="random", seed=6)
    z = huginn.generate(PROMPTS[0], 4, init_state="zero")
    assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
    assert not torch.equal(a.logits[0], c.logits[0])
    assert not torch.equal(a.logits[0], z.logits[0])
    with pytest.raises(ValueError):
        huginn.generate(PROMPTS[0], 4, init_state="random")


def test_bfloat16_runs(ckpt_dirs, ouro):
    ref = Reference.load(ckpt_dirs["ouro"], dtype=torch.bfloat16)
    out = ref.generate(PROMPTS[0], 4, exit_threshold=0.5)
    assert len(out.tokens) == 4 and all(x.dtype == torch.float32 for x in out.logits)
    # The first token's logits are the float32 oracle's within bf16 rounding.
    want = ouro.generate(PROMPTS[0], 1, exit_threshold=0.5).logits[0]
    assert torch.allclose(out.logits[0], want, rtol=0, atol=0.05 * float(want.abs().max()))
