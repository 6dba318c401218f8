"""Model families against the Hugging Face vectors, through the naive generate loop."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from builders import (
    HUGINN_0125,
    NANBEIGE_4_2_3B,
    OURO_1_4B,
    OURO_2_6B,
    real_spec,
)
from recipe import build_huginn_rv1, build_nanbeige, build_ouro_rv1, load_vectors, tensor_sums
from reference import Reference

from rltserve.models import LoopedModel, get_family, load_model, supported_model_types
from rltserve.models.layers import (
    RotaryAttention,
    apply_rope_interleaved,
    apply_rope_rotate_half,
    linear,
    rms_norm,
    rope_cos_sin,
    silu_and_mul,
)
from rltserve.models.naive import DenseKVCache, dense_causal_attention, naive_generate
from rltserve.models.ouro import OuroConfig

VECTORS = load_vectors()
PROMPTS: list[list[int]] = VECTORS["prompts"]
OURO_CASES = {
    "ouro_full_depth": {},
    "ouro_threshold_0.5": {"exit_threshold": 0.5, "min_loops": 1},
    "ouro_threshold_0.3": {"exit_threshold": 0.3, "min_loops": 1},
    "ouro_exit_at_depth_2": {"max_loops": 2},
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "ouro": build_ouro_rv1(root / "ouro"),
        "huginn": build_huginn_rv1(root / "huginn"),
        "nanbeige": build_nanbeige(root / "nanbeige"),
    }


@pytest.fixture(scope="module")
def models(dirs) -> dict[str, LoopedModel]:
    return {name: load_model(path) for name, path in dirs.items()}


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_rv1_build_matches_recipe_sums(dirs, family):
    expected = VECTORS["tensor_sums"][family]
    got = tensor_sums(dirs[family])
    assert set(expected) <= set(got)
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, abs=1e-5), name


@pytest.mark.parametrize("case", sorted(OURO_CASES))
def test_ouro_reproduces_hf_vectors(models, case):
    expected = VECTORS["cases"][case]
    for i, prompt in enumerate(PROMPTS):
        n = len(expected["tokens"][i])
        tokens, depths = naive_generate(models["ouro"], prompt, n, **OURO_CASES[case])
        assert tokens == expected["tokens"][i], (case, i)
        assert depths == expected["exit_depths"][i], (case, i)


def test_huginn_reproduces_hf_vectors(models):
    expected = VECTORS["cases"]["huginn_4_loops_zero_state"]
    for i, prompt in enumerate(PROMPTS):
        n = len(expected["tokens"][i])
        tokens, depths = naive_generate(models["huginn"], prompt, n, max_loops=4, seed=None)
        assert tokens == expected["tokens"][i], i
        assert depths == [4] * n


def _cached_and_recomputed_logits(
    model: LoopedModel, ids: list[int], prompt_len: int, depth: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Final-depth logits of positions prompt_len-1.. two ways: prompt in one call per depth then
    one token per call on one cache, and the whole sequence in one call per depth."""

    def run(cache: DenseKVCache, chunk: list[int], start: int) -> torch.Tensor:
        pos = torch.arange(start, start + len(chunk))
        e = model.prelude(torch.tensor(chunk), pos, cache.attn(None, start))
        s = model.initial_state(e, None)
        for d in range(depth):
            s = model.loop(s, e, pos, cache.attn(d, start))
        return model.logits(model.coda(s, pos, cache.attn(None, start)))

    with torch.inference_mode():
        cache = DenseKVCache(model, len(ids))
        cached = [run(cache, ids[:prompt_len], 0)[-1]]
        cached += [run(cache, [t], p)[0] for p, t in enumerate(ids) if p >= prompt_len]
        full = run(DenseKVCache(model, len(ids)), ids, 0)[prompt_len - 1 :]
    return torch.stack(cached), full


