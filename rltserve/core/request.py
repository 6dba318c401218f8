"""Request: every piece of per-request state, owned by the scheduler.

Positions: the prompt occupies ``0..P-1``. Output token k is sampled at position ``P-1+k`` (the
first from the last prompt position) and, unless generation stops, is fed back as the input of
position ``P+k``. Work items of a request are planned loop by loop (``InFlight``); several can be
in flight at once at different depths under wavefront prefill.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from rltserve.kv_policy import KVPolicy
from rltserve.sampling import SamplingParams
from rltserve.updates import FinishReason, RequestUpdate


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Resume(enum.Enum):
    """How a preempted request gets its KV back when it is admitted again."""

    NONE = "none"  # never preempted, or fully rebuilt since
    RECOMPUTE = "recompute"  # every position is recomputed
    SWAP = "swap"  # positions [0, swapped_tokens) come back from host swap space


# Requests and their items are entities, compared by identity: value equality would make
# ``request in scheduler.running`` (or ``items.remove(item)``) compare every field of every
# element before the one sought.
@dataclass(slots=True, eq=False)
class InFlight:
    """A work item of a request: tokens [start, start + num_tokens), looping toward ``ends_at``.

    Planning runs ahead of results (async scheduling keeps two steps in flight), so the item
    records how far it was planned and how far its results have been applied. The item is over
    for planning once its last loop is planned: ``ends_at``, or the output's exit when
    ``stop_at_exit``.
    """

    start: int
    num_tokens: int
    ends_at: int
    stop_at_exit: bool
    has_output: bool  # the last row produces output token number ``output_index``
    output_index: int = 0
    planned: int = 0  # loops planned so far
    applied: int = 0  # loops whose results were applied
    exit_depth: int | None = None  # the loop at which the output exited (from a result)
    delayed_exit_at: int | None = None  # delayed mode: the loop a result said will be the exit
    draft_at: int = 0  # token pipelining: the loop whose state drafts the next position's input
    epoch: int = 0  # the request's rollback count when the item was created
    life: int = 0  # the request's preemption count when the item was created
    # Recompute of a generated token after preemption: at its last loop (its recorded exit) its
    # K/V is copied into the deeper planes, as its original exit did (last_exited).
    copy_at_end: bool = False
    # last_exited: the blocks holding ``start`` on the planes of depths 1..num_loops, once an
    # exit spec needed them (a loop at depth d copies into those of depths d+1..).
    exit_blocks: list[int] | None = None
    # A carried decode token (``plan.Carry``): its key while the runner runs its loops; 0 when
    # every loop is planned.
    carry_key: int = 0
    carry_step: int = 0  # the step that runs its first loop (it runs one loop a step)
    exit_by: int = 0  # loops after which its exit is known without a result (cap, fixed exit)
    # A carried token whose exit is not known: the first step whose planning may have
    # something to do for it, the one after the step running loop ``exit_by`` (or, moved
    # earlier by ``exits_after``, the delayed decision's exit loop); 0 once a result gave its
    # exit, and for every other item. (Planning skips a request while its newest item's wake
    # is after the step being planned.)
    wake: int = 0
    # Coda attention (Huginn): the last row's coda input is its state after this loop, earlier
    # than the item's last loop, where its coda runs (``Request.first_coda_at``, a generated
    # token recomputed under ``full``); 0: its state after the last loop.
    coda_state_at: int = 0
    # A recompute of generated tokens started in the same step as the item before it, with
    # which it loops in lockstep (``Wavefront.start_runs``).
    lockstep: bool = False

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    def exits_after(self, depth: int) -> None:
        """A delayed decision at loop ``depth``: the output exits at the next loop."""
        self.delayed_exit_at = depth + 1
        if self.carry_key and self.carry_step + depth + 1 < self.wake:
            self.wake = self.carry_step + depth + 1  # (the step after that loop's)


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    num_loops: int  # D_r: loops of prompt tokens (and of every token under `full`)
    max_loops: int  # exit cap for output tokens (<= num_loops)
    eos_token_ids: frozenset[int]
    max_total_tokens: int  # prompt + output tokens allowed by the context limit
    seed: int
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    exit_depths: list[int] = field(default_factory=list)
    exit_mode: str = "fixed"  # how output positions exit: fixed | gate | delayed (ExitSpec)
    # gate/delayed on a model without a gate: the zero-shot criterion (``step_criteria``) that
    # decides instead; its first output, the prompt's, runs the cap (``exit.exit_spec``).
    criterion: str | None = None
    # Its KV policy where it is not the engine's (``SamplingParams.kv_policy``).
    kv_policy: KVPolicy | None = None
    pipelined: bool = False  # decode tokens enter loop 1 on a draft of their input
    epoch: int = 0  # rollbacks so far: a rejected draft discards every later in-flight item
    num_scheduled: int = 0  # positions already covered by work items
    items: list[InFlight] = field(default_factory=list)  # items still planning, by position
    finish_reason: FinishReason | None = None
    error: str | None = None
    admitted: bool = False  # it holds KV and the runner knows it
    first_token_time: float | None = None
    # When admission first scheduled it (the scheduler's clock, ``arrival_time``'s): what it
    # waited for a seat or KV before, vLLM's queued interval, goes out as ``queued_s``.
    first_scheduled_time: float | None = None
    seq: int = 0  # arrival order (set by the scheduler): ties in priority go to the earlier
    # Preemption (DESIGN §8). Positions below ``replay_until`` are recomputed on resume without
    # sampling: prompt chunks at full depth, generated tokens each to its recorded exit depth.
    # The generated tokens fed back as inputs up to and including ``replay_until`` come from
    # ``output_token_ids`` (the runner's device copy of the last token was dropped).
    num_preemptions: int = 0
    replay_until: int = 0
    resume: Resume = Resume.NONE
    lockstep: bool = (
        False  # some of its items are replay runs in lockstep (``Wavefront.start_runs``)
    )
    swapped_tokens: int = 0  # swap mode: positions whose KV waits in host swap space
    # Positions a request that preempted itself (``Preemptor.make_room``) was growing to:
    # its re-admission waits for room for them, not just its first item (else it is admitted
    # again at once, recomputes up to where it stopped and preempts itself again).
    resume_need: int = 0
    # The first positions of the prompt chunks committed, in order: under shared/ring a swap
    # keeps whole chunks (``Preemptor._final_positions``).
    chunk_starts: list[int] = field(default_factory=list)
    # Time slicing (``Preemptor.rotate``): the step that last admitted it, its outputs then
    # and the positions that admission recomputes, and the step that last preempted it.
    admitted_step: int = 0
    admitted_outputs: int = 0
    admitted_replay: int = 0
    preempted_step: int = 0
    # Bounded thinking (core/thinking.py): output tokens the engine forced rather than sampled,
    # and whether the thinking span is over (ended by the model or forced).
    num_forced: int = 0
    thinking_closed: bool = False
    # A budget of 0 (``thinking.force_at_start``): the forced ids open the output before it
    # runs; True until the update that delivers them (``Applier``), which a preemption or
    # recompute never repeats.
    forced_unsent: bool = False
    # With logprobs: the forced tokens' (logprob, top, rank) by output index, None until the
    # replay item holding the position before one has run loop ``max_loops`` (``Applier``).
    forced_scores: dict[int, tuple | None] | None = None
    # Prompt sharing (``prompt_sharing.py``). ``cache_salt`` names everything but the tokens
    # that prompt KV depends on (None: this request's blocks are never shared); the hashes
    # name its full prompt blocks. ``group``: requests sampling one prompt (the first leads).
    cache_salt: bytes | None = None
    block_hashes: list[bytes] | None = None
    group: str | None = None
    # Prompt tokens whose KV was reused rather than computed (set at its first admission).
    num_cached_tokens: int | None = None
    # PD decode stage (``kv_transfer``), set when the prompt's KV was imported: the prompt
    # tokens the prefill stage reused. Admission's hit then covers blocks the prefill stage
    # computed, which count as computed (``PromptSharing._first_hit``).
    prefill_cached_tokens: int | None = None
    # PD decode stage: the file of prompt KV the prefill stage wrote, read when the request is
    # first admitted (blocks added earlier would be evicted while it waits); then the prompt
    # tokens that file held, for ``PrefixCache.transfer_unused``.
    transfer: str | None = None
    transfer_tokens: int = 0
    # ``prompt_logprobs``: entry q is (logprob, top) of prompt token q + 1 as predicted at
    # position q, None until the item holding q ends (``Applier``); None without them.
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None
    # While some are None (``scoring``), what it outputs is withheld (its first output may
    # exit before the prompt's last loop): its tokens gather in ``withheld`` and what would end
    # it waits in ``finish_pending``, its outputs capped where they are; all go out with the
    # prompt logprobs, so they come first.
    scoring: bool = False
    withheld: RequestUpdate | None = None
    finish_pending: FinishReason | None = None
    prompt_final: int = 0  # prompt positions [0, prompt_final) have their final KV
    final_pending: dict[int, int] = field(default_factory=dict)  # applied items past that
    blocks_cached: int = 0  # leading prompt blocks cached (by it or before it)
    # Coda attention (Huginn, DESIGN §4): the first output exits at this loop, before the
    # prompt's last: its coda input is the last prompt position's state after this loop, but it
    # runs (and samples) with the prompt's last loop, when every other prompt position's
    # full-depth coda K/V is there to read. 0: the first output exits at the last loop.
    first_coda_at: int = 0
    # The request's two ExitSpecs (exit_now False, True), built once: every output position
    # of the request shares them (``exit.exit_spec``).
    exit_specs: tuple | None = None
    num_prompt_tokens: int = field(init=False, default=0)  # len(prompt_token_ids)
    # What ends it, read once per sampled token (``Applier``): the ids that stop it
    # once ``min_tokens`` are out (EOS unless ignored, and ``stop_token_ids``), and the most
    # output tokens ``max_tokens`` and the context limit allow.
    stop_ids: frozenset[int] = field(init=False, default=frozenset())
    # What it may not sample before ``min_tokens`` outputs exist (sorted; empty without
    # min_tokens): the same ids, from the params (the KV benchmark stops its requests on ids
    # it does not ban, by setting ``stop_ids`` itself).
    banned_ids: tuple[int, ...] = field(init=False, default=())
    max_outputs: int = field(init=False, default=0)
    # ``ItemMaker.carried_item``'s last copy-on-exit blocks, shared (never changed) by its
    # tokens in one block: (depth tables, block index, the blocks, the blocks past depth 1).
    carry_blocks: tuple | None = None
    # Its last carried token (``ItemMaker.carried_item`` or ``Scheduler._continues``): (its
    # ``InFlight``, depth tables, fixed exit, boundary table, preemption count), which the next
    # may continue. The item's ``start`` and ``carry_key`` are the token's position and key (a
    # standing token moves them on in place: ``standing.py``).
    carry_prev: tuple | None = None

    def __post_init__(self) -> None:
        # A plain field, not a property: planning reads it several times per token. The
        # prompt never changes once the request exists.
        self.num_prompt_tokens = len(self.prompt_token_ids)
        params = self.params
        eos = () if params.ignore_eos else self.eos_token_ids
        self.stop_ids = frozenset(eos).union(params.stop_token_ids)
        self.banned_ids = tuple(sorted(self.stop_ids)) if params.min_tokens else ()
        # What the context leaves; a prompt that fills it (scored: ``request_checks``) still
        # gets the one token its last position predicts, which takes no place in the context.
        room = max(1, self.max_total_tokens - self.num_prompt_tokens)
        self.max_outputs = room if params.max_tokens is None else min(params.max_tokens, room)
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * (self.num_prompt_tokens - 1)
            self.scoring = self.num_prompt_tokens > 1

    @property
    def reuses_prompt(self) -> bool:
        """Whether it may take prompt KV others computed (prefix cache, a group's leader):
        not when it scores its prompt (``prompt_logprobs``), which needs every position run.
        (What it computes may still be cached for others.)"""
        return self.prompt_logprobs is None

    def prompt_targets(self, start: int, end: int) -> list[int] | None:
        """The prompt tokens that positions [start, end) predict, when the request still
        lacks one of their logprobs (positions past the prompt's last predict none)."""
        slots = self.prompt_logprobs
        stop = min(end, self.num_prompt_tokens - 1)
        if slots is None or start >= stop or None not in slots[start:stop]:
            return None
        return self.prompt_token_ids[start + 1 : stop + 1]

    @property
    def queued_s(self) -> float | None:
        """Seconds from its arrival to its first scheduling (None before it): a duration, so
        front ends in other processes can use it (``RequestUpdate.queued_s``)."""
        if self.first_scheduled_time is None:
            return None
        return max(0.0, self.first_scheduled_time - self.arrival_time)

    @property
    def prefill_scheduled(self) -> bool:
        return self.num_scheduled >= self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def kv_tokens(self) -> int:
        """Positions whose KV the request may ever write: the last output token needs none."""
        return self.num_prompt_tokens + self.max_outputs - 1  # (below max_total_tokens)

    @property
    def sort_key(self) -> tuple[int, int]:
        """Lower runs first: priority (lower value first), then arrival."""
        return (self.params.priority, self.seq)

    def token_at(self, position: int) -> int:
        p = self.num_prompt_tokens
        return (
            self.prompt_token_ids[position] if position < p else self.output_token_ids[position - p]
        )

    @property
    def forced_pending(self) -> bool:
        """Whether a forced token still lacks its logprob (its end then waits for it)."""
        return self.forced_scores is not None and None in self.forced_scores.values()

    def forced_targets(self, start: int, end: int) -> tuple[int, list[int]] | None:
        """(row, ids): the output tokens that positions [start, end) predict, from the item's
        row ``row`` on (the first at or after the prompt's last position, which predicts the
        first output) up to the last forced one among them still lacking its logprob; None
        when none does."""
        slots = self.forced_scores
        if not slots:
            return None
        p = self.num_prompt_tokens
        row = max(0, p - 1 - start)
        first = start + row - p + 1  # (the output index row ``row`` predicts)
        rows = range(first, end - p + 1)
        last = max((j for j in rows if slots.get(j, 0) is None), default=-1)
        return (row, self.output_token_ids[first : last + 1]) if last >= 0 else None
