"""Exit policies: how the scheduler fills an item's ``ExitSpec`` (torch-free).

The Ouro gate rule itself (DESIGN §5) runs on the device inside the step (``gate_mode`` below
returns ``exit_now=None`` for it) so an exiting token reaches its coda in the same step. The
other policies are decided here, before the step:

- fixed depth: models without a gate, or ``exit_threshold >= 1``: exit at ``max_loops``;
- delayed: the gate's decision after loop t takes effect after loop t+1, so it is known when the
  step for loop t+1 is planned (the runner still reports the gate state every loop);
- trace: replay the request's ``trace_depths`` (benchmarks), the cap applying.
"""

from __future__ import annotations

from rltserve.core.plan import ExitSpec
from rltserve.core.request import InFlight, Request


def exit_spec(request: Request, item: InFlight, has_gate: bool, exit_mode: str) -> ExitSpec:
    """The ExitSpec of ``item``'s output position for the loop ``item.depth``."""
    params = request.params
    cap = request.max_loops
    depth = item.depth
    adaptive = has_gate and params.adaptive_exit
    if exit_mode == "trace" and params.trace_depths is not None:
        k = len(request.output_token_ids)
        target = params.trace_depths[k] if k < len(params.trace_depths) else cap
        exit_now: bool | None = depth >= min(max(target, 1), cap)
    elif not adaptive:
        exit_now = depth >= cap
    elif exit_mode == "delayed":
        exit_now = depth >= cap or item.exit_pending
    else:
        exit_now = None
    return ExitSpec(
        exit_now=exit_now,
        min_loops=params.min_loops,
        max_loops=cap,
        threshold=params.exit_threshold,
        survival=item.survival,
        cdf=item.cdf,
    )


def delayed_wants_exit(request: Request, depth: int, cdf: float) -> bool:
    """Whether the gate state after loop ``depth`` asks the next loop to be the exit."""
    params = request.params
    return params.adaptive_exit and depth >= params.min_loops and cdf >= params.exit_threshold
