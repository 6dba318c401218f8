"""Looped model families, the strict safetensors loader and the family registry.

The public names load lazily so that torch-free modules of this package (the tokenizer, chat
templates, the demo cache path) can be imported without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rltserve.models.base import AttentionFn, LoopedModel, LoopedSpec, noise_seed
    from rltserve.models.loader import CheckpointError, load_model, read_config, resolve_dtype
    from rltserve.models.registry import Family, get_family, supported_model_types

__all__ = [
    "AttentionFn",
    "CheckpointError",
    "Family",
    "LoopedModel",
    "LoopedSpec",
    "get_family",
    "load_model",
    "noise_seed",
    "read_config",
    "resolve_dtype",
    "supported_model_types",
]
_EXPORTS = {
    "AttentionFn": "rltserve.models.base",
    "LoopedModel": "rltserve.models.base",
    "LoopedSpec": "rltserve.models.base",
    "noise_seed": "rltserve.models.base",
    "CheckpointError": "rltserve.models.loader",
    "load_model": "rltserve.models.loader",
    "read_config": "rltserve.models.loader",
    "resolve_dtype": "rltserve.models.loader",
    "Family": "rltserve.models.registry",
    "get_family": "rltserve.models.registry",
    "supported_model_types": "rltserve.models.registry",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'rltserve.models' has no attribute {name!r}")
