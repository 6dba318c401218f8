"""Model configs as ``config.json`` holds them: required keys and their bounds, the upstream
features each family refuses or takes in their off state, every RoPE spelling transformers
writes, eos ids, model types, and values that are given as null."""

from __future__ import annotations

import json
import re

import pytest
from builders import HUGINN_0125, NANBEIGE_4_2_3B, NANBEIGE_TINY, OURO_1_4B, real_spec
from recipe import load_vectors

from rltserve.models import get_family
from rltserve.models.huginn import HuginnConfig
from rltserve.models.nanbeige import NanbeigeConfig
from rltserve.models.ouro import OuroConfig

VECTORS = load_vectors()
PROMPTS: list[list[int]] = VECTORS["prompts"]


def test_huginn_head_dim_must_tile_n_embd():
    raw = dict(VECTORS["configs"]["huginn"], head_dim=32)
    with pytest.raises(ValueError, match="head_dim"):
        HuginnConfig.from_dict(raw)


@pytest.mark.parametrize(
    ("cls", "raw", "key", "value"),
    [
        (OuroConfig, VECTORS["configs"]["ouro"], "rope_scaling", {"type": "linear"}),
        (OuroConfig, VECTORS["configs"]["ouro"], "tie_word_embeddings", True),
        (OuroConfig, VECTORS["configs"]["ouro"], "hidden_size", 0),
        (OuroConfig, VECTORS["configs"]["ouro"], "num_key_value_heads", 3),
        (OuroConfig, VECTORS["configs"]["ouro"], "eos_token_id", 10_000),
        (HuginnConfig, VECTORS["configs"]["huginn"], "qk_bias", False),
        (HuginnConfig, VECTORS["configs"]["huginn"], "n_layers", 7),
        (HuginnConfig, VECTORS["configs"]["huginn"], "rope_base", -1),
        (NanbeigeConfig, NANBEIGE_TINY, "skip_loop_final_norm", True),
        (NanbeigeConfig, NANBEIGE_TINY, "loop_share_kv", True),
        (NanbeigeConfig, NANBEIGE_TINY, "num_loops", 0),
        (NanbeigeConfig, NANBEIGE_TINY, "rms_norm_eps", "x"),
        (OuroConfig, VECTORS["configs"]["ouro"], "use_sliding_window", True),
        (OuroConfig, VECTORS["configs"]["ouro"], "early_exit_step", 2),
        (HuginnConfig, VECTORS["configs"]["huginn"], "test_time_noise", 0.1),
        (HuginnConfig, VECTORS["configs"]["huginn"], "num_key_value_heads", 2),
        (HuginnConfig, VECTORS["configs"]["huginn"], "pad_token_id", 384),
        (NanbeigeConfig, NANBEIGE_TINY, "attention_bias", True),
        (NanbeigeConfig, NANBEIGE_TINY, "num_key_value_heads", 3),
        (NanbeigeConfig, NANBEIGE_TINY, "bos_token_id", 384),
    ],
)
def test_config_rejects_bad_values(cls, raw, key, value):
    name = "eos_token_ids" if key == "eos_token_id" else key
    with pytest.raises(ValueError, match=name):
        cls.from_dict({**raw, key: value})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("loop_share_kv", True),
        ("enable_double_loop_split", True),
        ("enable_hyper_connection", True),
        ("enable_mhc", True),
        ("enable_h_res_identity", True),
        ("enable_depth_attention", True),
        ("qk_layernorm", True),
        ("ngram_insert_all_layers", True),
        ("emb_neighbor_num", 1),
        ("insert_ngram_layer_idx", 0),
        ("insert_ngram_layer_idx", [3]),
        ("loop_middle_layers", [1]),
    ],
)
def test_nanbeige_rejects_every_enabled_upstream_feature(key, value):
    with pytest.raises(ValueError, match=rf"nanbeige config: {key}=.*not supported"):
        NanbeigeConfig.from_dict({**NANBEIGE_TINY, key: value})


def test_nanbeige_accepts_upstream_features_in_their_off_state():
    off = {
        "loop_share_kv": False,
        "enable_hyper_connection": False,
        "emb_neighbor_num": 0,
        "insert_ngram_layer_idx": -1,
        "loop_middle_layers": [],
    }
    assert NanbeigeConfig.from_dict({**NANBEIGE_TINY, **off}).num_loops == 2