@pytest.mark.parametrize("family", ["ouro", "huginn", "nanbeige"])
def test_cached_decode_equals_full_recompute(models, family):
    model = models[family]
    ids = [7, 100, 3, 250, 42, 9, 300, 17, 5, 77, 1]
    for depth in (1, model.spec.num_loops):
        cached, full = _cached_and_recomputed_logits(model, ids, 4, depth)
        torch.testing.assert_close(cached, full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kw", [{}, {"exit_threshold": 0.4}, {"max_loops": 3}])
def test_naive_generate_equals_oracle_and_token_by_token_recompute(dirs, models, kw):
    for family in ("ouro", "nanbeige"):
        model = models[family]
        prompt = PROMPTS[1]
        tokens, depths = naive_generate(model, prompt, 8, **kw)
        want = Reference.load(dirs[family]).generate(prompt, 8, kv_policy="full", **kw)
        assert (tokens, depths) == (want.tokens, want.exit_depths), family
        # Under the full policy a decode token's KV equals a fresh prefill's.
        seq = list(prompt)
        for tok, depth in zip(tokens[:3], depths):
            assert naive_generate(model, seq, 1, **kw) == ([tok], [depth])
            seq.append(tok)


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "kw", "match"),
    [
        ([], 1, {}, "prompt_ids: must not be empty"),
        ([5], 0, {}, "max_tokens=0: must be >= 1"),
        ([5], 1, {"min_loops": 0}, "min_loops=0: must be >= 1"),
        ([5], 1, {"max_loops": -1}, r"max_loops=-1: must be in \[1, 8\]"),
        ([5], 1, {"max_loops": 9}, r"max_loops=9: must be in \[1, 8\]"),
        ([5] * 511, 3, {}, "prompt \\+ max_tokens - 1 = 513 exceeds 512"),
    ],
)
def test_naive_generate_rejects_bad_arguments(models, prompt, max_tokens, kw, match):
    with pytest.raises(ValueError, match=match):
        naive_generate(models["ouro"], prompt, max_tokens, **kw)


def test_naive_generate_accepts_arguments_at_their_bounds(models):
    model = models["ouro"]
    assert naive_generate(model, [5], 1, max_loops=8)[1] == [8]
    tokens, depths = naive_generate(model, [5] * 511, 2, max_loops=1)  # fills all 512 positions
    assert len(tokens) == 2 and depths == [1, 1]


def test_threshold_one_never_exits_early_even_when_the_gate_saturates(models, monkeypatch):
    # sigmoid(40) is exactly 1.0 in fp32, so the CDF reaches 1.0 at loop 1; threshold 1.0 still
    # means "adaptive exit off" (MODELS.md), unlike any threshold below it.
    model = models["ouro"]
    monkeypatch.setattr(model, "exit_logit", lambda s: torch.full(s.shape[:1], 40.0))
    assert naive_generate(model, PROMPTS[0], 3, exit_threshold=1.0)[1] == [4, 4, 4]
    assert naive_generate(model, PROMPTS[0], 3, exit_threshold=0.99)[1] == [1, 1, 1]


def test_nanbeige_runs(models):
    model = models["nanbeige"]
    assert model.spec.head_dim == 32 and model.spec.num_kv_heads == 2
    tokens, depths = naive_generate(model, PROMPTS[0], 10)
    assert len(tokens) == 10 and depths == [2] * 10
    # no gate: a threshold is ignored and depth is the cap
    assert naive_generate(model, PROMPTS[0], 10, exit_threshold=0.1) == (tokens, depths)
    assert naive_generate(model, PROMPTS[0], 4, max_loops=3)[1] == [3] * 4


def test_specs(models):
    ouro, huginn, nanbeige = models["ouro"].spec, models["huginn"].spec, models["nanbeige"].spec
    assert (ouro.num_loops, ouro.max_loops, ouro.has_gate, ouro.needs_noise) == (4, 8, True, False)
    assert ouro.eos_token_ids == (0, 2) and ouro.bos_token_id == 0
    assert (ouro.num_heads, ouro.num_kv_heads, ouro.head_dim) == (4, 2, 16)
    assert (ouro.num_core_layers, ouro.num_boundary_layers, ouro.max_position) == (2, 0, 512)
    assert (huginn.num_loops, huginn.max_loops, huginn.needs_noise) == (4, 256, True)
    assert (huginn.num_core_layers, huginn.num_boundary_layers) == (2, 4)
    assert huginn.eos_token_ids == (353,) and huginn.pad_token_id == 357
    assert (huginn.vocab_size, huginn.max_position) == (384, 256)
    assert (nanbeige.num_loops, nanbeige.max_loops, nanbeige.has_gate) == (2, 4, False)
    assert nanbeige.eos_token_ids == (381,)
    assert models["nanbeige"].exit_logit(torch.zeros(3, 64)) is None
    assert models["ouro"].exit_logit(torch.zeros(3, 64)).dtype == torch.float32


