"""The contract between the scheduler and the runner: one ``StepPlan`` in, one ``StepResult`` out.

Everything here is plain Python values so that a plan can cross a process boundary. The scheduler
builds plans from the requests it owns; the runner turns a plan into tensors, runs the model once
and reports what the device decided. The runner never sees a ``Request``.

Depths are 1-based: ``depth`` is the loop a work item runs in this step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rltserve.sampling import SamplingParams


@dataclass(frozen=True)
class RequestSetup:
    """Sent once, in the first plan that mentions the request, so the runner can create its
    per-request device state (sampling generator, initial-state generator)."""

    request_id: str
    params: SamplingParams
    num_loops: int  # D_r: loops of a prompt token (and of every token under the `full` policy)
    seed: int  # effective seed of the request's generators (the engine derives one if unset)


@dataclass(frozen=True)
class ExitSpec:
    """The output position of a work item still owes a token (it has not exited yet).

    ``exit_now`` is True/False when the scheduler already knows whether this depth is the exit
    (fixed depth, delayed gate, trace replay); None asks the runner to apply the Ouro gate rule
    in this step: exit when ``depth >= max_loops`` or when ``threshold < 1``,
    ``depth >= min_loops`` and the updated CDF reaches ``threshold``.
    """

    exit_now: bool | None
    min_loops: int
    max_loops: int
    threshold: float
    survival: float  # S_{depth-1}: probability mass not yet assigned before this loop
    cdf: float  # CDF_{depth-1}


@dataclass(frozen=True)
class WorkItem:
    """Tokens ``[start, start + num_tokens)`` of one request, all at the same ``depth``.

    The item's last row is the *output position* when ``exit`` is set. The item's loops end after
    ``depth == ends_at``, or, when ``stop_at_exit``, as soon as its output position exits. When
    the model has coda attention (Huginn), every row of an ending item runs the coda (its coda KV
    is needed by later tokens); otherwise only an exiting output row does.
    """

    request_id: str
    start: int
    num_tokens: int
    depth: int
    ends_at: int
    stop_at_exit: bool
    block_table: list[int]  # blocks of the plane that loop `depth` reads and writes
    token_ids: list[int] | None = None  # set when depth == 1: the prelude runs for these rows
    boundary_table: list[int] | None = None  # prelude/coda plane (models with coda attention)
    exit: ExitSpec | None = None
    # last_exited copy-on-exit targets: the block holding position `start` in each plane of
    # depths depth+1 .. num_loops (in that order). Empty when no copy can be needed.
    exit_copy_blocks: list[int] = field(default_factory=list)
    # (prompt ids, output ids) when the request uses repetition/presence/frequency penalties.
    penalty_tokens: tuple[list[int], list[int]] | None = None

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass
class StepPlan:
    step_id: int
    items: list[WorkItem]
    new_requests: list[RequestSetup] = field(default_factory=list)
    # Requests whose runner state (in-flight hidden states, generators) must be dropped before
    # this step runs: finished, aborted or preempted.
    released: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(item.num_tokens for item in self.items)


@dataclass(frozen=True)
class ItemResult:
    """What the device decided for one work item that carried an ``ExitSpec``."""

    exited: bool
    survival: float  # S after this loop (gate models; 1.0 otherwise)
    cdf: float  # CDF after this loop (gate models; 0.0 otherwise)
    token_id: int = -1  # sampled token when exited
    logprob: float | None = None  # of the sampled token, when logprobs were asked for
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class StepResult:
    step_id: int
    # Aligned with plan.items: None for items that carried no ExitSpec.
    items: list[ItemResult | None]
    num_rows: int = 0  # rows run through the core loop
    num_coda_rows: int = 0
    error: str | None = None  # set when the step failed; the scheduler fails its requests
