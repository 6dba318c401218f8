"""Weight files the loader could not tell apart from corrupt ones, named
(``checkpoint_files``): a Git LFS pointer, an interrupted Hugging Face download, a dangling
shard link, an unreadable file, ``.bin`` weights only, quantized weights; the loader and the
engine name them before parsing, and a weight update from such a directory is refused alike."""

from __future__ import annotations

import json
import os
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
    (path / "config.json").write_text(json.dumps({**CONFIGS["ouro"], "quantization_config": None}))
    check_weight_files(path)
    assert caplog.messages == []


def test_the_engine_names_such_files_before_loading(tmp_path):
    from rltserve.config import EngineConfig
    from rltserve.core.engine import EngineCore

    path = build(tmp_path, "ouro")
    (path / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\n")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: a Git LFS pointer, not the"):
        EngineCore(EngineConfig.from_flat(model=str(path), num_blocks=8))