def test_real_checkpoint_specs():
    """Specs of the real configs, built on the meta device (no weights)."""
    o14, o26 = real_spec(OURO_1_4B), real_spec(OURO_2_6B)
    assert (o14.num_core_layers, o26.num_core_layers, o14.head_dim, o26.head_dim) == (
        24,
        48,
        128,
        128,
    )
    assert o14.eos_token_ids == (0, 2) and o14.num_kv_heads == 16 and o14.max_position == 65536
    h = real_spec(HUGINN_0125)
    assert (h.num_loops, h.max_loops, h.head_dim, h.num_heads, h.max_position) == (
        32,
        256,
        96,
        55,
        4096,
    )
    assert (h.num_core_layers, h.num_boundary_layers) == (4, 4)
    assert h.eos_token_ids == (65505, 65508, 65504) and h.bos_token_id == 65504
    n = real_spec(NANBEIGE_4_2_3B)
    assert (n.num_loops, n.head_dim, n.num_heads, n.num_kv_heads) == (2, 128, 48, 8)
    assert n.eos_token_ids == (166101,) and n.vocab_size == 166144


def test_ouro_chat_stop_ids_outside_a_tiny_vocabulary_are_dropped():
    spec = real_spec({**VECTORS["configs"]["ouro"], "vocab_size": 2})
    assert spec.eos_token_ids == (0,)


def test_huginn_noise_is_seeded_per_position(models):
    model = models["huginn"]
    a = model.draw_noise(11, [0, 1, 2, 3])
    assert a.shape == (4, 64) and a.dtype == torch.float32
    torch.testing.assert_close(model.draw_noise(11, [2, 3]), a[2:], rtol=0, atol=0)
    assert not torch.equal(model.draw_noise(12, [0]), a[:1])
    assert torch.count_nonzero(model.draw_noise(None, [0, 1])) == 0
    cfg = model.config
    assert a.abs().max() <= 3 * cfg.init_std * cfg.embed_scale + 1e-6
    seeded = naive_generate(model, PROMPTS[1], 6, seed=11)
    assert seeded == naive_generate(model, PROMPTS[1], 6, seed=11)
    assert seeded[0] != naive_generate(model, PROMPTS[1], 6)[0]


