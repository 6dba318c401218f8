"""The contract between the scheduler and the runner: one ``StepPlan`` in, one ``StepResult`` out.

Everything here is plain Python values so that a plan can cross a process boundary. The scheduler
builds plans from the requests it owns; the runner turns a plan into tensors, runs the model once
and reports what the device decided. The runner never sees a ``Request``.

Depths are 1-based: ``depth`` is the loop a work item runs in this step.

Carried decode tokens: a ``WorkItem`` with ``carry`` set is planned once, at its first loop; the
runner then runs its next loops by itself, one per step (before the plan's own items), until it
ends: its loop ``ends_at``, or the exit of its output when ``stop_at_exit``, or a plan that
releases or preempts its request. Its results come back in ``StepResult.carried`` when its output
exits, when the delayed rule decides its exit and when it ends (``CarriedEvents``, its first
loop's included). Planning then costs per token started, not per loop run. The next token of a
request whose carried token has ended usually starts as ``StepPlan.continued``: a key, not an
item (the runner has what it needs from the token before it; one entering a new KV block also
gets its new tables, ``StepPlan.moved``).

Invariant: a plan and its result are never changed once built. The per-row types (``WorkItem``,
``ExitSpec``, ``ItemResult``) are nevertheless plain slotted dataclasses, not frozen ones: one
of each is built per row per step, and a frozen dataclass takes about 2.5x as long to build.
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
    # The prompt, sent only when the request uses repetition/presence/frequency penalties: the
    # runner keeps the output history itself, so penalties never wait for the CPU.
    prompt_token_ids: list[int] | None = None
    # A request resumed after preemption: how many tokens it has already sampled, the draws
    # the sampling generator skips (each sampled token draws one ``Exp(1)`` row of the
    # vocabulary), so the continuation draws what an uninterrupted run draws; its outputs so
    # far (forced thinking ids too) seed the penalty history when ``prompt_token_ids`` is set,
    # and the guide of structured outputs (sent for those two only).
    num_sampled: int = 0
    output_token_ids: list[int] | None = None
    # min_tokens (vLLM's rule): the ids it may not sample (EOS unless ignored, and
    # stop_token_ids) while fewer than min_tokens outputs exist, i.e. for a token sampled at
    # a position below ``banned_below`` (the token sampled at position p is output number
    # p + 1 - len(prompt), counted from 0).
    banned_ids: tuple[int, ...] = ()
    banned_below: int = 0
    # The request's rollbacks so far (``Request.epoch``): a resumed request's runner state
    # starts there, so the items planned for it are not taken for stale ones.
    epoch: int = 0


@dataclass(slots=True)
class ExitSpec:
    """How the output position of a work item decides its exit at this loop.

    - ``fixed``: ``exit_now`` says it (fixed depth, trace replay), known at planning time;
    - ``gate``: the Ouro rule on this loop's gate: exit when ``depth >= max_loops`` or when
      ``threshold < 1``, ``depth >= min_loops`` and the updated CDF reaches ``threshold``;
    - ``delayed``: the same rule, one loop late: the gate after loop t decides an exit after loop
      t+1, so a step can be planned before the previous step's gate has been read.

    The gate state (survival, CDF, the delayed decision) lives with the runner between loops, and
    the runner ignores the spec once the position has exited.
    """

    mode: str
    exit_now: bool
    min_loops: int
    max_loops: int
    threshold: float


@dataclass(slots=True)
class Carry:
    """What the runner needs to run a decode token's later loops without a plan: the values of
    the per-loop ``WorkItem`` fields at every depth it can reach."""

    key: int  # the scheduler's name for the token in ``CarriedEvents``
    tables: list[list[int]]  # the block table of loop d at index d - 1 (d = 1 .. ends_at)
    specs: tuple[ExitSpec, ExitSpec] | None  # the output's spec: (exit_now False, True)
    exit_at: int  # fixed exits: the loop whose spec says exit_now; 0 when the gate decides
    # last_exited: the blocks holding ``start`` on the planes of depths 1..num_loops (loop d
    # copies into those of depths d+1..); empty when no copy can be needed.
    copy_blocks: list[int]


@dataclass(slots=True)
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
    # Inputs of the prelude at depth 1: the prompt tokens of a chunk. None for a decode token:
    # its input is the request's last sampled token, which the runner already holds.
    token_ids: list[int] | None = None
    boundary_table: list[int] | None = None  # prelude/coda plane (models with coda attention)
    exit: ExitSpec | None = None
    # last_exited copy-on-exit targets: the block holding position `start` in each plane of
    # depths depth+1 .. num_loops (in that order). Empty when no copy can be needed. An item
    # without `exit` that carries them (tokens recomputed after preemption, at their recorded
    # exit depth) lists them for every position start..end-1 in turn.
    exit_copy_blocks: list[int] = field(default_factory=list)
    # Token pipelining: the last row's state after this loop drafts the next position's input.
    draft: bool = False
    # The request's rollback count when the item was created; the runner skips items of an
    # older epoch (planned before a rollback the runner has already done).
    epoch: int = 0
    # Set on a decode token's first loop when the runner runs its later loops by itself.
    carry: Carry | None = None
    # Coda attention: the runner keeps the last row's state after this loop (earlier than
    # ``ends_at``) and runs its coda on it when the item ends (``InFlight.coda_state_at``).
    coda_state_at: int = 0
    # prompt_logprobs, on a prompt item's loop ``max_loops`` (its last but under Ouro's gate,
    # whose prompts loop on to the model's count): the prompt tokens its rows predict (row k
    # predicts ``prompt_targets[k]``; one fewer than its rows when it holds the last).
    prompt_targets: list[int] | None = None
    # ... or, bounded thinking with logprobs, a replayed item's output tokens (up to a forced
    # one: ``Request.forced_targets``). The top logprobs to give with each target's.
    targets_top: int = 0
    # The row that predicts ``prompt_targets[0]`` (a budget of 0 scores the first forced token
    # at a prompt chunk's last row alone, without ``prompt_logprobs``).
    targets_from: int = 0

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass
class StepPlan:
    step_id: int
    items: list[WorkItem]
    new_requests: list[RequestSetup] = field(default_factory=list)
    # Requests whose runner state (in-flight hidden states, generators, swapped KV) must be
    # dropped before this step runs: finished or aborted.
    released: list[str] = field(default_factory=list)
    # Preempted requests: the runner drops their in-flight state (a resume sends a new setup).
    preempted: list[str] = field(default_factory=list)
    # Swap mode, before anything else in the step: the KV of these blocks (every plane, in
    # ``KVManager.all_blocks`` order) goes to host swap space under the request id ...
    swap_out: list[tuple[str, list[int]]] = field(default_factory=list)
    # ... and comes back into these blocks (same order), after ``swap_out`` and ``released``.
    swap_in: list[tuple[str, list[int]]] = field(default_factory=list)
    # Then each (source, target) block is copied, every slot: a follower of a group gets its
    # leader's partly filled last prompt block (``prompt_sharing.py``).
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Carried decode tokens the runner starts by itself, after its carried rows and before the
    # items: (request id, the key of the request's previous carried token, this token's key).
    # The token is the next position of that token, which has ended, with the same ``Carry``
    # but its key (the same tables, specs, fixed exit and copy-on-exit blocks when it lies in
    # the same KV block; ``moved`` otherwise) and the same first-loop fields; its input is the
    # token that one sampled.
    # The scheduler decides it as any start (most with synchronous scheduling where its
    # predecessor's end is applied: ``standing.py``); one tuple instead of a ``WorkItem`` and a
    # ``Carry`` saves both sides their per-token work (a decode batch starts a token per
    # request every few steps). In the order their predecessors ended (the runner's row
    # order), continuations of tokens that ended earlier last.
    continued: list[tuple[str, int, int]] = field(default_factory=list)
    # Continued tokens that enter a new KV block (every block_size tokens): what their
    # ``Carry`` has that their predecessor's has not, (this token's key, its tables of loops
    # 1..ends_at, its boundary table or None, its copy-on-exit blocks: ``Carry.copy_blocks``).
    # The rest of their item is their predecessor's (its first loop's block table is
    # ``tables[0]``, its ``exit_copy_blocks`` are ``copy_blocks[1:]``, as ``ItemMaker``
    # builds a carried token's item).
    moved: list[tuple[int, list[list[int]], list[int] | None, list[int]]] = field(
        default_factory=list
    )

    @property
    def num_tokens(self) -> int:
        return sum(item.num_tokens for item in self.items)


@dataclass(slots=True)
class ItemResult:
    """What the device decided for one work item whose output position had not exited."""

    exited: bool
    # (The gate's survival and CDF stay on the device with the runner: DESIGN §5.)
    exit_next: bool = False  # delayed mode: the next loop will be the exit
    rollback: bool = False  # the token contradicts the draft the next position ran on
    token_id: int = -1  # sampled token when exited
    logprob: float | None = None  # of the sampled token, when logprobs were asked for
    top_logprobs: list[tuple[int, float]] | None = None
    rank: int | None = None  # of the sampled token, when logprobs were asked for
    # False when the sampled row's logits held a NaN or an infinity: ``token_id`` is then
    # meaningless and the scheduler fails the request.
    finite: bool = True
    # The loop the output exited at when earlier than this one (its coda ran on its state
    # from then: ``WorkItem.coda_state_at``); 0: this loop.
    exit_depth: int = 0


@dataclass(slots=True)
class CarriedEvents:
    """The events of carried tokens in one step, as columns: entry k is one token's event, in
    the runner's row order (a request's older token first). A token has an event when its
    output exited (with its token), when the delayed rule decided its exit for the next loop,
    or when it ended (the runner runs no further loop of it). The first loop of a carried
    token reports here too (its ``StepResult.items`` entry is None, or it has none: a
    continuation).
    Columns, not an object per event: a decode batch has an event per token every few steps.
    """

    keys: list[int]  # ``Carry.key``
    request_ids: list[str]
    depths: list[int]  # the loop it ran in this step
    ended: list[bool]
    exited: list[bool]  # its output exited at this loop: the next columns hold its token
    exit_next: list[bool]  # delayed mode: the next loop will be the exit
    token_ids: list[int]  # -1 where it did not exit
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]
    finite: list[bool]  # as ``ItemResult.finite``
    ranks: list[int | None] | None = None  # as ``ItemResult.rank``; None: no row asked

    def __len__(self) -> int:
        return len(self.keys)


@dataclass
class StepResult:
    step_id: int
    # Aligned with plan.items: None for items without an output position still to exit, and
    # for carried tokens' first loops (``carried`` has their events).
    items: list[ItemResult | None]
    # Events of carried tokens (their first loops included): exits, delayed decisions, ends.
    carried: CarriedEvents | None = None
    num_rows: int = 0  # rows run through the core loop
    num_coda_rows: int = 0
    # prompt_logprobs: by index in ``items``, an item with ``prompt_targets``' (logprob, top
    # logprobs, rank) per target, in order.
    prompt_logprobs: dict[int, list[tuple[float, list[tuple[int, float]], int]]] | None = None
    error: str | None = None  # set when the step failed; the scheduler fails its requests
    # With ``error``: requests outside ``items`` the failure lost too (preempted by the step,
    # their KV never reached swap space).
    lost: list[str] = field(default_factory=list)
