"""``make_model`` presets: strict loading, determinism, trained-like loop behaviour, the demo
cache and the CLI helpers. The real-shape presets are checked from their spec only."""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
import threading
from pathlib import Path

import pytest
import torch
from builders import HUGINN_0125, NANBEIGE_TINY, random_tensors, write_checkpoint
from safetensors import safe_open

from rltserve.models import demo, load_model
from rltserve.models.base import LoopedModel
from rltserve.models.demo import COMPLETE, cache_root, demo_model_path, model_or_demo
from rltserve.models.naive import DenseKVCache, naive_generate
from rltserve.models.presets import (
    PRESETS,
    PresetSpec,
    add_make_model_args,
    make_model,
    run_make_model,
)
from rltserve.models.tokenizer import load_tokenizer

TINY = ("ouro-tiny", "huginn-tiny", "nanbeige-tiny")
# Keys the real Ouro config.json may hold (MODELS.md §1.2: vllm-rlt's strict key list).
OURO_KEYS = {
    "architectures", "auto_map", "model_type", "torch_dtype", "dtype", "transformers_version",
    "max_window_layers", "use_cache", "_name_or_path", "vocab_size", "hidden_size",
    "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
    "rope_theta", "total_ut_steps", "early_exit_threshold", "bos_token_id", "eos_token_id",
    "pad_token_id", "tie_word_embeddings", "attention_dropout", "rope_scaling",
    "use_sliding_window", "sliding_window", "layer_types",
}  # fmt: skip


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("presets")
    return {name: make_model(name, root / name, seed=0) for name in TINY}


@pytest.fixture(scope="module")
def ouro(built: dict[str, Path]) -> LoopedModel:
    return load_model(built["ouro-tiny"])


@pytest.mark.parametrize("name", TINY)
def test_tiny_preset_loads_strictly(built: dict[str, Path], name: str) -> None:
    path = built[name]
    files = {p.name for p in path.iterdir()}
    assert files == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    }
    spec = PRESETS[name]
    cfg = json.loads((path / "config.json").read_text())
    assert cfg == spec.config()
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        names = f.keys()
        found = {k: tuple(f.get_slice(k).get_shape()) for k in names}
        assert {f.get_slice(k).get_dtype() for k in names} == {"F32"}
    assert found == spec.tensor_shapes()
    model = load_model(path)
    assert model.spec.family == cfg["model_type"]
    assert model.spec.vocab_size == 512
    tok = load_tokenizer(path)
    assert tok is not None and tok.vocab_size == model.spec.vocab_size
    assert set(model.spec.eos_token_ids) <= set(tok.eos_token_ids)


def test_config_key_sets(built: dict[str, Path]) -> None:
    ouro_cfg = json.loads((built["ouro-tiny"] / "config.json").read_text())
    assert set(ouro_cfg) <= OURO_KEYS
    assert (ouro_cfg["bos_token_id"], ouro_cfg["eos_token_id"]) == (0, 0)  # upstream values
    huginn = json.loads((built["huginn-tiny"] / "config.json").read_text())
    assert huginn["init_values"]["embed_scale"] == pytest.approx(8.0)
    assert huginn["effective_expected_depth"] == 2 + 2 * 4 + 2
    assert huginn["n_layers"] == 6 and huginn["padded_vocab_size"] == 512
    nanbeige = json.loads((built["nanbeige-tiny"] / "config.json").read_text())
    assert nanbeige["head_dim"] * nanbeige["num_attention_heads"] != nanbeige["hidden_size"]
    assert nanbeige["num_loops"] == 2 and nanbeige["skip_loop_final_norm"] is False


def test_same_seed_is_byte_identical(tmp_path: Path, built: dict[str, Path]) -> None:
    again = make_model("ouro-tiny", tmp_path / "again", seed=0)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert _sha(again / name) == _sha(built["ouro-tiny"] / name), name
    other = make_model("ouro-tiny", tmp_path / "other", seed=1, tokenizer=False)
    assert _sha(other / "model.safetensors") != _sha(built["ouro-tiny"] / "model.safetensors")


