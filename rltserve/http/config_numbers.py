"""The number fields of ``ServerConfig`` checked: each a ValueError naming the field and its
range, before anything starts."""

from __future__ import annotations

from rltserve.caller_values import is_int, is_number
from rltserve.sampling import MAX_LOGPROBS


def check_numbers(config: object, max_n: int) -> None:
    """``config``'s limits, sizes, timeouts and counts in their ranges (``max_n``: the
    largest ``max_n`` a server takes)."""
    for name, low in (("max_concurrent", 1), ("max_queued", 0), ("max_body_bytes", 1024)):
        value = getattr(config, name)
        if not is_int(value) or value < low:
            raise ValueError(f"{name}={value!r}: must be an int >= {low}")
    # (a str, as a value read from the environment is, refused here: comparing it would be a
    # TypeError naming no field)
    for name in ("startup_timeout_s", "idle_timeout_s", "body_timeout_s", "stream_stall_timeout_s"):
        value = getattr(config, name)
        if not is_number(value) or not value > 0:
            raise ValueError(f"{name}={value!r}: must be a number > 0")
    for name in (
        "drain_timeout_s",
        "stage_watchdog_s",
        "stage_restart_backoff_s",
        "stage_stable_s",
    ):
        value = getattr(config, name)
        if not is_number(value) or value < 0:
            raise ValueError(f"{name}={value!r}: must be a number >= 0")
    bounds = (  # (field, least, most or None, None allowed)
        ("retry_after_s", 0, None, False),
        ("stage_restarts", 0, None, False),
        ("max_header_count", 1, None, False),
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
        ok = is_int(value) and value >= low
        if not ok or (high is not None and value > high):
            where = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise ValueError(f"{name}={value!r}: must be an int {where}")
