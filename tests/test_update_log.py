"""``core.update_log``: which applied weight updates a restarted stage needs, and when their
files can no longer give back what they gave."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from rltserve.core.update_log import UpdateLog, UpdateLost, stamps, tensor_names


def _write(path, *names: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({n: np.zeros(2, dtype=np.float32) for n in names}, str(path), {"k": "v"})
    return str(path)


def test_tensor_names_are_read_from_the_header(tmp_path):
    assert tensor_names(_write(tmp_path / "a.safetensors", "x", "y")) == {"x", "y"}


def _add(log: UpdateLog, path: str, version: int) -> None:
    log.add([path], version, stamps([path]))


def _paths(log: UpdateLog) -> list[str]:
    needed, _ = log.replay()
    return [u.paths[0] for u in needed]


def test_a_later_update_of_the_same_tensors_makes_an_earlier_one_unneeded(tmp_path):
    log = UpdateLog()
    first = _write(tmp_path / "1.safetensors", "x", "y")
    directory = _write(tmp_path / "2" / "model.safetensors", "z")
    _add(log, first, 1)
    _add(log, str(tmp_path / "2"), 2)  # (a checkpoint directory)
    _add(log, _write(tmp_path / "3.safetensors", "x"), 3)
    assert _paths(log) == [first, str(tmp_path / "2"), str(tmp_path / "3.safetensors")]
    assert directory  # (y still comes from the first)
    _add(log, _write(tmp_path / "4.safetensors", "x", "y"), 4)
    os.remove(first)  # (no longer needed: its tensors were all written again)
    assert _paths(log) == [str(tmp_path / "2"), str(tmp_path / "4.safetensors")]
    assert len(log) == 2 and log.replay()[1] == 4  # (the superseded ones are dropped)


def test_updates_are_ordered_by_the_version_they_made_not_by_when_recorded(tmp_path):
    """Two overlapping requests: the one the stage applied second may come back first."""
    log = UpdateLog()
    a = _write(tmp_path / "a.safetensors", "w")
    b = _write(tmp_path / "b.safetensors", "w")
    _add(log, b, 2)
    _add(log, a, 1)
    assert _paths(log) == [b] and log.replay()[1] == 2


def test_a_needed_update_whose_file_changed_or_went_is_lost(tmp_path):
    log = UpdateLog()
    path = _write(tmp_path / "u.safetensors", "x")
    _add(log, path, 1)
    os.utime(path, ns=(1, 1))
    with pytest.raises(UpdateLost, match=r"update 1 \(\[.*u.safetensors'\]\): .* changed since"):
        log.replay()
    os.remove(path)
    with pytest.raises(UpdateLost, match="u.safetensors is gone"):
        log.replay()


def test_an_update_whose_files_changed_while_it_ran_or_went_is_lost(tmp_path):
    log = UpdateLog()
    path = _write(tmp_path / "u.safetensors", "x")
    before = stamps([path])
    os.utime(path, ns=(1, 1))
    log.add([path], 1, before)
    log.add([str(tmp_path / "vanished")], 2, "weights: gone")
    with pytest.raises(UpdateLost, match="update 1 .*its files changed while it ran"):
        log.replay()
    log = UpdateLog()
    log.add([str(tmp_path / "vanished")], 1, "weights: gone")
    _add(log, _write(tmp_path / "full.safetensors", "x"), 2)  # (what it changed is unknown)
    with pytest.raises(UpdateLost, match="update 1 .*unreadable before it: weights: gone"):
        log.replay()
    torn = _write(tmp_path / "torn.safetensors", "x")
    before = stamps([torn])
    Path(torn).write_bytes(b"\x01")  # (torn as the update ran: shorter than a length field)
    log = UpdateLog()
    log.add([torn], 1, before)
    with pytest.raises(UpdateLost, match="unreadable after it"):
        log.replay()