def _trunc_normal_by_rejection(seed: int, width: int, std: float, scale: float) -> torch.Tensor:
    """MODELS.md's state draw written out independently: standard normals from the seeded
    generator, each value outside [-3, 3] replaced by the same entry of a fresh whole-width draw
    until none is (torch 2.13's trunc_normal_ for a mass above 0.3), times std and embed scale."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(width, generator=g, dtype=torch.float32).double()
    while bool((z.abs() > 3).any()):
        fresh = torch.randn(width, generator=g, dtype=torch.float32).double()
        z = torch.where(z.abs() > 3, fresh, z)
    return z * std * scale


@pytest.mark.parametrize("seed,position", [(11, 0), (11, 5), (0, 3), (123456, 77)])
def test_huginn_random_state_pinned_to_the_formula(dirs, models, seed, position):
    # Per-position seed: seed * 1_000_003 + position (mod 2**63), written as literals here so a
    # shared mistake in the engine's and the oracle's seeding cannot pass.
    generator_seed = {(11, 0): 11000033, (11, 5): 11000038, (0, 3): 3, (123456, 77): 123456370445}
    cfg = VECTORS["configs"]["huginn"]
    std, scale = cfg["init_values"]["std"], cfg["init_values"]["embed_scale"]
    want = _trunc_normal_by_rejection(generator_seed[(seed, position)], 64, std, scale)
    engine = models["huginn"].draw_noise(seed, [position])[0].double()
    torch.testing.assert_close(engine, want, rtol=0, atol=1e-5 * scale)
    oracle = Reference.load(dirs["huginn"])
    e = torch.zeros(1, 64)
    got = oracle._initial_state(e, position, "random", seed)[0].double()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * scale)


def test_huginn_random_state_statistics(models):
    # MODELS.md: trunc-normal(std, +-3 std) times embed_scale; a truncated unit normal has
    # std sqrt(1 - 6 phi(3) / (2 Phi(3) - 1)) = 0.98658.
    model, cfg = models["huginn"], VECTORS["configs"]["huginn"]
    std, scale = cfg["init_values"]["std"], cfg["init_values"]["embed_scale"]
    x = model.draw_noise(5, list(range(400))).double()  # 25,600 values
    assert abs(float(x.mean())) < 0.03 * std * scale
    assert float(x.std()) == pytest.approx(0.98658 * std * scale, rel=0.02)
    assert float(x.abs().max()) <= 3 * std * scale * (1 + 1e-6)


def test_bfloat16_models_run(dirs, models):
    g = torch.Generator().manual_seed(3)
    for family, path in dirs.items():
        model = load_model(path, dtype="bfloat16")
        tokens, _ = naive_generate(model, PROMPTS[0], 4)
        assert len(tokens) == 4 and all(0 <= t < model.spec.vocab_size for t in tokens)
        hidden = torch.randn(2, model.spec.hidden_size, generator=g)
        got = model.logits(hidden.bfloat16())
        assert got.dtype == torch.float32
        # bf16 weights and inputs: within bf16 rounding of the float32 head.
        want = models[family].logits(hidden)
        assert torch.allclose(got, want, rtol=0, atol=0.05 * float(want.abs().max())), family


# --------------------------------------------------------------------------- configs


def test_huginn_zero_init_std_draws_the_zero_state_for_any_seed():
    raw = dict(VECTORS["configs"]["huginn"])
    raw["init_values"] = {**raw["init_values"], "std": 0}
    family = get_family("huginn_raven")
    with torch.device("meta"):
        model = family.model_cls(family.parse_config(raw))
    noise = model.draw_noise(7, [0, 1, 2])
    assert noise.shape == (3, 64) and torch.count_nonzero(noise) == 0


def test_noise_seed_wraps_into_63_bits():
    from rltserve.models import noise_seed

    # Literal values: the engine and the oracle share noise_seed, so only literals pin it.
    assert noise_seed(2**62, 1) == 2**62 + 1
    assert noise_seed(2**63 - 1, 0) == 2**63 - 1_000_003
    assert noise_seed(5, 2**63) == 5_000_015


def test_registry():
    assert supported_model_types() == ["huginn_raven", "nanbeige", "ouro"]
    assert get_family("ouro").config_cls is OuroConfig
    with pytest.raises(ValueError, match="huginn_raven, nanbeige, ouro"):
        get_family("llama")


# transformers 5 writes plain RoPE as ``rope_parameters`` and no rope_theta / rope_scaling keys.


# --------------------------------------------------------------------------- layers


def test_rms_norm_order():
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    w = torch.randn(8, dtype=torch.bfloat16)
    xf = x.float()
    want = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    assert torch.equal(rms_norm(x, w, 1e-6), want)


def test_rope_forms():
    pos = torch.tensor([0, 1, 5, 77])
    x = torch.randn(4, 3, 16)
    cos, sin = rope_cos_sin(pos, 16, 10000.0)
    assert cos.dtype == torch.float32 and cos.shape == (4, 8)
    torch.testing.assert_close(cos[:, 1], torch.cos(pos.float() * 10000.0 ** (-2 / 16)))
    # interleaved == complex multiplication of adjacent pairs by exp(i * angle)
    rot = torch.polar(torch.ones_like(cos), torch.atan2(sin, cos))[:, None, :]
    want = torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * rot).flatten(-2)
    torch.testing.assert_close(apply_rope_interleaved(x, cos, sin), want)
    # rotate-half == the interleaved form on a de-interleaved layout
    perm = torch.cat((torch.arange(0, 16, 2), torch.arange(1, 16, 2)))
    inter = apply_rope_interleaved(x, cos, sin)
    torch.testing.assert_close(apply_rope_rotate_half(x[..., perm], cos, sin), inter[..., perm])
    # position 0 is the identity in both forms
    assert torch.equal(apply_rope_rotate_half(x[:1], cos[:1], sin[:1]), x[:1])
    assert torch.equal(apply_rope_interleaved(x[:1], cos[:1], sin[:1]), x[:1])


def test_rope_rotate_half_rotates_in_the_model_dtype():
    # MODELS.md: cos/sin are cast to the model dtype and the rotation runs in it (HF's order),
    # which rounds differently from rotating in fp32 and casting back.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 16, generator=g).bfloat16()
    cos, sin = rope_cos_sin(torch.arange(64) * 37, 16, 10000.0)
    c = torch.cat((cos, cos), -1).bfloat16()[:, None, :]
    s = torch.cat((sin, sin), -1).bfloat16()[:, None, :]
    rotated = torch.cat((-x[..., 8:], x[..., :8]), dim=-1)
    got = apply_rope_rotate_half(x, cos, sin)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, x * c + rotated * s)


@pytest.mark.parametrize(("rows", "out"), [(1, 64), (1, 5000), (2, 5000), (512, 64), (513, 64)])
def test_linear_equals_f_linear_on_every_cpu_path(rows, out):
    g = torch.Generator().manual_seed(rows + out)
    x, w = torch.randn(rows, 32, generator=g), torch.randn(out, 32, generator=g)
    got = linear(x, w)
    assert got.shape == (rows, out) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_rotary_attention_rejects_heads_that_kv_heads_do_not_divide():
    with pytest.raises(ValueError, match="num_heads=4 is not a multiple of num_kv_heads=3"):
        RotaryAttention(64, 4, 3, 16)


def test_silu_and_mul():
    x = torch.randn(5, 12)
    torch.testing.assert_close(silu_and_mul(x), F.silu(x[:, :6]) * x[:, 6:])


@pytest.mark.parametrize("q_start", [0, 3])
def test_dense_attention_matches_sdpa(q_start):
    t, n = 9, 9 - q_start
    q = torch.randn(n, 4, 16)
    k, v = torch.randn(t, 2, 16), torch.randn(t, 2, 16)
    out = dense_causal_attention(q, k, v, q_start)
    mask = torch.ones(n, t, dtype=torch.bool).tril(q_start)
    want = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(2, 1).transpose(0, 1),
        v.repeat_interleave(2, 1).transpose(0, 1),
        attn_mask=mask,
    ).transpose(0, 1)
    torch.testing.assert_close(out, want)


def test_ouro_early_exit_threshold_is_logged_once_and_not_applied(
    dirs, tmp_path, monkeypatch, caplog
):
    # Hugging Face's forward defaults its threshold to config.json's; rltserve's requests keep
    # 1.0 (full depth) and the load says so once (README, loop controls).
    from rltserve.models import ouro

    monkeypatch.setattr(ouro, "_warned_thresholds", set())
    raw = VECTORS["configs"]["ouro"]
    path = tmp_path / "eet"
    shutil.copytree(dirs["ouro"], path)
    (path / "config.json").write_text(json.dumps({**raw, "early_exit_threshold": 0.5}))
    with caplog.at_level("WARNING", logger="rltserve.models.ouro"):
        model = load_model(path)
        load_model(path)
        for value in (1.0, 2.0):  # full depth in Hugging Face too: nothing to say
            with torch.device("meta"):
                ouro.OuroModel(OuroConfig.from_dict({**raw, "early_exit_threshold": value}))
    assert model.config.early_exit_threshold == 0.5
    assert [r.getMessage() for r in caplog.records] == [
        "config.json early_exit_threshold=0.5 is not applied: requests run full depth unless "
        "they set exit_threshold (e.g. SamplingParams(exit_threshold=0.5) or the HTTP field)"
    ]
    want = VECTORS["cases"]["ouro_full_depth"]
    for i, prompt in enumerate(PROMPTS):
        tokens, depths = naive_generate(model, prompt, len(want["tokens"][i]))
        assert (tokens, depths) == (want["tokens"][i], want["exit_depths"][i])
