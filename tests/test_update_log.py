"""``http.update_log``: which applied weight updates a restarted stage needs, and when their
files can no longer give back what they gave."""

from __future__ import annotations

import os

import numpy as np
import pytest
from safetensors.numpy import save_file

from rltserve.http.update_log import UpdateLog, UpdateLost, tensor_names


def _write(path, *names: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({n: np.zeros(2, dtype=np.float32) for n in names}, str(path), {"k": "v"})
    return str(path)


def test_tensor_names_are_read_from_the_header(tmp_path):
    assert tensor_names(_write(tmp_path / "a.safetensors", "x", "y")) == {"x", "y"}


def test_a_later_update_of_the_same_tensors_makes_an_earlier_one_unneeded(tmp_path):
    log = UpdateLog()
    first = _write(tmp_path / "1.safetensors", "x", "y")
    log.add([first])
    log.add([_write(tmp_path / "2" / "model.safetensors", "z")])  # (a checkpoint directory)
    log.add([_write(tmp_path / "3.safetensors", "x")])
    assert [u.paths for u in log.replay()] == [
        (first,),
        (str(tmp_path / "2" / "model.safetensors"),),
        (str(tmp_path / "3.safetensors"),),
    ]  # (y still comes from the first)
    log.add([_write(tmp_path / "4.safetensors", "x", "y")])
    os.remove(first)  # (no longer needed: its tensors were all written again)
    assert [u.paths for u in log.replay()] == [
        (str(tmp_path / "2" / "model.safetensors"),),
        (str(tmp_path / "4.safetensors"),),
    ]
    assert len(log) == 4


def test_a_needed_update_whose_file_changed_or_went_is_lost(tmp_path):
    log = UpdateLog()
    path = _write(tmp_path / "u.safetensors", "x")
    log.add([path])
    os.utime(path, ns=(1, 1))
    with pytest.raises(UpdateLost, match=r"update 1 \(\[.*u.safetensors'\]\): .* changed since"):
        log.replay()
    os.remove(path)
    with pytest.raises(UpdateLost, match="u.safetensors is gone"):
        log.replay()


def test_an_update_gone_before_it_was_recorded_is_needed_and_lost(tmp_path):
    log = UpdateLog()
    log.add([str(tmp_path / "vanished")])
    log.add([_write(tmp_path / "full.safetensors", "x")])
    with pytest.raises(UpdateLost, match="unreadable after it was applied: weights: .*vanished"):
        log.replay()
