"""vLLM's ``--show-hidden-metrics-for-version``: series vLLM deprecated and then hid, shown again
for dashboards and alerts built against the version that still exported them.

rltserve exports what vLLM's current release (0.12) does by default. vLLM hid
``gpu_cache_usage_perc`` and ``gpu_prefix_cache_queries``/``_hits`` in 0.11 (renamed
``kv_cache_usage_perc`` and ``prefix_cache_*`` in 0.9.2) and ``time_per_output_token_seconds``
in 0.12 (renamed ``inter_token_latency_seconds`` in 0.11). vLLM shows a release's hidden series
only for the previous minor version; rltserve is not versioned with vLLM, so a version here
means the release a dashboard was built for: every series that release exported by default and
vLLM hides now comes back (0.10 and older: all four; 0.11: ``time_per_output_token_seconds``;
0.12 and later: none). Torch- and prometheus-free: the config checks the flag with it."""

from __future__ import annotations

import re

GPU_CACHE_USAGE = "gpu_cache_usage_perc"
GPU_PREFIX_CACHE_QUERIES = "gpu_prefix_cache_queries"
GPU_PREFIX_CACHE_HITS = "gpu_prefix_cache_hits"
TIME_PER_OUTPUT_TOKEN = "time_per_output_token_seconds"

# (major, minor) of the last vLLM release that exported them by default -> the series.
_LAST_SHOWN = {
    (0, 10): (GPU_CACHE_USAGE, GPU_PREFIX_CACHE_QUERIES, GPU_PREFIX_CACHE_HITS),
    (0, 11): (TIME_PER_OUTPUT_TOKEN,),
}
_VERSION = re.compile(r"v?(\d+)\.(\d+)(?:\.\d+)?")


def shown_hidden_metrics(version: str | None) -> frozenset[str]:
    """The hidden series (names without prefix) that ``version`` (``major.minor``, an optional
    patch number; None: the flag not given) exported by default; ValueError for another
    form."""
    if version is None:
        return frozenset()
    match = _VERSION.fullmatch(version.strip()) if isinstance(version, str) else None
    if match is None:
        raise ValueError(
            f"show_hidden_metrics_for_version={version!r}: must be a vLLM version such as 0.11"
        )
    wanted = (int(match[1]), int(match[2]))
    return frozenset(
        name for last, names in _LAST_SHOWN.items() if wanted <= last for name in names
    )
