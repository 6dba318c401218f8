"""Exit policies on the scheduler side (torch-free): which ExitSpec an output position carries,
and what the scheduler already knows about where it exits.

A request's exit mode is fixed when it is created:

- ``fixed``: no adaptive exit (``SamplingParams.adaptive_exit`` false), or trace replay
  (benchmarks): the exit depth is known before any loop runs;
- ``gate``: the Ouro gate rule (DESIGN §5) runs on the device in the step that computes the gate,
  so an exiting token reaches its coda in that same step; the scheduler learns the exit from the
  step's result;
- ``delayed``: the gate's decision after loop t takes effect after loop t+1, so when loop t+1 is
  planned the scheduler need not have read loop t's result yet (async scheduling).

On a model without a gate (Huginn, Nanbeige), ``gate`` and ``delayed`` apply the request's zero-shot
criterion (``Request.criterion``, ``step_criteria``) where the gate rule would run, except to the
first output: the prompt's last position runs the cap, as Hugging Face's adaptive generation
means to ("do not exit in prefill"; its guard never holds, docs/architecture.md), so every
prompt position writes every plane.
"""

from __future__ import annotations

from rltserve.core.plan import ExitSpec
from rltserve.core.request import InFlight, Request


def choose_exit_mode(request: Request, has_gate: bool, engine_mode: str) -> str:
    params = request.params
    if engine_mode == "trace" and params.trace_depths is not None:
        return "fixed"
    if not params.adaptive_exit:
        return "fixed"
    return "delayed" if engine_mode == "delayed" else "gate"


def fixed_exit_depth(request: Request, output_index: int) -> int:
    """Exit depth of output number ``output_index`` in fixed mode (trace replay or the cap)."""
    cap = request.max_loops
    trace = request.params.trace_depths
    if trace is not None and output_index < len(trace):
        return min(max(trace[output_index], 1), cap)
    return cap


def fixed_exit_loop(request: Request, output_index: int) -> int:
    """The loop whose step samples output number ``output_index`` in fixed mode: its exit
    depth, but the prompt's last loop for a first output whose coda waits for it
    (``Request.first_coda_at``)."""
    if output_index == 0 and request.first_coda_at:
        return request.num_loops
    return fixed_exit_depth(request, output_index)


def exit_spec(request: Request, item: InFlight, depth: int) -> ExitSpec:
    """The spec of the item's output position at loop ``depth``: one of the request's two
    shared specs (they differ only in ``exit_now``; plans treat them as immutable)."""
    specs = request.exit_specs
    if specs is None:
        params = request.params
        specs = request.exit_specs = tuple(
            ExitSpec(
                mode=request.exit_mode,
                exit_now=now,
                min_loops=params.min_loops,
                max_loops=request.max_loops,
                threshold=params.exit_threshold,
            )
            for now in (False, True)
        )
    if request.exit_mode != "fixed":
        if item.output_index == 0 and request.criterion is not None:
            params = request.params
            cap = request.max_loops
            return ExitSpec("fixed", depth >= cap, params.min_loops, cap, params.exit_threshold)
        return specs[0]
    return specs[depth >= fixed_exit_loop(request, item.output_index)]


def exit_known(request: Request, item: InFlight, depth: int) -> bool | None:
    """Whether loop ``depth`` is the exit of the item's output: True/False when known from the
    plan or from applied results, None while it depends on a result not yet applied."""
    if not item.has_output:
        return False
    if item.exit_depth is not None:
        return depth >= item.exit_depth
    if depth >= request.max_loops:
        return True
    if request.exit_mode == "fixed" or (item.output_index == 0 and request.criterion):
        return depth >= fixed_exit_loop(request, item.output_index)
    if request.exit_mode == "delayed":
        if item.delayed_exit_at is not None:
            return depth >= item.delayed_exit_at
        # Loop d exits only if loop d-1's gate asked for it; a known "no" is known.
        return False if item.applied >= depth - 1 else None
    return False if item.applied >= depth else None
