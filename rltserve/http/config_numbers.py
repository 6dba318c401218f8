"""The number fields of ``ServerConfig`` checked: each a ValueError naming the field and its
range, before anything starts."""

from __future__ import annotations

from rltserve.sampling import MAX_LOGPROBS


def check_numbers(config: object, max_n: int) -> None:
    """``config``'s limits, sizes, timeouts and counts in their ranges (``max_n``: the
    largest ``max_n`` a server takes)."""
    for name, low in (("max_concurrent", 1), ("max_queued", 0), ("max_body_bytes", 1024)):
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name}={value!r}: must be an int >= {low}")
    if not isinstance(config.retry_after_s, int) or config.retry_after_s < 0:
        raise ValueError(f"retry_after_s={config.retry_after_s!r}: must be an int >= 0")
    if not config.startup_timeout_s > 0:
        raise ValueError(f"startup_timeout_s={config.startup_timeout_s!r}: must be > 0")
    if not config.drain_timeout_s >= 0:
        raise ValueError(f"drain_timeout_s={config.drain_timeout_s!r}: must be >= 0")
    bounds = (  # (field, least, most or None, None allowed)
        ("max_n", 1, max_n, False),
        ("max_stop", 0, None, False),
        ("max_stop_chars", 1, None, False),
        ("max_logprobs", 0, MAX_LOGPROBS, False),
        ("max_header_bytes", 256, None, False),
        ("max_tokens_limit", 1, None, True),
        ("max_loops_limit", 1, None, True),
        ("max_log_len", 0, None, True),
    )
    for name, low, high, optional in bounds:
        value = getattr(config, name)
        if value is None and optional:
            continue
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
        if not ok or (high is not None and value > high):
            where = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise ValueError(f"{name}={value!r}: must be an int {where}")
    for name in ("idle_timeout_s", "body_timeout_s", "stream_stall_timeout_s"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name}={value!r}: must be a number > 0")
    for name in ("stage_watchdog_s", "stage_restart_backoff_s", "stage_stable_s"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{name}={value!r}: must be a number >= 0")
    restarts = config.stage_restarts
    if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
        raise ValueError(f"stage_restarts={restarts!r}: must be an int >= 0")
