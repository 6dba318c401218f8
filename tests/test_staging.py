"""StepOutputs and to_device on the CPU (the CUDA path is checked by the gpu-marked test)."""

from __future__ import annotations

import pytest
import torch

from rltserve.core.staging import StepOutputs, host_tensor, to_device


def test_to_device_infers_and_keeps_dtypes():
    cpu = torch.device("cpu")
    assert to_device([1, 2], cpu).dtype == torch.int64
    assert to_device([0.5], cpu).dtype == torch.float32
    assert to_device([1, 2], cpu, torch.float32).tolist() == [1.0, 2.0]


@pytest.mark.parametrize(
    "values, dtype",
    [
        ([1, 2, 3], None),
        ([1.5, 2], None),
        ([1, 2.5], None),  # mixed: torch's inference (float)
        ([True, False], None),
        ([], None),
        ([], torch.float32),
        ([1, 2], torch.float32),
        ([1 / 3], torch.float32),
        ([2**62, -(2**62)], None),
        ([2**63], None),  # out of int64: torch's rules (uint64 or an error) either way
        ([1, 2], torch.int32),
        ([1.7, -1.7], torch.int64),  # truncation, as torch.tensor
        ([3, 0], torch.bool),
        ((4, 5), None),  # any sequence
    ],
)
def test_host_tensor_equals_torch_tensor(values, dtype):
    try:
        want = torch.tensor(values, dtype=dtype)
    except Exception as exc:  # the same error type is expected
        with pytest.raises(type(exc)):
            host_tensor(values, dtype)
        return
    got = host_tensor(values, dtype)
    assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


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