def test_missing_num_key_value_heads_means_one_kv_head_per_head():
    ouro = {k: v for k, v in VECTORS["configs"]["ouro"].items() if k != "num_key_value_heads"}
    assert OuroConfig.from_dict(ouro).num_key_value_heads == ouro["num_attention_heads"]
    nanbeige = {k: v for k, v in NANBEIGE_TINY.items() if k != "num_key_value_heads"}
    assert NanbeigeConfig.from_dict(nanbeige).num_key_value_heads == 4


@pytest.mark.parametrize(
    ("init_values", "match"),
    [
        ({"embed_scale": 8.0}, r"init_values=.*needs 'embed_scale' and 'std'"),
        ({"std": 0.08}, r"init_values=.*needs 'embed_scale' and 'std'"),
        ({"embed_scale": 8.0, "std": -0.08}, r"init_std=-0.08: must be a finite number > 0"),
    ],
)
def test_huginn_init_values_are_checked(init_values, match):
    raw = {**VECTORS["configs"]["huginn"], "init_values": init_values}
    with pytest.raises(ValueError, match=match):
        HuginnConfig.from_dict(raw)


def test_huginn_head_dim_must_be_even():
    raw = {**VECTORS["configs"]["huginn"], "n_embd": 60, "head_dim": 15}
    with pytest.raises(ValueError, match=r"head_dim=15: must be even"):
        HuginnConfig.from_dict(raw)


def test_huginn_max_loops_covers_a_mean_recurrence_above_the_default_bound():
    spec = real_spec({**HUGINN_0125, "mean_recurrence": 300})
    assert (spec.num_loops, spec.max_loops) == (300, 300)


def test_config_requires_keys_and_reads_head_dim():
    raw = {k: v for k, v in VECTORS["configs"]["ouro"].items() if k != "total_ut_steps"}
    with pytest.raises(ValueError, match="total_ut_steps"):
        OuroConfig.from_dict(raw)
    no_head_dim = {k: v for k, v in VECTORS["configs"]["ouro"].items() if k != "head_dim"}
    assert OuroConfig.from_dict(no_head_dim).head_dim == 16  # hidden / heads
    kv_channels = {k: v for k, v in NANBEIGE_TINY.items() if k != "head_dim"}
    assert NanbeigeConfig.from_dict({**kv_channels, "kv_channels": 32}).head_dim == 32
    with pytest.raises(ValueError, match="model_type"):
        OuroConfig.from_dict({**VECTORS["configs"]["ouro"], "model_type": "qwen2"})


ROPE_CONFIGS = {
    "ouro": (OuroConfig, VECTORS["configs"]["ouro"], "rope_theta"),
    "nanbeige": (NanbeigeConfig, NANBEIGE_TINY, "rope_theta"),
    "huginn_raven": (HuginnConfig, VECTORS["configs"]["huginn"], "rope_base"),
}


def _without(raw: dict, *keys: str) -> dict:
    return {k: v for k, v in raw.items() if k not in keys}


@pytest.mark.parametrize("family", sorted(ROPE_CONFIGS))
def test_plain_rope_is_accepted_in_every_spelling_transformers_writes(family):
    cls, raw, key = ROPE_CONFIGS[family]
    base, want = raw[key], cls.from_dict(raw)
    plain = [
        {"rope_scaling": {"rope_type": "default"}},
        {"rope_scaling": {"type": "default"}},  # transformers < 4.45's name
        {"rope_scaling": {}},
        {"rope_scaling": {"rope_type": "default", "rope_theta": base}},
        {"rope_parameters": {"rope_theta": base, "rope_type": "default"}},
        {"rope_parameters": {"rope_theta": float(base), "rope_type": "default"}},  # 1e6 == 1000000
    ]
    for extra in plain:
        assert cls.from_dict({**raw, **extra}) == want, extra
    if key == "rope_theta":  # transformers 5: the base only inside rope_parameters
        tf5 = _without(raw, key, "rope_scaling")
        tf5["rope_parameters"] = {"rope_theta": base, "rope_type": "default"}
        assert cls.from_dict(tf5) == want


