"""What the engine reports per request: ``RequestUpdate`` (the tokens, exit depths and logprobs
one step or an abort added, and how the request ended) and ``FinishReason``.

At the bottom of the package, beside ``outputs`` which consumes updates: the scheduler makes
them, the stage carries them across processes, the LLM API and the server assemble them.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import compress, repeat


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token, or (front end) a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"
    ERROR = "error"


class UpdateTimeout(ValueError):
    """A weight update (or ``sleep``) gave up waiting for running requests (nothing was
    applied)."""

    PREFIX = "timeout:"  # how the stage's reply marks it


# What sleep mode frees and ``wake_up`` restores (``core/sleep.py``).
SLEEP_TAGS = ("weights", "kv_cache")
# How the error of a request refused while the engine sleeps begins (the server: a 503).
ASLEEP = "the engine is asleep"
# How the error of a request refused after ``sleep(level=2)`` woke without a weight load begins
# (the server: a 503). On CUDA the woken weights are uninitialised memory: generating from them
# would answer garbage without an error.
WEIGHTS_DROPPED = "the weights were dropped by sleep(level=2)"
# The error of a request a weight update with ``abort=True`` aborted (the server: a 503).
UPDATE_ABORTED = "aborted by a weight update (abort=True); retry to run on the new weights"


@dataclass(slots=True)
class RequestUpdate:
    """What one step (or an abort) changed for a request, for the engine to emit. (Slots: one
    is made per request per step.)"""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_exit_depths: list[int] = field(default_factory=list)
    new_logprobs: list[float | None] = field(default_factory=list)
    new_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    rejected: bool = False  # the request never started: its arguments were invalid
    weight_version: int = 0  # the engine's weights when the update was made
    # On the update with the first output token: prompt tokens whose KV was reused (prefix
    # cache, or the prompt a group's leader computed) instead of computed ...
    num_cached_tokens: int | None = None
    # ... and, with ``prompt_logprobs``, (logprob, top logprobs, rank) of each prompt token after
    # the first.
    prompt_logprobs: list[tuple[float, list[tuple[int, float]], int]] | None = None
    # The new tokens' ranks (``SampleOutput.ranks``), parallel to ``new_token_ids`` once any
    # token has one (a request that asked for logprobs); empty before, None per forced token.
    new_ranks: list[int | None] = field(default_factory=list)
    # On the update with the first output token: seconds the request waited in the engine,
    # from reaching it to its first scheduling (vLLM's queued interval). A duration, not a
    # timestamp: the engine may run in another process or on another host, whose clock the
    # front end cannot compare with its own.
    queued_s: float | None = None
    # Bounded thinking (``core/thinking.py``), with logprobs: (output index, logprob, top
    # logprobs, rank) of forced tokens output by earlier updates (or this one), scored since.
    forced_logprobs: list[tuple[int, float, list[tuple[int, float]], int]] | None = None

    def add_rank(self, rank: int | None) -> None:
        """Records the rank of the token just appended to ``new_token_ids``."""
        if rank is not None or self.new_ranks:
            self.new_ranks += [None] * (len(self.new_token_ids) - 1 - len(self.new_ranks))
            self.new_ranks.append(rank)

    def __reduce__(self) -> tuple:
        # As positional fields (in field order, as ``to_wire`` gives an update of several
        # tokens) an update pickles in half the time and bytes of the default (a dict of field
        # names per object), and unpickles in half the time. (Spelled out: going through
        # ``to_wire`` costs 40% more.) Both ends run the same rltserve.
        return (
            RequestUpdate,
            (
                self.request_id,
                self.new_token_ids,
                self.new_exit_depths,
                self.new_logprobs,
                self.new_top_logprobs,
                self.finish_reason,
                self.error,
                self.rejected,
                self.weight_version,
                self.num_cached_tokens,
                self.prompt_logprobs,
                self.new_ranks,
                self.queued_s,
                self.forced_logprobs,
            ),
        )


@dataclass(slots=True)
class StepUpdates:
    """A step's updates: ``updates`` (by request id), and requests that got one output token
    and nothing else (not their first, not their last) as columns. Most of a decode step's
    updates are of that kind, and a ``RequestUpdate`` with its four one-element lists costs
    about a microsecond to make (a fifth of applying a decode batch's tokens) and more to
    send: the columns cross to the front end as one wire row (``to_wire``) and become
    ``RequestUpdate``s only there, or where read here (iterating yields every update, the
    columns' first). No request is in both: ``update_of`` moves one out of the columns."""

    updates: dict[str, RequestUpdate] = field(default_factory=dict)
    request_ids: list[str | None] = field(default_factory=list)  # (None: a row taken out)
    token_ids: list[int] = field(default_factory=list)
    exit_depths: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)
    rows: dict[str, int] = field(default_factory=dict)  # request id -> its row
    weight_version: int = 0  # the engine's weights when the step was applied (every update's)
    # Prompt tokens of the requests the step gave their first token (vLLM's iteration tokens
    # count them then, with the step's output tokens: ``num_tokens``); engine-side only.
    num_prompt_tokens: int = 0

    def update_of(self, request_id: str) -> RequestUpdate | None:
        """The request's update in ``updates`` (for a second token or its end in the same
        step), its one-token update moved there out of the columns (its row left empty) if
        it has a row; None when it has neither."""
        update = self.updates.get(request_id)
        if update is not None:
            return update
        k = self.rows.pop(request_id, None)
        if k is None:
            return None
        self.request_ids[k] = None
        token, depth, logprob = self.token_ids[k], self.exit_depths[k], self.logprobs[k]
        update = _one_token(
            request_id, token, depth, logprob, self.top_logprobs[k], self.ranks[k], 0
        )
        self.updates[request_id] = update
        return update

    def columns(self) -> tuple[list, list, list, list, list, list]:
        """The columns without empty rows."""
        columns = (self.request_ids, self.token_ids, self.exit_depths, self.logprobs)
        columns += (self.top_logprobs, self.ranks)
        if len(self.rows) == len(self.request_ids):
            return columns
        kept = [rid is not None for rid in self.request_ids]
        return tuple(list(compress(column, kept)) for column in columns)

    def __len__(self) -> int:
        return len(self.rows) + len(self.updates)

    def num_tokens(self) -> int:
        """vLLM's iteration tokens of the step: its output tokens (a column row holds one)
        plus ``num_prompt_tokens``."""
        outputs = sum(len(update.new_token_ids) for update in self.updates.values())
        return len(self.rows) + outputs + self.num_prompt_tokens

    def __iter__(self) -> Iterator[RequestUpdate]:
        version = self.weight_version
        for row in zip(*self.columns()):
            yield _one_token(*row, version)
        yield from self.updates.values()


def to_wire(updates: Iterable[RequestUpdate] | StepUpdates) -> list[tuple]:
    """The updates as tuples of plain values: how a step's updates cross to the front end's
    process (``from_wire``). Plain tuples pickle in less than half the time of the objects
    (no Python call per object: 223 vs 502 us for 256 one-token updates). An update of one
    token and nothing else (a decode step's, nearly every update) goes as (request id,
    token, exit depth, logprob, top logprobs, rank, weight version), without its one-element
    lists: 256 of them pickle in half the time of the full rows and unpickle in a quarter
    (138 against 264 us, 105 against 454 us here). Any other update goes as its fields in
    field order. (The token lists are parallel: one entry per token.) A ``StepUpdates``'
    columns go first, as one row of that seven-value form holding six lists (request ids,
    tokens, exit depths, logprobs, top logprobs, ranks) and the version."""
    rows = []
    if isinstance(updates, StepUpdates):
        if updates.rows:
            rows.append((*updates.columns(), updates.weight_version))
        updates = updates.updates.values()
    return rows + [
        (
            u.request_id,
            u.new_token_ids[0],
            u.new_exit_depths[0],
            u.new_logprobs[0],
            u.new_top_logprobs[0],
            u.new_ranks[0] if u.new_ranks else None,
            u.weight_version,
        )
        if len(u.new_token_ids) == 1
        and u.finish_reason is None
        and u.error is None
        and u.num_cached_tokens is None
        and u.prompt_logprobs is None
        and u.queued_s is None
        and u.forced_logprobs is None
        and not u.rejected
        else (
            u.request_id,
            u.new_token_ids,
            u.new_exit_depths,
            u.new_logprobs,
            u.new_top_logprobs,
            u.finish_reason,
            u.error,
            u.rejected,
            u.weight_version,
            u.num_cached_tokens,
            u.prompt_logprobs,
            u.new_ranks,
            u.queued_s,
            u.forced_logprobs,
        )
        for u in updates
    ]


def from_wire(rows: Iterable[tuple]) -> list[RequestUpdate]:
    """The updates ``to_wire`` gave."""
    updates = []
    for row in rows:
        if len(row) != 7:
            updates.append(RequestUpdate(*row))
        elif type(row[0]) is list:  # (a ``StepUpdates``' columns)
            updates += map(_one_token, *row[:6], repeat(row[6]))
        else:
            updates.append(_one_token(*row))
    return updates


def _one_token(
    request_id: str,
    token: int,
    depth: int,
    logprob: float | None,
    top: list | None,
    rank: int | None,
    version: int,
) -> RequestUpdate:
    # (Positional, in field order: finish_reason, error and rejected at their defaults.)
    ranks = [] if rank is None else [rank]
    return RequestUpdate(
        request_id,
        [token],
        [depth],
        [logprob],
        [top],
        None,
        None,
        False,
        version,
        None,
        None,
        ranks,
    )
