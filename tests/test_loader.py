"""The strict safetensors loader and every family's checkpoint layout."""

from __future__ import annotations

import json
import math
import os
import re

import pytest
import torch
from builders import (
    HUGINN_0125,
    NANBEIGE_4_2_3B,
    OURO_1_4B,
    OURO_2_6B,
    TINY_CONFIGS,
    build_tiny,
    random_tensors,
    write_checkpoint,
)
from recipe import huginn_shapes, ouro_shapes
from safetensors.torch import load_file

from rltserve.models import CheckpointError, get_family, load_model, read_config
from rltserve.models.huginn import HuginnModel
from rltserve.models.naive import naive_generate

CONFIGS = TINY_CONFIGS


def shapes_of(cfg: dict) -> dict[str, tuple[int, ...]]:
    return get_family(cfg["model_type"]).tensor_shapes(cfg)


build = build_tiny


def test_layouts_match_independent_tables():
    # recipe.py spells out the real names independently of rltserve
    for cfg in (CONFIGS["ouro"], OURO_1_4B, OURO_2_6B):
        assert shapes_of(cfg) == ouro_shapes(cfg)
    for cfg in (CONFIGS["huginn_raven"], HUGINN_0125):
        assert shapes_of(cfg) == huginn_shapes(cfg)


@pytest.mark.parametrize(
    ("cfg", "params", "examples"),
    [
        (
            OURO_1_4B,
            1_434_652_673,
            {
                "model.layers.23.self_attn.q_proj.weight": (2048, 2048),
                "lm_head.weight": (49152, 2048),
            },
        ),
        (OURO_2_6B, 2_667_974_657, {"model.layers.47.mlp.down_proj.weight": (2048, 5632)}),
        (
            HUGINN_0125,
            3_564_976_800,
            {
                "transformer.core_block.3.attn.Wqkv.weight": (15840, 5280),
                "transformer.coda.1.attn.qk_bias": (2, 1, 55, 96),
                "transformer.adapter.weight": (5280, 10560),
                "freqs_cis": (1, 4096, 1, 48, 2),
            },
        ),
        (
            NANBEIGE_4_2_3B,
            4_169_800_704,
            {
                "model.layers.21.self_attn.q_proj.weight": (6144, 3072),
                "model.layers.0.self_attn.k_proj.weight": (1024, 3072),
                "model.layers.0.self_attn.o_proj.weight": (3072, 6144),
                "lm_head.weight": (166144, 3072),
            },
        ),
    ],
)
def test_real_layouts(cfg, params, examples):
    """Parameter counts from MODELS.md (Huginn: without the duplicate head and freqs_cis)."""
    shapes = shapes_of(cfg)
    family = get_family(cfg["model_type"])
    skip = set(family.tied) | set(family.buffers)
    assert sum(math.prod(s) for n, s in shapes.items() if n not in skip) == params
    for name, shape in examples.items():
        assert shapes[name] == shape
    sources = [s for group in family.param_sources(cfg).values() for s in group]
    assert sorted(sources) == sorted(set(shapes) - skip)  # every tensor feeds exactly one param


def required_names(cfg: dict) -> list[str]:
    """The tensors a checkpoint must hold: all but tied copies and buffers (Huginn's)."""
    family = get_family(cfg["model_type"])
    return sorted(set(shapes_of(cfg)) - set(family.tied) - set(family.buffers))


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_every_missing_tensor_is_reported(tmp_path, family):
    cfg = CONFIGS[family]
    tensors = random_tensors(cfg)
    for i, name in enumerate(required_names(cfg)):
        path = write_checkpoint(
            tmp_path / str(i), cfg, {k: v for k, v in tensors.items() if k != name}
        )
        with pytest.raises(CheckpointError, match="missing tensors") as info:
            load_model(path)
        assert f"\n    {name}" in str(info.value)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_extra_and_misshaped_tensors_in_one_error(tmp_path, family):
    cfg = CONFIGS[family]
    tensors = random_tensors(cfg)
    victim = required_names(cfg)[1]
    dropped = required_names(cfg)[0]
    tensors["model.extra.weight"] = torch.zeros(3)
    tensors[victim] = torch.zeros(*tensors[victim].shape[:-1], tensors[victim].shape[-1] + 1)
    del tensors[dropped]
    with pytest.raises(CheckpointError) as info:
        load_model(write_checkpoint(tmp_path / "bad", cfg, tensors))
    msg = str(info.value)
    assert "missing tensors (1)" in msg and dropped in msg
    assert "unexpected tensors (1)" in msg and "model.extra.weight" in msg
    assert "wrong shapes (1)" in msg and victim in msg