@pytest.mark.parametrize("family", sorted(ROPE_CONFIGS))
@pytest.mark.parametrize("where", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize(
    ("value", "why"),
    [
        ({"rope_type": "linear", "factor": 2.0}, "rope_type 'linear' is not supported"),
        (
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
            "rope_type 'yarn' is not supported",
        ),
        ({"type": "dynamic", "factor": 2.0}, "rope_type 'dynamic' is not supported"),
        ({"rope_type": "default", "factor": 1.0}, r"keys \['factor'\] are not supported"),
        ("default", "must be null or a dict"),
    ],
)
def test_scaled_rope_is_refused_naming_its_type(family, where, value, why):
    cls, raw, _ = ROPE_CONFIGS[family]
    with pytest.raises(ValueError, match=rf"^{family} config: {where}=.*: {why}"):
        cls.from_dict({**raw, where: value})


@pytest.mark.parametrize(
    ("family", "changes", "message"),
    [
        (
            "ouro",
            {"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}},
            "rope_theta=10000.0 and rope_parameters.rope_theta=1000000.0 disagree",
        ),
        (
            "nanbeige",
            {"rope_scaling": {"rope_theta": 7e7}, "rope_parameters": {"rope_theta": 1e6}},
            "rope_theta=70000000.0 and rope_parameters.rope_theta=1000000.0 disagree",
        ),
        (
            "huginn_raven",
            {"rope_scaling": {"rope_type": "default", "rope_theta": 10000.0}},
            "rope_base=50000 and rope_scaling.rope_theta=10000.0 disagree",
        ),
    ],
)
def test_a_rope_base_given_twice_must_agree(family, changes, message):
    cls, raw, _ = ROPE_CONFIGS[family]
    with pytest.raises(ValueError, match=re.escape(f"{family} config: {message}")):
        cls.from_dict({**raw, **changes})


@pytest.mark.parametrize(
    ("family", "changes", "message"),
    [
        (
            "nanbeige",
            {"head_dim": 32, "kv_channels": 16},
            "head_dim=32 and kv_channels=16 disagree",
        ),
        *(
            (family, {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5: only 1.0")
            for family in sorted(ROPE_CONFIGS)
        ),
        (
            "nanbeige",
            {"rope_parameters": {"rope_theta": 7e7, "partial_rotary_factor": 0.25}},
            "rope_parameters.partial_rotary_factor=0.25: only 1.0",
        ),
        ("ouro", {"partial_rotary_factor": True}, "partial_rotary_factor=True: only 1.0"),
        (
            "nanbeige",
            {"use_sliding_window": True, "sliding_window": 8},
            "use_sliding_window=True: only False is supported",
        ),
        (
            "ouro",
            {"use_sliding_window": True, "sliding_window": 8},
            "use_sliding_window=True: only False is supported",
        ),
    ],
)
def test_keys_that_would_change_the_attention_are_refused_naming_key_and_value(
    family, changes, message
):
    cls, raw, _ = ROPE_CONFIGS[family]
    with pytest.raises(ValueError, match=re.escape(f"{family} config: {message}")):
        cls.from_dict({**raw, **changes})


@pytest.mark.parametrize(
    ("cls", "raw"),
    [(OuroConfig, OURO_1_4B), (NanbeigeConfig, NANBEIGE_4_2_3B), (NanbeigeConfig, NANBEIGE_TINY)],
)
def test_those_keys_load_in_the_values_real_configs_write(cls, raw):
    want = cls.from_dict(raw)
    head_dim = want.head_dim
    for extra in (
        {"use_sliding_window": False, "sliding_window": 4096},
        {"use_sliding_window": False, "sliding_window": None},
        {"partial_rotary_factor": 1.0},
        {"partial_rotary_factor": 1, "rope_scaling": {"partial_rotary_factor": 1.0}},
        {"partial_rotary_factor": None},
        {"head_dim": head_dim, "kv_channels": head_dim} if cls is NanbeigeConfig else {},
    ):
        assert cls.from_dict({**raw, **extra}) == want, extra


def test_a_rope_base_given_nowhere_is_refused_not_defaulted():
    raw = _without(VECTORS["configs"]["ouro"], "rope_theta")
    for rope in ({}, {"rope_parameters": {"rope_type": "default"}}):
        with pytest.raises(ValueError, match="ouro config: required key 'rope_theta' is missing"):
            OuroConfig.from_dict({**raw, **rope})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("eos_token_id", -1),
        ("eos_token_id", [0, -2]),
        ("bos_token_id", 384),  # == vocab_size
        ("tie_word_embeddings", 0),  # == False, but not a bool
        ("hidden_size", True),
        ("rope_theta", float("inf")),
        ("head_dim", 15),
        ("layer_types", ["full_attention"]),  # one entry for two layers
    ],
)
def test_config_rejects_boundary_values(key, value):
    raw = {**VECTORS["configs"]["ouro"], key: value}
    name = "eos_token_id" if key == "eos_token_id" else key
    with pytest.raises(ValueError, match=name):
        OuroConfig.from_dict(raw)


def test_config_accepts_values_at_their_bounds():
    raw = VECTORS["configs"]["ouro"]
    cfg = OuroConfig.from_dict({**raw, "num_key_value_heads": 1, "bos_token_id": 383})
    assert cfg.num_key_value_heads == 1 and cfg.bos_token_id == 383


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("rope_theta", 0),
        ("rms_norm_eps", 0.0),
        ("rope_theta", float("nan")),
        ("rms_norm_eps", -0.0),
        ("early_exit_threshold", 0.0),
    ],
)
def test_config_rejects_zero_and_nan_where_a_positive_number_is_required(key, value):
    raw = {**VECTORS["configs"]["ouro"], key: value}
    with pytest.raises(ValueError, match=rf"ouro config: {key}=.*: must be a finite number > 0"):
        OuroConfig.from_dict(raw)


