"""vLLM's metric reader classes (``vllm.v1.metrics.reader``), the objects ``LLM.get_metrics``
returns, so that code written for vLLM can branch on them with ``isinstance``: ``Counter``,
``Gauge`` and ``Histogram`` (and ``Vector``, which vLLM fills only for speculative decoding's
per-position acceptance: nothing here returns one). Plain dataclasses with vLLM's fields in
vLLM's order; names are vLLM's ``vllm:...`` series names, without a ``_total`` suffix."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Counter", "Gauge", "Histogram", "Metric", "Vector"]


@dataclass
class Metric:
    """A series: its name (``vllm:...``) and its labels (``model_name``, ``engine``, ...)."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A count since the engine started."""

    value: int


@dataclass
class Vector(Metric):
    """An ordered list of counters (vLLM's speculative-decoding acceptance per position)."""

    values: list[int]


@dataclass
class Gauge(Metric):
    """A value at the time of reading."""

    value: float


@dataclass
class Histogram(Metric):
    """Observations by bucket: ``buckets`` maps each upper bound, as Prometheus writes it in
    its ``le`` label ("0.5", "1.0", ... and "+Inf"), to the observations at or below it
    (cumulative, so "+Inf" holds ``count``); ``sum`` adds up every observation."""

    count: int
    sum: float
    buckets: dict[str, int]
