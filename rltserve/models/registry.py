"""``config.json`` ``model_type`` -> model family: its config class, model class and checkpoint
layout.

A family's checkpoint layout has three parts, all functions of the parsed config:
- ``tensor_shapes``: every tensor the checkpoint must hold, exactly (name -> shape);
- ``param_sources``: module parameter -> checkpoint tensors concatenated (dim 0) to build it;
- ``tied``: checkpoint-only copies that must equal another tensor (copy -> source) and are then
  dropped in favour of the source. Remaining checkpoint-only names (``buffers``) are ignored after
  their shape is checked. Both may be absent from a checkpoint (the model computes what a buffer
  holds from the config; see ``huginn.freqs_cis``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rltserve.models import huginn, nanbeige, ouro
from rltserve.models.base import LoopedModel


@dataclass(frozen=True)
class Family:
    model_type: str
    config_cls: type
    model_cls: type[LoopedModel]
    tensor_shapes: Callable[[Any], dict[str, tuple[int, ...]]]
    param_sources: Callable[[Any], dict[str, tuple[str, ...]]]
    tied: Mapping[str, str] = field(default_factory=dict)
    buffers: tuple[str, ...] = ()

    def parse_config(self, raw: dict[str, Any]) -> Any:
        """Raw config.json dict -> the family's frozen config (ValueError on bad values)."""
        return self.config_cls.from_dict(raw)  # type: ignore[attr-defined]


FAMILIES: dict[str, Family] = {
    ouro.FAMILY: Family(
        model_type=ouro.FAMILY,
        config_cls=ouro.OuroConfig,
        model_cls=ouro.OuroModel,
        tensor_shapes=ouro.tensor_shapes,
        param_sources=ouro.param_sources,
    ),
    nanbeige.FAMILY: Family(
        model_type=nanbeige.FAMILY,
        config_cls=nanbeige.NanbeigeConfig,
        model_cls=nanbeige.NanbeigeModel,
        tensor_shapes=nanbeige.tensor_shapes,
        param_sources=nanbeige.param_sources,
    ),
    huginn.FAMILY: Family(
        model_type=huginn.FAMILY,
        config_cls=huginn.HuginnConfig,
        model_cls=huginn.HuginnModel,
        tensor_shapes=huginn.tensor_shapes,
        param_sources=huginn.param_sources,
        tied=dict(huginn.TIED),
        buffers=huginn.BUFFERS,
    ),
}


def supported_model_types() -> list[str]:
    return sorted(FAMILIES)


def get_family(model_type: object) -> Family:
    """The family registered for ``model_type``; ValueError listing the supported types."""
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: "
            + ", ".join(supported_model_types())
        )
    return family
