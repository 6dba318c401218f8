"""vLLM's ``LLM(...)`` arguments that scripts written for it pass, as rltserve takes them.

- ``trust_remote_code``: accepted and without effect: rltserve never runs a checkpoint's code
  (the model families are built in).
- ``tensor_parallel_size``: 1 only. One engine runs on one device; for more, run replicas
  (``rltserve.ray``).
- ``enforce_eager=True``: no CUDA graphs (``cuda_graphs=False``, the default anyway).
- ``gpu_memory_utilization``: on CUDA, when neither ``num_blocks`` nor ``kv_cache_gb`` is given,
  the KV pool gets that share of the device's memory less the weights and a reserve for
  activations (``kv_budget_bytes``); on the CPU it has no effect (``kv_cache_gb`` sizes the
  pool there, as vLLM's CPU backend has its own setting).
- ``tokenizer``: a directory to load the tokenizer from instead of the checkpoint's.
- ``dtype``: also vLLM's ``auto`` (the checkpoint's), ``half`` and ``float``
  (``preflight.resolve_dtype``).
"""

from __future__ import annotations

from pathlib import Path

from rltserve.preflight import resolve_dtype

# What the weights and the KV pool leave of the device for activations and the allocator.
ACTIVATION_RESERVE_BYTES = 2**30
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def check_parallel(tensor_parallel_size: int) -> None:
    if tensor_parallel_size != 1:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size!r}: rltserve runs an engine on one "
            "device; for more devices run replicas (rltserve.ray.generate, serve --replicas)"
        )


def check_utilization(utilization: float) -> None:
    ok = isinstance(utilization, (int, float)) and not isinstance(utilization, bool)
    if not ok or not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization={utilization!r}: must be in (0, 1]")


def kv_budget_bytes(utilization: float, total_bytes: int, weight_bytes: int) -> int:
    """The KV pool's share of a device of ``total_bytes`` used up to ``utilization`` by the
    engine: what the weights and ``ACTIVATION_RESERVE_BYTES`` leave. ValueError when that is
    nothing."""
    check_utilization(utilization)
    budget = int(utilization * total_bytes) - weight_bytes - ACTIVATION_RESERVE_BYTES
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization}: {utilization * total_bytes / 2**30:.1f} GiB "
            f"of the device leave no room for the KV cache beside the weights "
            f"({weight_bytes / 2**30:.1f} GiB) and the activations"
        )
    return budget


def kv_cache_gb_for(utilization: float, device: str, model: str, dtype: str) -> float | None:
    """``kv_cache_gb`` for ``gpu_memory_utilization`` on ``device`` (None off CUDA)."""
    check_utilization(utilization)
    if not device.startswith("cuda"):
        return None
    import torch

    total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    stored = resolve_dtype("auto", model)
    files = sum(f.stat().st_size for f in Path(model).glob("*.safetensors"))
    weights = files * _ITEMSIZE.get(dtype, 4) // _ITEMSIZE[stored]
    return kv_budget_bytes(utilization, total, weights) / 2**30