def test_real_shape_presets_match_models_md() -> None:
    expected = {"ouro-1.4b": (24, 1_434_652_673), "ouro-2.6b": (48, 2_667_974_657)}
    for name, (layers, params) in expected.items():
        spec = PRESETS[name]
        cfg = spec.config()
        assert spec.num_parameters() == params
        assert cfg["num_hidden_layers"] == layers and cfg["torch_dtype"] == "bfloat16"
        assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]) == (
            2048,
            5632,
            49152,
        )
        assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (
            16,
            16,
            128,
        )
        assert cfg["rope_theta"] == 1e6 and cfg["rms_norm_eps"] == 1e-6
        assert cfg["max_position_embeddings"] == 65536 and cfg["total_ut_steps"] == 4
        assert cfg["tie_word_embeddings"] is False and spec.layout.vocab_size == 49152
        assert spec.tensor_shapes()["lm_head.weight"] == (49152, 2048)


def test_bf16_stream_writer(tmp_path: Path) -> None:
    """The real-shape presets' path: bf16 storage written tensor by tensor."""
    cfg = PRESETS["ouro-tiny"].config() | {"torch_dtype": "bfloat16"}
    spec = PresetSpec("bf16", "test", json.dumps(cfg), PRESETS["ouro-tiny"].layout)
    path = make_model(spec, tmp_path, tokenizer=False)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        names = f.keys()
        assert {f.get_slice(k).get_dtype() for k in names} == {"BF16"}
    model = load_model(path, dtype="bfloat16")
    tokens, depths = naive_generate(model, [5, 6, 7], 3)
    assert len(tokens) == 3 and depths == [4, 4, 4]


@torch.inference_mode()
def _per_depth(model: LoopedModel, ids: list[int], depth: int):
    """Dense full-depth pass: (logits [D, T, V], gate logits [D, T] or None without a gate)."""
    cache = DenseKVCache(model, len(ids))
    positions = torch.arange(len(ids))
    e = model.prelude(torch.tensor(ids), positions, cache.attn(None, 0))
    state = model.initial_state(e, None)
    logits, gates = [], []
    for d in range(depth):
        state = model.loop(state, e, positions, cache.attn(d, 0))
        gates.append(model.exit_logit(state))
        logits.append(model.logits(model.coda(state, positions, cache.attn(None, 0))))
    return torch.stack(logits), (torch.stack(gates) if model.spec.has_gate else None)


def _exit_depths(gates: torch.Tensor, threshold: float) -> torch.Tensor:
    """Ouro CDF rule (min_loops=1): first depth whose CDF reaches the threshold, else D."""
    depth = gates.shape[0]
    lam = torch.sigmoid(gates.float())
    survival = torch.ones(gates.shape[1])
    out = torch.full((gates.shape[1],), depth)
    for t in range(depth - 1):
        survival = survival * (1 - lam[t])
        hit = (out == depth) & (1 - survival >= threshold)
        out[hit] = t + 1
    return out


def test_ouro_tiny_loops_refine_and_gate_spreads(ouro: LoopedModel) -> None:
    gen = torch.Generator().manual_seed(0)
    logits, gates = [], []
    for _ in range(6):
        ids = torch.randint(0, 512, (64,), generator=gen).tolist()
        lg, g = _per_depth(ouro, ids, 4)
        logits.append(lg)
        gates.append(g)
    lg, g = torch.cat(logits, 1), torch.cat(gates, 1)
    deltas = [float((lg[d] - lg[d - 1]).abs().mean()) for d in range(1, 4)]
    assert deltas[0] > deltas[1] > deltas[2], deltas
    assert deltas[2] < 0.8 * deltas[0], deltas
    # the gate's exit probability rises with depth (confidence grows as the state settles)
    lam = torch.sigmoid(g).mean(1).tolist()
    assert lam == sorted(lam), lam
    means = []
    for q in (0.3, 0.5, 0.8):
        ed = _exit_depths(g, q)
        hist = torch.bincount(ed, minlength=5)[1:]
        assert int((hist >= 0.02 * ed.numel()).sum()) >= 3, (q, hist.tolist())
        means.append(float(ed.float().mean()))
    assert means == sorted(means)
    assert any(1.5 <= m <= 3.5 for m in means), means
    # outputs vary with the input: many distinct greedy tokens, not one repeated id
    assert len(set(lg[-1].argmax(-1).tolist())) > 50


def test_huginn_tiny_recurrence_settles_on_an_input_dependent_state(
    built: dict[str, Path],
) -> None:
    # The checkpoint scheme's Huginn adapter contracts the state and injects a rotated prelude
    # output: logits converge over loops, differ across inputs, and rarely echo the input token.
    model = load_model(built["huginn-tiny"])
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.spec.vocab_size, (64,), generator=gen).tolist()
    lg, _ = _per_depth(model, ids, 8)
    deltas = [float((lg[d] - lg[d - 1]).abs().mean()) for d in range(1, 8)]
    assert deltas == sorted(deltas, reverse=True), deltas
    assert deltas[-1] < 0.35 * deltas[0], deltas
    top = lg[-1].argmax(-1).tolist()
    assert len(set(top)) > 40
    assert sum(t == i for t, i in zip(top, ids)) < 4


