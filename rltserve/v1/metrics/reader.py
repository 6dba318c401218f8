"""vLLM's ``vllm.v1.metrics.reader``: ``from rltserve.v1.metrics.reader import Counter, Gauge,
Histogram, Vector``, the classes of ``LLM.get_metrics``' series."""

from __future__ import annotations

from rltserve.metrics_reader import Counter, Gauge, Histogram, Metric, Vector

__all__ = ["Counter", "Gauge", "Histogram", "Metric", "Vector"]
