"""Minimal Prometheus text exposition (format 0.0.4): counters, gauges and histograms with
labels. Only the serving metrics use it, and they render from the event loop thread, so no
locking is needed."""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
Labels = tuple[tuple[str, str], ...]


def format_value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def format_labels(labels: Iterable[tuple[str, str]]) -> str:
    parts = []
    for name, value in labels:
        escaped = value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
        parts.append(f'{name}="{escaped}"')
    return "{" + ",".join(parts) + "}" if parts else ""


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str) -> None:
        self.name = name
        self.help = help_text

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    """A monotonically increasing value per label set (the name carries its ``_total``)."""

    kind = "counter"

    def __init__(self, name: str, help_text: str) -> None:
        super().__init__(name, help_text)
        self._values: dict[Labels, float] = {}

    def inc(self, amount: float = 1.0, labels: Labels = ()) -> None:
        self._values[labels] = self._values.get(labels, 0.0) + amount

    def value(self, labels: Labels = ()) -> float:
        return self._values.get(labels, 0.0)

    def render(self, const: Labels) -> list[str]:
        values = self._values or {(): 0.0}
        return self.header() + [
            f"{self.name}{format_labels(const + labels)} {format_value(v)}"
            for labels, v in sorted(values.items())
        ]


class Gauge(_Metric):
    kind = "gauge"

    def render_value(self, value: float, const: Labels) -> list[str]:
        return self.header() + [f"{self.name}{format_labels(const)} {format_value(value)}"]


class Histogram(_Metric):
    """Cumulative buckets (``le``), ``_sum`` and ``_count`` of one label set."""

    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: Sequence[float]) -> None:
        super().__init__(name, help_text)
        self.buckets = tuple(sorted(buckets))
        self._counts = [0] * len(self.buckets)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self._counts):
            self._counts[i] += 1
        self.count += 1
        self.sum += value

    def render(self, const: Labels) -> list[str]:
        lines = self.header()
        running = 0
        for bound, n in zip(self.buckets, self._counts):
            running += n
            le = format_labels(const + (("le", format_value(bound)),))
            lines.append(f"{self.name}_bucket{le} {format_value(running)}")
        inf = format_labels(const + (("le", "+Inf"),))
        lines.append(f"{self.name}_bucket{inf} {format_value(self.count)}")
        lines.append(f"{self.name}_sum{format_labels(const)} {format_value(self.sum)}")
        lines.append(f"{self.name}_count{format_labels(const)} {format_value(self.count)}")
        return lines
