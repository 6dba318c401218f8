"""Per-request execution state the runner keeps between steps.

The scheduler owns request progress; the runner owns what the device computed that the next step
needs, so the next step can be planned, and launched, before this one's result is read: the
in-flight items' hidden states and exit-gate states (several items of one request may be in
flight at different depths: wavefront prefill, token pipelining), the last sampled token (the
next decode token's input), drafts, the sampling generator and, for penalties, the output
history.

Device-resident values (tensors) feed the next step directly. Their host copies (``pending``,
``Draft.value``, ``history``) are filled when a step's result is delivered, which always
happens before the next decision that reads them (the runner's invariant).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from rltserve.core.guide import Guide
from rltserve.core.plan import RequestSetup
from rltserve.core.sampler import SampleRow, SeededGenerator
from rltserve.sampling import SamplingParams


@dataclass(slots=True, eq=False)  # compared by identity (``PendingRows``)
class ItemState:
    """The in-flight work item of a request, as the device sees it. Its state and gate fields
    may lag the runner's ``PendingRows``, which then holds their current values (a gate
    not computed leaves the gate fields as they are: see ``gate_src``)."""

    start: int
    # The item's state after the last loop run is rows [row, row + n) of ``src``, that step's
    # whole output [N, S] (one tensor shared by the step's items, so the next step gathers
    # every item's rows with one index_select); ``e_src`` the same rows' input injection
    # (models that re-inject it).
    src: torch.Tensor | None = None
    e_src: torch.Tensor | None = None
    row: int = 0
    # The output position's gate state (survival S, CDF) in fp32: column ``gate_row`` of
    # ``gate_src`` [2, M], the last loop's gate of every output row of that step; None before
    # the position's first loop. A carried token's stops moving once no crossing can move its
    # exit (``step_exits.decide_exits``): later loops only compare it with an inf threshold.
    gate_src: torch.Tensor | None = None
    gate_row: int = 0
    pending: bool = False  # delayed exit: the next loop is the exit (host copy)
    exited: bool = False  # the output position has produced its token
    # The last row's state kept for its coda (``WorkItem.coda_state_at``): [1, S].
    coda_state: torch.Tensor | None = None
    # A zero-shot exit criterion's statistic of the output position's distribution after the
    # last loop that computed one (``step_criteria``): (tensor, row, loop, criterion).
    criterion_prev: tuple | None = None


@dataclass(slots=True)
class PendingRows:
    """The states a step left to its items without writing each ItemState: item ``k``'s
    state is rows ``offsets[k]..`` of ``state`` (and ``e``); output item ``out[k]``'s gate is
    column ``k`` of ``gate`` (None: no gate was computed; the gate fields stay as they are,
    current, or, for carried rows past any exit a crossing could move, never read again).

    A decode step's next step usually runs the same items in the same order (``held``,
    compared by identity): it takes these tensors as they are and neither that step nor
    this one touches an ItemState per row. Any other step ``settle()``s first. Invariant:
    at most one is pending (the runner's), and it is settled before any ItemState's state
    or gate field is read.
    """

    held: list[ItemState]
    offsets: Sequence[int]
    state: torch.Tensor
    e: torch.Tensor | None
    out: Sequence[int] = ()
    gate: torch.Tensor | None = None

    def settle(self) -> None:
        """Writes the states (and gates) into the items' fields."""
        state, e, held = self.state, self.e, self.held
        for h, row in zip(held, self.offsets):
            h.src, h.e_src, h.row = state, e, row
        if self.gate is not None:
            gate = self.gate
            for k, i in enumerate(self.out):
                h = held[i]
                h.gate_src, h.gate_row = gate, k


@dataclass
class Draft:
    """Token pipelining: the drafted input of one position: row ``row`` of ``tokens`` (the
    drafting step's [K] int64 drafts on the device)."""

    tokens: torch.Tensor
    row: int
    value: int | None = None  # host copy, once the drafting step's result is delivered


@dataclass
class LiveRequest:
    setup: RequestSetup
    generator: SeededGenerator | None
    # In-flight items by start: the plan's (a carried token's is in ``CarriedRows.held``).
    items: dict[int, ItemState] = field(default_factory=dict)
    # The last sampled token, on the device: row ``last_row`` of ``last_tokens`` (the sampling
    # step's [R] int64 tokens), so a step gathers its decode inputs with one index_select.
    last_tokens: torch.Tensor | None = None
    last_row: int = 0
    # Output tokens (host), kept only for penalties: sampled ones as committed, forced ones
    # (bounded thinking) as they enter as inputs (``record_inputs``).
    history: list[int] | None = None
    drafts: dict[int, Draft] = field(default_factory=dict)  # by the position it feeds
    epoch: int = 0  # rollbacks so far; plan items of an older epoch are stale
    sample_row: SampleRow | None = None  # what the sampler needs of this request
    guide: Guide | None = None  # structured outputs: where the output is in its constraint
    commits: bool = False  # sampled tokens are recorded on the host (history, guide, drafts)

    @classmethod
    def create(
        cls,
        setup: RequestSetup,
        device: torch.device,
        vocab_size: int,
        kept: SeededGenerator | None = None,
    ) -> LiveRequest:
        """A resumed request (``setup.num_sampled > 0``) gets its generator at the state after
        the tokens it sampled before preemption: ``kept`` (the generator it had) when that has
        not drawn past them, else one replayed from the seed (``SeededGenerator.resume``), and
        its guide (structured outputs) advanced over them (over its outputs but the forced
        thinking ids: ``Guide.replay``)."""
        generator = None
        if not setup.params.greedy:
            generator = SeededGenerator.resume(
                setup.seed, device, setup.num_sampled, vocab_size, kept
            )
        history = None
        if setup.prompt_token_ids is not None:
            history = list(setup.output_token_ids or [])
        guide = None
        if setup.params.structured_outputs is not None:
            outputs = setup.output_token_ids or []
            guide = Guide.of(setup.params.structured_outputs, setup.params)
            guide.replay(outputs, num_forced=len(outputs) - setup.num_sampled)
        live = cls(setup, generator, history=history, epoch=setup.epoch, guide=guide)
        live.commits = history is not None or guide is not None
        # One per request: its fields never change (the history list grows in place).
        live.sample_row = SampleRow(
            params=setup.params,
            generator=generator,
            penalty_tokens=live.penalty_tokens(),
            bias=_bias(setup.params, vocab_size, device),
            guide=guide,
        )
        if setup.banned_ids:
            ids = [i for i in setup.banned_ids if i < vocab_size]  # (others cannot come)
            live.sample_row.banned = torch.tensor(ids, dtype=torch.int64, device=device)
            live.sample_row.banned_below = setup.banned_below
        return live

    def input_token(self, position: int) -> tuple[torch.Tensor, int]:
        """The prelude input of the decode token at ``position``: (device tensor, row)."""
        draft = self.drafts.get(position) if self.drafts else None
        if draft is not None:
            return draft.tokens, draft.row
        if self.last_tokens is None:
            raise RuntimeError(f"{self.setup.request_id}: decode input requested before any token")
        return self.last_tokens, self.last_row

    def commit(self, next_position: int, token: int) -> bool:
        """Records the host value of a sampled token, the input of ``next_position``. Returns
        True when a draft of that input was used and differs: everything from
        ``next_position`` on must go."""
        draft = self.drafts.pop(next_position, None)
        if self.history is not None:
            self.history.append(token)
        if self.guide is not None:
            self.guide.advance(token)
        if draft is None:
            return False
        if draft.value is None:
            raise RuntimeError(f"{self.setup.request_id}: draft at {next_position} never read")
        return draft.value != token

    def record_inputs(self, start: int, token_ids: list[int]) -> None:
        """Extends the penalty history with the outputs among an item's recorded inputs
        (positions ``start`` on) that it lacks: bounded thinking's forced ids, which reach the
        runner only as inputs (never sampled, never committed). A replay after preemption
        adds nothing: its setup's history holds every recorded output already."""
        history = self.history
        if history is None:
            return
        k = len(self.setup.prompt_token_ids or ()) + len(history) - start  # (the next output's)
        if 0 <= k < len(token_ids):
            history.extend(token_ids[k:])

    def rollback(self, position: int) -> None:
        """Drops the in-flight items and drafts at ``position`` and beyond."""
        for start in [s for s in self.items if s >= position]:
            del self.items[start]
        for key in [k for k in self.drafts if k >= position]:
            del self.drafts[key]
        self.epoch += 1

    def penalty_tokens(self) -> tuple[list[int], list[int]] | None:
        if self.history is None:
            return None
        return self.setup.prompt_token_ids, self.history


def _bias(params: SamplingParams, vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """[V] fp32 added to the request's logits before it samples (``SampleRow.bias``): its
    ``logit_bias``, and -inf on every id ``allowed_token_ids`` leaves out; None without them."""
    if not params.logit_bias and params.allowed_token_ids is None:
        return None
    bias = torch.zeros(vocab_size)
    if params.allowed_token_ids is not None:
        bias.fill_(float("-inf"))
        bias[list(params.allowed_token_ids)] = 0.0
    if params.logit_bias:
        ids = list(params.logit_bias)
        bias[ids] += torch.tensor([float(params.logit_bias[i]) for i in ids])
    return bias.to(device)
