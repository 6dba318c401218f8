"""StepOutputs and to_device on the CPU (the CUDA path is checked by the gpu-marked test)."""

from __future__ import annotations

import pytest
import torch

from rltserve.core.staging import StepOutputs, to_device


def test_to_device_infers_and_keeps_dtypes():
    cpu = torch.device("cpu")
    assert to_device([1, 2], cpu).dtype == torch.int64
    assert to_device([0.5], cpu).dtype == torch.float32
    assert to_device([1, 2], cpu, torch.float32).tolist() == [1.0, 2.0]


def _fill(outputs: StepOutputs) -> dict:
    parts = {
        "tokens": torch.tensor([3, 2**40 + 1, 0]),
        "gate": torch.tensor([[0.25, 0.75], [1.0 / 3.0, 0.1]], dtype=torch.float32),
        "crossed": torch.tensor([True, False]),
        "empty": torch.zeros(0, 4),
    }
    for name, t in parts.items():
        outputs.add(name, t)
    return {name: t.tolist() for name, t in parts.items()}


def test_outputs_read_as_lists_on_cpu():
    outputs = StepOutputs(torch.device("cpu"))
    want = _fill(outputs)
    outputs.stage()
    assert outputs.ready()
    assert outputs.read() == want
    assert outputs.read() == want  # cached
    with pytest.raises(RuntimeError):
        outputs.add("late", torch.zeros(1))


@pytest.mark.gpu
def test_outputs_round_trip_exactly_through_pinned_memory():
    dev = torch.device("cuda")
    outputs = StepOutputs(dev)
    want = _fill(outputs)
    outputs._parts = [(n, t.to(dev)) for n, t in outputs._parts]
    outputs.stage()
    got = outputs.read()
    assert got == want
    assert isinstance(got["tokens"][1], int) and isinstance(got["crossed"][0], bool)
    assert to_device([5, 6], dev).device.type == "cuda"