def test_extra_only_and_shape_only(tmp_path):
    cfg = CONFIGS["ouro"]
    tensors = random_tensors(cfg)
    with pytest.raises(CheckpointError, match=r"unexpected tensors \(1\):\n    foo"):
        load_model(write_checkpoint(tmp_path / "a", cfg, {**tensors, "foo": torch.zeros(1)}))
    bad = {**tensors, "model.norm.weight": torch.ones(65)}
    with pytest.raises(
        CheckpointError, match=r"model.norm.weight: checkpoint \[65\], expected \[64\]"
    ):
        load_model(write_checkpoint(tmp_path / "b", cfg, bad))


def test_inv_freq_dropped(tmp_path):
    cfg = CONFIGS["ouro"]
    plain = random_tensors(cfg)
    tensors = {**plain, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}
    state = load_model(write_checkpoint(tmp_path / "c", cfg, tensors)).state_dict()
    assert not any("inv_freq" in name for name in state)
    # Every real tensor still arrives, value for value.
    want = load_model(write_checkpoint(tmp_path / "d", cfg, plain)).state_dict()
    assert state.keys() == want.keys()
    assert all(torch.equal(state[k], want[k]) for k in want)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_sharded_equals_single_file(tmp_path, family):
    single = load_model(build(tmp_path, family, "single"))
    sharded = load_model(build(tmp_path, family, "sharded", shards=3))
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    a, b = single.state_dict(), sharded.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_fused_parameters_hold_checkpoint_values(tmp_path):
    path = build(tmp_path, "ouro")
    stored = load_file(str(path / "model.safetensors"))
    params = dict(load_model(path).named_parameters())
    p = "model.layers.1."
    qkv = torch.cat([stored[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
    assert torch.equal(params[p + "self_attn.qkv_proj.weight"], qkv)
    gate_up = torch.cat([stored[p + f"mlp.{x}_proj.weight"] for x in ("gate", "up")])
    assert torch.equal(params[p + "mlp.gate_up_proj.weight"], gate_up)
    assert torch.equal(params["model.early_exit_gate.bias"], stored["model.early_exit_gate.bias"])


@pytest.mark.parametrize("preadv", [True, False])
def test_weights_are_not_views_of_the_file(tmp_path, monkeypatch, preadv):
    # A trainer rewriting the served checkpoint in place must not change a loaded model (nor,
    # truncating it, kill the process with SIGBUS): only update_weights changes weights.
    if not preadv:
        monkeypatch.delattr(os, "preadv", raising=False)
    path = build(tmp_path, "ouro")
    model = load_model(path)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    file = path / "model.safetensors"
    size = file.stat().st_size
    with open(file, "r+b") as f:  # same header, every tensor byte overwritten
        start = 8 + int.from_bytes(f.read(8), "little")
        f.seek(start)
        f.write(b"\x7f" * (size - start))
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


@pytest.mark.parametrize(
    "dtype", ["float32", "bfloat16", "float16", torch.bfloat16, torch.float16, "bf16", "fp16"]
)
def test_dtype_casting(tmp_path, dtype):
    path = build(tmp_path, "nanbeige")
    model = load_model(path, dtype=dtype)
    want = {"float32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}.get(
        dtype, dtype if isinstance(dtype, torch.dtype) else torch.float16
    )
    stored = load_file(str(path / "model.safetensors"))
    for name, param in model.named_parameters():
        assert param.dtype == want and param.device.type == "cpu", name
        assert not param.requires_grad
    assert torch.equal(model.lm_head.weight, stored["lm_head.weight"].to(want))
    assert not model.training


def test_stored_bf16_cast_up(tmp_path):
    cfg = CONFIGS["ouro"]
    tensors = {k: v.to(torch.bfloat16) for k, v in random_tensors(cfg).items()}
    model = load_model(write_checkpoint(tmp_path / "bf", cfg, tensors), dtype="float32")
    assert model.lm_head.weight.dtype == torch.float32
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"].float())


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype"):
        load_model("/nonexistent", dtype="int8")


def test_huginn_tied_head(tmp_path):
    model = load_model(build(tmp_path, "huginn_raven"))
    assert isinstance(model, HuginnModel)
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names and "transformer.wte.weight" in names
    h = torch.randn(2, 64)
    torch.testing.assert_close(model.logits(h), h @ model.transformer.wte.weight.T)
    cfg = CONFIGS["huginn_raven"]
    tensors = random_tensors(cfg)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 0.01
    with pytest.raises(CheckpointError, match="lm_head.weight differs"):
        load_model(write_checkpoint(tmp_path / "untied", cfg, tensors))


@pytest.mark.parametrize(
    "left_out", [("lm_head.weight",), ("freqs_cis",), ("lm_head.weight", "freqs_cis")]
)
def test_huginn_loads_without_its_tied_head_or_rope_buffer(tmp_path, left_out):
    # (Hugging Face and vLLM loaders tie a missing head to the embedding; the model never reads
    # freqs_cis: RoPE comes from the config, huginn.freqs_cis, checked in test_presets)
    cfg = CONFIGS["huginn_raven"]
    tensors = random_tensors(cfg)
    full = load_model(write_checkpoint(tmp_path / "full", cfg, tensors))
    kept = {k: v for k, v in tensors.items() if k not in left_out}
    lean = load_model(write_checkpoint(tmp_path / "lean", cfg, kept))
    a, b = full.state_dict(), lean.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for prompt in ([5, 17, 33, 41, 9], [100, 7, 8]):
        assert naive_generate(lean, prompt, 12) == naive_generate(full, prompt, 12)


def test_tied_and_buffer_tensors_stay_optional_only_for_huginn(tmp_path):
    # Ouro and Nanbeige store an untied head: its absence is still a missing tensor.
    for family in ("ouro", "nanbeige"):
        cfg = CONFIGS[family]
        kept = {k: v for k, v in random_tensors(cfg).items() if k != "lm_head.weight"}
        with pytest.raises(CheckpointError, match=r"missing tensors \(1\):\n    lm_head.weight"):
            load_model(write_checkpoint(tmp_path / family, cfg, kept))


@pytest.mark.parametrize("family", ["ouro", "nanbeige"])
def test_a_transformers_5_config_generates_the_same_tokens(tmp_path, family):
    # transformers 5 writes rope_parameters and neither rope_theta nor rope_scaling.
    cfg = CONFIGS[family]
    tensors = random_tensors(cfg)
    tf5 = {k: v for k, v in cfg.items() if k not in ("rope_theta", "rope_scaling")}
    tf5["rope_parameters"] = {"rope_theta": cfg["rope_theta"], "rope_type": "default"}
    old = load_model(write_checkpoint(tmp_path / "tf4", cfg, tensors), dtype="float32")
    new = load_model(write_checkpoint(tmp_path / "tf5", tf5, tensors), dtype="float32")
    assert new.config == old.config
    for prompt in ([5, 17, 33, 41, 9], [100, 7, 8]):
        assert naive_generate(new, prompt, 12) == naive_generate(old, prompt, 12)


def test_rope_config_errors_name_the_file_and_both_values(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    cfg = {**CONFIGS["ouro"], "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}
    (d / "config.json").write_text(json.dumps(cfg))
    want = "config.json: ouro config: rope_theta=10000.0 and rope_parameters.rope_theta=1000000.0"
    with pytest.raises(CheckpointError, match=re.escape(want) + " disagree"):
        load_model(d)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}
    (d / "config.json").write_text(json.dumps({**CONFIGS["nanbeige"], "rope_scaling": yarn}))
    with pytest.raises(CheckpointError, match="rope_scaling=.*: rope_type 'yarn' is not supported"):
        load_model(d)


def test_non_float_tensor(tmp_path):
    cfg = CONFIGS["ouro"]
    tensors = {**random_tensors(cfg), "model.norm.weight": torch.ones(64, dtype=torch.int32)}
    with pytest.raises(CheckpointError, match="non-float"):
        load_model(write_checkpoint(tmp_path / "i", cfg, tensors))


# --------------------------------------------------------------------------- directory errors


def test_missing_and_non_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        load_model(tmp_path / "file")


def test_config_errors(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        read_config(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="invalid JSON"):
        load_model(d)
    (d / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="JSON object"):
        load_model(d)
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="'llama'.*supported: huginn_raven, nanbeige, ouro"):
        load_model(d)
    (d / "config.json").write_text(json.dumps({**CONFIGS["ouro"], "rope_scaling": {"a": 1}}))
    with pytest.raises(CheckpointError, match="rope_scaling"):
        load_model(d)
    (d / "config.json").write_text(json.dumps(CONFIGS["ouro"]))
    assert read_config(d) == CONFIGS["ouro"]
    with pytest.raises(CheckpointError, match="no .safetensors"):
        load_model(d)


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"", "truncated: 0 bytes, not even a header's length"),
        (b"\x00" * 3, "truncated: 3 bytes, not even a header's length"),
        (b"\xff" * 8 + b"{", "corrupt or unreadable safetensors"),
        (b"\x0a\x00\x00\x00\x00\x00\x00\x00{bad json}xxx", "corrupt or unreadable safetensors"),
    ],
)
def test_corrupt_safetensors(tmp_path, content, why):
    path = build(tmp_path, "ouro")
    (path / "model.safetensors").write_bytes(content)
    with pytest.raises(CheckpointError, match=re.escape(f"model.safetensors: {why}")):
        load_model(path)


def test_bad_index(tmp_path):
    path = build(tmp_path, "nanbeige", shards=2)
    index = path / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    first = next(iter(weight_map))
    index.write_text(json.dumps({"weight_map": {**weight_map, first: "model-gone.safetensors"}}))
    with pytest.raises(CheckpointError, match="shard files missing"):
        load_model(path)
    index.write_text("{}")
    with pytest.raises(CheckpointError, match="invalid index"):
        load_model(path)


def test_a_tensor_in_two_shards_is_an_error(tmp_path):
    from safetensors.torch import save_file

    path = build(tmp_path, "nanbeige", shards=2)
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    first, second = sorted(set(index.values()))
    a, b = load_file(path / first), load_file(path / second)
    name = next(iter(a))
    save_file({**b, name: a[name] + 1.0}, str(path / second))  # a conflicting second copy
    with pytest.raises(CheckpointError, match=f"{name}' is also in another file"):
        load_model(path)


def test_fused_parameter_from_mixed_stored_dtypes(tmp_path):
    # q stored in float32, k and v in bfloat16: the fused parameter is cast part by part (never
    # read as raw bytes of the target dtype).
    cfg = CONFIGS["ouro"]
    tensors = random_tensors(cfg)
    p = "model.layers.0.self_attn."
    for x in "kv":
        tensors[p + f"{x}_proj.weight"] = tensors[p + f"{x}_proj.weight"].to(torch.bfloat16)
    params = dict(load_model(write_checkpoint(tmp_path / "m", cfg, tensors)).named_parameters())
    qkv = torch.cat([tensors[p + f"{x}_proj.weight"].float() for x in "qkv"])
    assert torch.equal(params[p + "qkv_proj.weight"], qkv)


def test_model_safetensors_wins_over_other_weight_files(tmp_path):
    # With model.safetensors present, other .safetensors files (an adapter, a stray export)
    # are not part of the checkpoint.
    from safetensors.torch import save_file

    path = build(tmp_path, "nanbeige")
    save_file({"adapter.lora_A": torch.zeros(2, 2)}, str(path / "adapter_model.safetensors"))
    want = load_file(str(path / "model.safetensors"))["lm_head.weight"]
    assert torch.equal(load_model(path).lm_head.weight, want)


def test_bad_torch_dtype_is_refused_before_loading():
    from rltserve.models.loader import resolve_dtype

    assert resolve_dtype(torch.float16) is torch.float16
    for dtype in (torch.float64, torch.int8):
        with pytest.raises(ValueError, match=r"dtype=torch\.\w+: must be float32, bfloat16"):
            load_model("/nonexistent", dtype=dtype)


def test_long_listings_are_capped_at_twenty_names(tmp_path):
    cfg = CONFIGS["ouro"]
    tensors = random_tensors(cfg)
    names = sorted(tensors)
    assert len(names) > 22
    for count, more in ((20, None), (22, "    ... and 2 more")):
        kept = {k: v for k, v in tensors.items() if k not in names[:count]}
        with pytest.raises(CheckpointError) as info:
            load_model(write_checkpoint(tmp_path / str(count), cfg, kept))
        lines = str(info.value).splitlines()
        assert f"  missing tensors ({count}):" in lines
        listed = [line.strip() for line in lines if line.startswith("    ") and "..." not in line]
        assert listed == names[:20]
        assert (lines[-1] == more) if more else "more" not in str(info.value)


def test_a_tied_copy_differing_in_its_last_row_is_refused(tmp_path):
    cfg = CONFIGS["huginn_raven"]
    tensors = random_tensors(cfg)
    head = tensors["lm_head.weight"].clone()
    head[-1] += 0.01
    tensors["lm_head.weight"] = head
    with pytest.raises(CheckpointError, match="lm_head.weight differs from transformer.wte"):
        load_model(write_checkpoint(tmp_path / "untied", cfg, tensors))


def test_float64_tensors_load_cast_down(tmp_path):
    cfg = CONFIGS["ouro"]
    tensors = {k: v.double() for k, v in random_tensors(cfg).items()}
    model = load_model(write_checkpoint(tmp_path / "f64", cfg, tensors), dtype="float32")
    assert model.lm_head.weight.dtype == torch.float32
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"].float())


def test_cpu_parameters_stored_in_the_target_dtype_are_read_with_preadv(tmp_path, monkeypatch):
    # (the direct read path of the module docstring: one copy, at read bandwidth)
    if not hasattr(os, "preadv"):
        pytest.skip("no os.preadv")
    calls = []
    real = os.preadv

    def counting(*args):
        calls.append(args[0])
        return real(*args)

    monkeypatch.setattr(os, "preadv", counting)
    path = build(tmp_path, "nanbeige")
    load_model(path, dtype="float32")
    family = get_family("nanbeige")
    assert len(calls) >= len(family.param_sources(family.parse_config(CONFIGS["nanbeige"])))
    calls.clear()
    load_model(path, dtype="bfloat16")  # stored float32: cast from the mapping instead
    assert calls == []


def test_generation_config_eos_ids_are_stop_ids(tmp_path):
    # (vLLM stops on generation_config.json's eos_token_id besides the model's)
    path = build(tmp_path, "ouro")
    base = load_model(path).spec.eos_token_ids
    vocab = load_model(path).spec.vocab_size
    for value, added in (
        ([base[0], 7, 9], (7, 9)),
        (11, (11,)),
        ([7, vocab, -1, True, "7", None], (7,)),  # ids outside the vocabulary, non-ints: none
        ("x", ()),
    ):
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": value}))
        assert load_model(path).spec.eos_token_ids == base + added, value
    for text in ("{not json", "[7]", json.dumps({"temperature": 0.5})):
        (path / "generation_config.json").write_text(text)
        assert load_model(path).spec.eos_token_ids == base, text


# ------------------------------------------------ files that are not safetensors (named first)
