"""Looped model families, the strict safetensors loader and the family registry."""

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
