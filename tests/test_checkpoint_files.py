"""Weight files the loader could not tell apart from corrupt ones, named
(``checkpoint_files``): a Git LFS pointer, an interrupted Hugging Face download, a dangling
shard link, a file cut short, an unreadable file, ``.bin`` weights only, quantized weights;
the loader and the engine name them before parsing, and a weight update from such a directory
is refused alike; config and tokenizer files linked to nothing."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from builders import TINY_CONFIGS as CONFIGS
from builders import build_tiny as build
from builders import random_tensors, write_checkpoint

from rltserve import checkpoint_files
from rltserve.checkpoint_files import check_weight_files
from rltserve.models import CheckpointError, load_model
from rltserve.weights import update_files


def test_a_git_lfs_pointer_is_named_as_one(tmp_path):
    path = build(tmp_path, "ouro")
    pointer = "version https://git-lfs.github.com/spec/v1\noid sha256:ab12\nsize 2869336434\n"
    (path / "model.safetensors").write_text(pointer)
    with pytest.raises(CheckpointError) as err:
        check_weight_files(path)
    assert str(err.value) == (
        f"{path}/model.safetensors: a Git LFS pointer of a 2869336434-byte file, not the "
        "weights (cloned without git-lfs); fetch the real weights (`git lfs pull` in the clone)"
    )
    with pytest.raises(ValueError) as err:  # (an update from that directory: the same)
        update_files(path)
    assert str(err.value).startswith(f"weights: {path}/model.safetensors: a Git LFS pointer")


def test_an_interrupted_hub_download_names_the_partial_blob(tmp_path):
    """A Hugging Face cache snapshot links each file to a blob; a download that stopped leaves
    ``<blob>.incomplete`` and a link to nothing."""
    source = build(tmp_path, "ouro", name="src")
    repo = tmp_path / "hub" / "models--someorg--ouro"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / ("c0" * 20)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").symlink_to(source / "config.json")
    (repo / "blobs" / "b10b.incomplete").write_bytes(b"\x00" * 10)
    (snapshot / "model.safetensors").symlink_to("../../blobs/b10b")
    with pytest.raises(CheckpointError) as err:
        check_weight_files(snapshot)
    assert str(err.value) == (
        f"{snapshot}/model.safetensors: its download is incomplete (the blob b10b.incomplete "
        f"in {repo / 'blobs'} is partial); download it again (`hf download someorg/ouro`)"
    )
    (repo / "blobs" / "b10b.incomplete").unlink()  # (pruned, or deleted by hand)
    with pytest.raises(CheckpointError) as err:
        check_weight_files(snapshot)
    assert str(err.value) == (
        f"{snapshot}/model.safetensors: a link to the blob {repo / 'blobs' / 'b10b'}, which "
        "does not exist (deleted or pruned); download it again (`hf download someorg/ouro`)"
    )


def test_a_shard_linked_to_nothing_is_named_before_the_index_calls_it_missing(tmp_path):
    path = build(tmp_path, "nanbeige", shards=2)
    shard = path / "model-00002-of-00002.safetensors"
    shard.unlink()
    shard.symlink_to(tmp_path / "gone")
    with pytest.raises(CheckpointError) as err:
        check_weight_files(path)
    assert str(err.value) == f"{shard}: a link to {tmp_path / 'gone'}, which does not exist"


def test_truncated_safetensors_says_so_with_both_sizes(tmp_path):
    """A file cut short (an interrupted download or copy) was "corrupt or unreadable
    safetensors (... incomplete metadata, file not fully covered)"."""
    path = build(tmp_path, "ouro")
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as err:
        load_model(path)
    assert str(err.value) == (
        f"{file}: truncated: {len(data) // 2} bytes of the {len(data)} its header describes (an "
        "interrupted download or copy); download or copy it again"
    )
    (length,) = struct.unpack("<Q", data[:8])
    file.write_bytes(data[:100])  # (within the header)
    with pytest.raises(CheckpointError) as err:
        load_model(path)
    assert str(err.value).startswith(
        f"{file}: truncated: 100 bytes, within its {8 + length}-byte header (an interrupted"
    )