def test_huginn_freqs_cis_from_the_config_is_the_stored_buffer_bit_for_bit(
    built: dict[str, Path],
) -> None:
    # What a checkpoint without freqs_cis leaves to the config: the table the forward's RoPE is.
    from rltserve.models.huginn import freqs_cis

    path = built["huginn-tiny"]
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        stored = f.get_tensor("freqs_cis")
    got = freqs_cis(json.loads((path / "config.json").read_text()))
    assert got.dtype == stored.dtype == torch.float32 and got.shape == stored.shape
    assert torch.equal(got.view(torch.int32), stored.view(torch.int32))
    # and at the real checkpoint's shape, [1, 4096, 1, 48, 2], as make-model writes it
    from rltserve.models.checkpoint import Draws, huginn_value

    cfg = {**HUGINN_0125, "init_values": {**HUGINN_0125["init_values"], "out_proj": 5.4e-4}}
    real = freqs_cis(cfg)
    table = huginn_value(Draws(0), cfg, "freqs_cis", tuple(real.shape))
    assert real.shape == (1, 4096, 1, 48, 2)
    assert torch.equal(real.view(torch.int32), table.view(torch.int32))


def test_stream_writer_refuses_tensors_out_of_name_order(tmp_path: Path) -> None:
    from rltserve.models import checkpoint as ck

    shapes = {"a": (1,), "b": (1,)}
    tensors = iter([("b", torch.ones(1)), ("a", torch.ones(1))])
    with pytest.raises(AssertionError, match="tensor order: got b, want a"):
        ck.write_safetensors(tmp_path / "x.safetensors", shapes, torch.float32, tensors)
    assert not (tmp_path / "x.safetensors").exists()


def test_ouro_tiny_naive_generation(ouro: LoopedModel, built: dict[str, Path]) -> None:
    tok = load_tokenizer(built["ouro-tiny"])
    assert tok is not None
    prompt = tok.apply_chat_template([{"role": "user", "content": "Tell me a story."}])
    assert isinstance(prompt, list)
    tokens, depths = naive_generate(ouro, prompt, 24, exit_threshold=0.5)
    assert len(set(tokens)) >= 8
    assert len(set(depths)) >= 3
    full, full_depths = naive_generate(ouro, prompt, 24)
    assert set(full_depths) == {4}
    assert sum(a == b for a, b in zip(tokens, full)) >= 1  # early exit mostly agrees early on


@pytest.mark.parametrize("name", ["huginn-tiny", "nanbeige-tiny"])
def test_other_families_generate(built: dict[str, Path], name: str) -> None:
    model = load_model(built[name])
    seed = 3 if model.spec.needs_noise else None
    tokens, depths = naive_generate(model, [10, 20, 30, 40], 12, seed=seed)
    assert len(set(tokens)) >= 4
    assert set(depths) == {model.spec.num_loops}


def test_checkpoint_without_tokenizer_runs_on_ids(tmp_path: Path) -> None:
    path = make_model("ouro-tiny", tmp_path, seed=2, tokenizer=False)
    assert {p.name for p in path.iterdir()} == {"config.json", "model.safetensors"}
    assert load_tokenizer(path) is None
    tokens, depths = naive_generate(load_model(path), [1, 300, 301, 302], 5, exit_threshold=0.5)
    assert len(tokens) == 5 and all(1 <= d <= 4 for d in depths)


