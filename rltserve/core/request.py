"""Request: every piece of per-request state, owned by the scheduler.

Positions: the prompt occupies ``0..P-1``. Output token k is sampled at position ``P-1+k`` (the
first from the last prompt position) and, unless generation stops, is fed back as the input of
position ``P+k``. At most one work item of a request is in flight at a time; its depth progress
lives in ``InFlight``.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from rltserve.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token, or (front end) a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"
    ERROR = "error"


@dataclass
class InFlight:
    """The work item a request has in flight: tokens [start, start + num_tokens) at ``depth``."""

    start: int
    num_tokens: int
    depth: int  # the loop the next step runs (1-based)
    ends_at: int  # the item's last loop unless it stops at its output's exit
    stop_at_exit: bool
    has_output: bool  # the item's last row still owes an output token
    survival: float = 1.0
    cdf: float = 0.0
    exit_pending: bool = False  # delayed exit: the previous loop's gate asked to exit


@dataclass
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
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    num_prefilled: int = 0  # prompt tokens whose loops are complete
    num_decoded: int = 0  # output tokens whose own loops (as inputs) are complete
    in_flight: InFlight | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    admitted: bool = False  # its KV is reserved and the runner knows it
    first_token_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def prefill_done(self) -> bool:
        return self.num_prefilled == self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def kv_tokens(self) -> int:
        """Positions whose KV the request may ever write: the last output token needs none."""
        want = self.num_prompt_tokens + self.params.max_tokens - 1
        return min(want, self.max_total_tokens - 1)

    def token_at(self, position: int) -> int:
        p = self.num_prompt_tokens
        return (
            self.prompt_token_ids[position] if position < p else self.output_token_ids[position - p]
        )