def test_an_unreadable_weight_file_says_permission_denied(tmp_path, monkeypatch):
    """As root every file is readable, so the refusal is simulated (the next test is the real
    one where the tests do not run as root)."""
    path = build(tmp_path, "ouro")
    real_open = open

    def refusing(file, *args, **kwargs):
        if Path(file).name == "model.safetensors":
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    (path / "model.safetensors").chmod(0o600)
    monkeypatch.setattr(checkpoint_files, "open", refusing, raising=False)
    with pytest.raises(CheckpointError) as err:
        check_weight_files(path)
    uid = os.geteuid()
    assert str(err.value) == (
        f"{path}/model.safetensors: cannot be read: permission denied (mode 600, owner uid "
        f"{uid}, read as uid {uid})"
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file: no permission to deny")
def test_a_weight_file_of_mode_000_says_permission_denied(tmp_path):
    path = build(tmp_path, "ouro")
    (path / "model.safetensors").chmod(0)
    with pytest.raises(CheckpointError, match=r"cannot be read: permission denied \(mode 0,"):
        check_weight_files(path)


def test_bin_weights_only_are_named_with_the_safetensors_only_rule(tmp_path):
    path = build(tmp_path, "ouro")
    (path / "model.safetensors").unlink()
    for name in ("pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"):
        (path / name).write_bytes(b"PK")
    with pytest.raises(CheckpointError) as err:
        check_weight_files(path)
    assert str(err.value) == (
        f"{str(path)!r} has no .safetensors weight files, only PyTorch .bin files "
        "(pytorch_model-00001-of-00002.bin, pytorch_model-00002-of-00002.bin); rltserve loads "
        "safetensors only: convert them (transformers' save_pretrained writes safetensors)"
    )
    shards = "pytorch_model-00001-of-00002.bin, pytorch_model-00002-of-00002.bin"
    for name in ("a.bin", "b.bin", "c.bin"):  # (5 files: all named)
        (path / name).write_bytes(b"PK")
    with pytest.raises(CheckpointError) as err:
        check_weight_files(path)
    assert f".bin files (a.bin, b.bin, c.bin, {shards}); " in str(err.value)
    (path / "d.bin").write_bytes(b"PK")  # (6: the first 5, then "...")
    with pytest.raises(CheckpointError) as err:
        check_weight_files(path)
    assert f".bin files (a.bin, b.bin, c.bin, d.bin, {shards[:32]}, ...); " in str(err.value)


def test_a_quantized_checkpoint_is_refused_naming_its_method(tmp_path):
    cfg = {**CONFIGS["ouro"], "quantization_config": {"quant_method": "fp8"}}
    tensors = random_tensors(cfg)
    for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.up_proj.weight"):
        tensors[name] = tensors[name].to(torch.float8_e4m3fn)
        tensors[name.replace(".weight", ".weight_scale")] = torch.ones(1)
    path = write_checkpoint(tmp_path / "fp8", cfg, tensors)
    with pytest.raises(CheckpointError) as err:
        check_weight_files(path)
    assert str(err.value) == (
        f"{path}: a quantized checkpoint (config.json quantization_config: quant_method='fp8'; "
        "4 quantized tensors: model.layers.0.mlp.down_proj.weight (F8_E4M3), "
        "model.layers.0.mlp.down_proj.weight_scale, model.layers.1.mlp.up_proj.weight "
        "(F8_E4M3), model.layers.1.mlp.up_proj.weight_scale); quantized checkpoints are not "
        "supported: use the full-precision (float32, bfloat16, float16) one"
    )


def test_full_precision_weights_beside_a_quantization_config_load_with_a_warning(tmp_path, caplog):
    """Merged or dequantized checkpoints often keep the config's quantization_config: the
    weights are exact as stored, so they load (unquantized), with a warning saying so."""
    quant = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    cfg = {**CONFIGS["ouro"], "quantization_config": quant}
    path = write_checkpoint(tmp_path / "q", cfg, random_tensors(cfg))
    with caplog.at_level("WARNING", logger="rltserve.checkpoint_files"):
        check_weight_files(path)
    assert caplog.messages == [
        f"{path}: config.json has a quantization_config (quant_method='bitsandbytes') but the "
        "weights are full precision: they are loaded as stored, unquantized"
    ]
    load_model(path)
    caplog.clear()
    for odd in (None, "fp8"):  # (no dict: no quantization to judge)
        config = {**CONFIGS["ouro"], "quantization_config": odd}
        (path / "config.json").write_text(json.dumps(config))
        check_weight_files(path)
    (path / "config.json").write_text("[]")  # (read_config's to report)
    check_weight_files(path)
    assert caplog.messages == []


def test_the_engine_names_such_files_before_loading(tmp_path):
    from rltserve.config import EngineConfig
    from rltserve.core.engine import EngineCore

    path = build(tmp_path, "ouro")
    (path / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\n")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: a Git LFS pointer, not the"):
        EngineCore(EngineConfig.from_flat(model=str(path), num_blocks=8))


def _cache_snapshot(tmp_path: Path, source: Path) -> Path:
    """``source``'s files as a Hugging Face cache snapshot holds them: relative links into
    ``../../blobs``."""
    repo = tmp_path / "hub" / "models--someorg--ouro"
    snapshot = repo / "snapshots" / ("c0" * 20)
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for n, f in enumerate(sorted(source.iterdir())):
        os.replace(f, repo / "blobs" / f"b{n}")
        (snapshot / f.name).symlink_to(f"../../blobs/b{n}")
    return snapshot


def test_a_snapshot_copied_without_its_blobs_is_named_not_called_no_checkpoint(tmp_path):
    """``cp -r`` of a cache snapshot copies its relative links, which then point nowhere:
    the config and tokenizer files were called absent ("has no config.json, so it is not a
    checkpoint", "tokenizer_config.json but no tokenizer.json") though ``ls`` lists them."""
    import shutil

    from rltserve.models.loader import read_config
    from rltserve.models.tokenizer import TokenizerError, load_tokenizer
    from rltserve.preflight import check_checkpoint_dir

    source = build(tmp_path, "ouro", name="src")
    (source / "tokenizer_config.json").write_text("{}")
    copy = tmp_path / "models" / "ouro"
    shutil.copytree(_cache_snapshot(tmp_path, source), copy, symlinks=True)  # (cp -r)
    gone = tmp_path / "blobs" / "b0"
    want = (
        f"{copy}/config.json: a link to {gone}, which does not exist: a Hugging Face cache "
        "snapshot's link, copied without its blob; copy the snapshot with `cp -rL` (the files, "
        "not the links), or name the snapshot in the cache itself (so are the links "
        "tokenizer_config.json)"
    )
    with pytest.raises(ValueError) as err:
        check_checkpoint_dir(str(copy), "model=")
    assert str(err.value) == f"model='{copy}': {want}"
    with pytest.raises(TokenizerError) as err:
        load_tokenizer(copy)
    assert str(err.value) == want
    with pytest.raises(CheckpointError) as err:
        read_config(copy)
    assert str(err.value) == want.split(" (so are")[0]


def test_a_pruned_config_blob_in_a_snapshot_is_named(tmp_path):
    from rltserve.preflight import check_checkpoint_dir

    snapshot = _cache_snapshot(tmp_path, build(tmp_path, "ouro", name="src"))
    blob = (snapshot / "config.json").resolve()
    blob.rename(f"{blob}.incomplete")
    with pytest.raises(ValueError) as err:
        check_checkpoint_dir(str(snapshot))
    assert str(err.value) == (
        f"--model {snapshot}: {snapshot}/config.json: its download is incomplete (the blob "
        f"{blob.name}.incomplete in {blob.parent} is partial); download it again "
        "(`hf download someorg/ouro`)"
    )


def _safetensors(file: Path, header: dict, data: bytes = b"") -> Path:
    """A file laid out as safetensors: the header's length, the header, then ``data``."""
    raw = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return file


def test_the_edges_of_a_cut_file(tmp_path):
    """Shorter than the length field; cut within the header (a length past any real header is
    garbage, the loader's to report) or within the data, a header with ``__metadata__`` too;
    a file holding all its header describes, none included, is whole."""
    problem, f = checkpoint_files.weight_file_problem, tmp_path / "model.safetensors"
    again = "(an interrupted download or copy); download or copy it again"
    f.write_bytes(bytes(7))
    assert problem(f) == f"{f}: truncated: 7 bytes, not even a header's length {again}"
    f.write_bytes(bytes(8))  # (a zero length: no header to parse, the loader's)
    assert problem(f) is None
    f.write_bytes(struct.pack("<Q", 2**21) + b"{}")
    assert problem(f) == f"{f}: truncated: 10 bytes, within its {8 + 2**21}-byte header {again}"
    f.write_bytes(struct.pack("<Q", 2**41) + b"{}")
    assert problem(f) is None
    assert problem(_safetensors(f, {})) is None  # (no tensors: 10 bytes are all of it)
    entry = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
    raw = _safetensors(f, {"__metadata__": {"format": "pt"}, "w": entry}, bytes(16)).read_bytes()
    assert problem(f) is None
    f.write_bytes(raw[:-1])
    want = f"{f}: truncated: {len(raw) - 1} bytes of the {len(raw)} its header describes {again}"
    assert problem(f) == want
    (length,) = struct.unpack("<Q", raw[:8])
    f.write_bytes(raw[: 4 + length])  # (the header's last 4 bytes cut)
    assert (
        problem(f)
        == f"{f}: truncated: {4 + length} bytes, within its {8 + length}-byte header {again}"
    )


def test_what_is_no_dangling_link_or_regular_file_is_the_loaders(tmp_path):
    """An intact cache snapshot (every link resolves) has nothing to name; a link to nothing
    gets the cache-copy advice only when relative and into a ``blobs`` folder; a folder is not
    opened, an index naming no file names none."""
    snapshot = _cache_snapshot(tmp_path, build(tmp_path, "ouro", name="src"))
    check_weight_files(snapshot)
    assert checkpoint_files.missing_link_targets(snapshot) is None
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "relative").symlink_to("gone")
    (elsewhere / "absolute").symlink_to(tmp_path / "blobs" / "gone")
    for name, target in (
        ("relative", elsewhere / "gone"),
        ("absolute", tmp_path / "blobs" / "gone"),
    ):
        link = elsewhere / name
        assert (
            checkpoint_files.link_problem(link)
            == f"{link}: a link to {target}, which does not exist"
        )
    (elsewhere / "model.safetensors").mkdir()
    assert checkpoint_files.weight_file_problem(elsewhere / "model.safetensors") is None
    (elsewhere / "model.safetensors.index.json").write_text('{"weight_map": {"w": 5}}')
    check_weight_files(elsewhere)


def test_float64_weights_beside_a_quantization_config_are_full_precision(tmp_path, caplog):
    (tmp_path / "config.json").write_text('{"quantization_config": {"quant_method": "fp8"}}')
    entry = {"dtype": "F64", "shape": [2], "data_offsets": [0, 16]}
    _safetensors(tmp_path / "model.safetensors", {"w": entry}, bytes(16))
    with caplog.at_level("WARNING", logger="rltserve.checkpoint_files"):
        check_weight_files(tmp_path)
    assert "but the weights are full precision" in caplog.text