@pytest.mark.parametrize("value", [True, -1, [0, -2], [2, False], "2"])
def test_bad_eos_ids_are_named_by_their_config_json_key(value):
    raw = {**VECTORS["configs"]["ouro"], "eos_token_id": value}
    want = f"ouro config: eos_token_id={value!r}: must be null, a non-negative int or a list"
    with pytest.raises(ValueError, match=re.escape(want)):
        OuroConfig.from_dict(raw)


@pytest.mark.parametrize("model_type", [["ouro"], None, 3, {"ouro": 1}])
def test_a_model_type_of_the_wrong_type_is_an_unsupported_one(tmp_path, model_type):
    with pytest.raises(ValueError, match=r"unsupported model_type .*supported: huginn_raven"):
        get_family(model_type)
    from rltserve.models import CheckpointError, read_config

    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    with pytest.raises(CheckpointError, match="unsupported model_type"):
        read_config(tmp_path)


def test_configs_built_in_code_are_checked_as_from_json():
    import dataclasses

    cfg = OuroConfig.from_dict(VECTORS["configs"]["ouro"])
    for field, value, why in (
        ("eos_token_ids", (-1,), r"eos_token_ids=\(-1,\): ids must be in \[0, 384\)"),
        ("pad_token_id", 384, r"pad_token_id=384: must be null or an id in \[0, 384\)"),
        ("pad_token_id", -1, r"pad_token_id=-1: must be null or an id"),
    ):
        with pytest.raises(ValueError, match=rf"ouro config: {why}"):
            dataclasses.replace(cfg, **{field: value})


def test_layer_types_must_all_be_full_attention():
    raw = VECTORS["configs"]["ouro"]
    layers = raw["num_hidden_layers"]
    assert OuroConfig.from_dict({**raw, "layer_types": ["full_attention"] * layers})
    for other in ("linear_attention", "Full_attention"):
        bad = ["full_attention"] * (layers - 1) + [other]
        with pytest.raises(ValueError, match="layer_types=.*must be .* x 'full_attention'"):
            OuroConfig.from_dict({**raw, "layer_types": bad})


def test_a_null_value_is_given_not_missing():
    from rltserve.models import hfconfig

    # (defaults stand for absent keys only: an explicit null reaches the field's check)
    assert hfconfig.read({"k": None}, "ouro", "k", 5) is None
    assert hfconfig.read({}, "ouro", "k", 5) == 5
    raw = {**VECTORS["configs"]["ouro"], "num_key_value_heads": None}
    with pytest.raises(ValueError, match="num_key_value_heads=None: must be an int"):
        OuroConfig.from_dict(raw)
