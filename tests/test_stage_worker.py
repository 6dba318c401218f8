"""The stage worker's process settings."""

from __future__ import annotations

import gc

from rltserve.core.stage_worker import GC_GEN0_THRESHOLD, tune_gc


def test_tune_gc_freezes_what_exists_and_collects_less_often():
    before = gc.get_threshold()
    try:
        previous = tune_gc()
        assert previous == before
        assert gc.get_threshold()[0] == GC_GEN0_THRESHOLD
        assert gc.get_freeze_count() > 0
        # Cycles are still collected.
        cycle: list = []
        cycle.append(cycle)
        del cycle
        assert gc.collect() >= 1
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