def test_demo_cache_builds_once_and_is_race_safe(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("RLTSERVE_CACHE", str(tmp_path / "cache"))
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(demo_model_path())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1
    path = results[0]
    assert path.parent == tmp_path / "cache" and (path / COMPLETE).is_file()
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp dirs left behind
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert demo_model_path() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    model = load_model(path)
    assert model.spec.family == "ouro" and load_tokenizer(path) is not None


def test_demo_replaces_incomplete_leftover(tmp_path: Path, monkeypatch) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setenv("RLTSERVE_CACHE", str(tmp_path / "env"))
    monkeypatch.setattr(sys, "stderr", Terminal())
    path = demo_model_path(tmp_path)
    assert path.parent == tmp_path  # an explicit root wins over the cache variable
    demo_model_path(tmp_path)  # (built: nothing to say)
    # a person at a terminal is told why the first run waits, once
    assert sys.stderr.getvalue() == f"building the demo model (once, some seconds) in {path}\n"
    (path / COMPLETE).unlink()
    (path / "model.safetensors").write_bytes(b"junk")
    assert demo_model_path(tmp_path) == path
    assert (path / COMPLETE).is_file()
    load_model(path)


def test_cli_helpers(tmp_path: Path, capsys) -> None:
    parser = argparse.ArgumentParser()
    add_make_model_args(parser)
    out = tmp_path / "m"
    args = parser.parse_args(["--preset", "nanbeige-tiny", "--out", str(out), "--seed", "4"])
    assert run_make_model(args) == 0
    assert "201,024 parameters" in capsys.readouterr().out
    load_model(out)
    assert run_make_model(args) == 2  # refuses a non-empty directory without --force
    args = parser.parse_args(["--preset", "ouro-tiny", "--out", str(out), "--force"])
    assert run_make_model(args) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "ouro"


def test_force_replaces_only_a_checkpoint(tmp_path: Path) -> None:
    # --out . --force (or ~) must never wipe a directory: only checkpoint files are replaced,
    # and only once the arguments are known good.
    out = write_checkpoint(tmp_path / "m", NANBEIGE_TINY, random_tensors(NANBEIGE_TINY), shards=2)
    (out / "tokenizer.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    (out / "sub").mkdir()
    (out / "sub" / "model.safetensors").write_text("also mine")
    parser = argparse.ArgumentParser()
    add_make_model_args(parser)
    bad = parser.parse_args(["--preset", "ouro-tiny", "--out", str(out), "--force", "--seed", "-1"])
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(ValueError, match="seed must be a non-negative int"):
        run_make_model(bad)
    assert sorted(p.name for p in out.iterdir()) == before
    args = parser.parse_args(
        ["--preset", "ouro-tiny", "--out", str(out), "--force", "--no-tokenizer"]
    )
    assert run_make_model(args) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "notes.txt",
        "sub",
    ]  # the stale index, shards and tokenizer went with the old checkpoint
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / "sub" / "model.safetensors").read_text() == "also mine"
    assert isinstance(load_model(out), LoopedModel)
    assert json.loads((out / "config.json").read_text())["model_type"] == "ouro"


def test_make_model_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown preset"):
        make_model("ouro-huge", tmp_path)
    with pytest.raises(ValueError, match="seed"):
        make_model("ouro-tiny", tmp_path, seed=-1)
    with pytest.raises(ValueError, match="seed"):
        make_model("ouro-tiny", tmp_path, seed=True)
    assert not any(tmp_path.iterdir())


def test_synthetic_value_scheme_invariants(tmp_path: Path) -> None:
    """``checkpoint``'s scheme: weaker head rows for non-word ids, a head blind to the
    confidence direction, shapes checked, and 8-byte aligned tensor data."""
    from rltserve.models import checkpoint as ck

    cfg = PRESETS["ouro-tiny"].config()
    vocab, hidden, inter = cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"]
    words = torch.arange(vocab) % 3 != 0
    d = ck.Draws(0, words)
    rows = d.head_rows(vocab)[:, 0]
    assert rows.shape == (vocab,)
    assert torch.equal(rows, torch.where(words, 1.0, ck.OTHER_ROWS))
    with pytest.raises(ValueError, match=r"words mask has shape \(3,\), want \(4,\)"):
        ck.Draws(0, torch.ones(3, dtype=torch.bool)).word_mask(4)
    head = ck.llama_value(d, cfg, "lm_head.weight", (vocab, hidden))
    _, m = ck._patterns(d, inter, hidden)
    assert float((head @ m).abs().max()) < 1e-4 * float(head.abs().max())
    with pytest.raises(AssertionError, match=r"model.norm.weight: built \(\d+,\), want \(3,\)"):
        list(ck.synth_tensors(cfg, {"model.norm.weight": (3,)}, seed=0))
    shapes = {"a": (3,), "b": (2, 2)}
    tensors = {"a": torch.tensor([1.0, 2.0, 3.0]), "b": torch.eye(2)}
    ck.write_safetensors(tmp_path / "x.safetensors", shapes, torch.float32, iter(tensors.items()))
    data = (tmp_path / "x.safetensors").read_bytes()
    assert int.from_bytes(data[:8], "little") % 8 == 0  # header padded: data 8-byte aligned
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:
        assert all(torch.equal(f.get_tensor(k), v) for k, v in tensors.items())


