"""Shared pieces of the metrics tests (no tests here): /metrics text parsed into samples looked
up by name and labels, vLLM's engine label, and engine stats with chosen values."""

from __future__ import annotations

import dataclasses

from prometheus_client.parser import text_string_to_metric_families

from rltserve.core.engine import EngineStats


class Samples(dict):
    """(sample name, sorted labels) -> value; looked up with its labels in any order."""

    def __getitem__(self, key: tuple[str, tuple]) -> float:
        return super().__getitem__((key[0], tuple(sorted(key[1]))))

    def get(self, key: tuple[str, tuple], default=None):
        return super().get((key[0], tuple(sorted(key[1]))), default)

    def __contains__(self, key) -> bool:
        return super().__contains__((key[0], tuple(sorted(key[1]))))


def samples(text: str) -> Samples:
    """(sample name, sorted labels) -> value, parsed by prometheus-client's own parser."""
    out = Samples()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            dict.__setitem__(out, (s.name, tuple(sorted(s.labels.items()))), s.value)
    return out


ENGINE = ("engine", "0")  # (vLLM's label of its one engine, on every engine series)


def stats(**values) -> EngineStats:
    zeros = {f.name: 0 for f in dataclasses.fields(EngineStats)}
    return EngineStats(**{**zeros, **values})