def test_only_word_rows_of_the_synthetic_head_lean_toward_their_pattern() -> None:
    from rltserve.models import checkpoint as ck

    cfg = PRESETS["ouro-tiny"].config()
    vocab, hidden, inter = cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"]
    words = torch.arange(vocab) % 3 != 0
    d = ck.Draws(0, words)
    head = ck.llama_value(d, cfg, "lm_head.weight", (vocab, hidden))
    patterns, _ = ck._patterns(d, inter, hidden)
    own = patterns[torch.arange(vocab) % inter]
    cos = torch.nn.functional.cosine_similarity(head, own, dim=-1)
    assert float(cos[words].mean()) > 0.7
    assert float(cos[~words].abs().mean()) < 0.3


def _spec_with(name: str, **changes: object) -> PresetSpec:
    base = PRESETS[name]
    return PresetSpec("edited", "test", json.dumps(base.config() | changes), base.layout)


def test_preset_spec_rejects_a_config_its_tokenizer_does_not_fit() -> None:
    with pytest.raises(ValueError, match="torch_dtype must be one of"):
        _spec_with("ouro-tiny", torch_dtype="float16")
    with pytest.raises(ValueError, match="tokenizer size != vocab 1024"):
        _spec_with("ouro-tiny", vocab_size=1024)
    # Huginn's model vocabulary is the padded one.
    with pytest.raises(ValueError, match="tokenizer size != vocab 1024"):
        _spec_with("huginn-tiny", padded_vocab_size=1024)
    with pytest.raises(ValueError, match="model_max_length != 4096"):
        _spec_with("ouro-tiny", max_position_embeddings=4096)
    with pytest.raises(ValueError, match="model_max_length != 2048"):
        _spec_with("huginn-tiny", block_size=2048)


@pytest.mark.parametrize("name", TINY)
def test_num_parameters_is_the_loaded_models_count(built: dict[str, Path], name: str) -> None:
    model = load_model(built[name])
    assert PRESETS[name].num_parameters() == sum(p.numel() for p in model.parameters())


def test_only_multi_byte_tokens_get_full_strength_head_rows(built: dict[str, Path]) -> None:
    from rltserve.models import checkpoint as ck

    path = built["ouro-tiny"]
    tok_json = json.loads((path / "tokenizer.json").read_text())
    added = {t["id"] for t in tok_json["added_tokens"]}
    vocab = tok_json["model"]["vocab"]
    cfg = PRESETS["ouro-tiny"].config()
    words = torch.zeros(cfg["vocab_size"], dtype=torch.bool)
    for token, i in vocab.items():
        words[i] = i not in added and len(token) >= 2
    shape = (cfg["vocab_size"], cfg["hidden_size"])
    want = ck.llama_value(ck.Draws(0, words), cfg, "lm_head.weight", shape)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor("lm_head.weight"), want)


def test_a_checkpoint_rewritten_without_a_tokenizer_keeps_none(tmp_path: Path) -> None:
    make_model("ouro-tiny", tmp_path)
    make_model("ouro-tiny", tmp_path, tokenizer=False)
    assert {p.name for p in tmp_path.iterdir()} == {"config.json", "model.safetensors"}


def test_cli_writes_into_an_existing_empty_directory(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_make_model_args(parser)
    out = tmp_path / "m"
    out.mkdir()
    assert run_make_model(parser.parse_args(["--preset", "ouro-tiny", "--out", str(out)])) == 0
    assert (out / "model.safetensors").is_file()


def test_cli_default_seed_is_make_models(tmp_path: Path, built: dict[str, Path]) -> None:
    parser = argparse.ArgumentParser()
    add_make_model_args(parser)
    args = parser.parse_args(["--preset", "ouro-tiny", "--out", str(tmp_path / "m")])
    assert run_make_model(args) == 0
    assert _sha(tmp_path / "m" / "model.safetensors") == _sha(
        built["ouro-tiny"] / "model.safetensors"
    )


def test_cache_root_expands_a_home_relative_variable(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("RLTSERVE_CACHE", "~/models")
    assert cache_root() == tmp_path / "models"


def test_model_or_demo_keeps_a_given_model(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("RLTSERVE_CACHE", str(tmp_path))
    assert model_or_demo("org/some-model") == "org/some-model"
    assert not any(tmp_path.iterdir())  # no demo was built


def test_demo_build_failure_is_raised_and_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    def refuse(src: object, dst: object) -> None:
        raise OSError("read-only cache")

    monkeypatch.setattr(demo.os, "rename", refuse)
    with pytest.raises(OSError, match="read-only cache"):
        demo_model_path(tmp_path)
    assert not any(tmp_path.iterdir())
