"""Prefill/decode disaggregation on one host (DESIGN §8): two stages behind one stage client.

``PDClient`` has a stage client's interface and runs two stages: a *prefill* stage computes each
prompt (as a one-token request) and, as that request finishes, writes the KV of the prompt's
full blocks to a file in shared memory (``kv_transfer``); the *decode* stage then adds the
request with that file, caches the prompt's blocks from it and computes only the rest of the
prompt (at least its last token) before decoding. Prompts with no full block before their last
token, requests that score their prompt (``prompt_logprobs``: every position runs anyway) and
unseeded Huginn requests with a random initial state (their KV depends on a seed the decode
stage draws) go to the decode stage directly.

Output equals one stage's: the transfer only replaces computation the decode stage would do
otherwise, and ``kv_transfer`` matches blocks by hashes that name everything their KV depends
on. Weight updates, sleep and wake-up run on both stages, one at a time; after an update that
applied on the decode stage only (the prefill stage failed to load it) the stages hold
different weights, so transfers stop. The samples of one prompt (a group) make one transfer:
the first goes through the prefill stage, the others wait here and follow it to the decode
stage, where they share its prompt. The files waiting for the decode stage hold at most
``kv_transfer_gb`` (``transfer_files``): a prompt past it goes to the decode stage directly. A
dead prefill stage fails no request: its prefills move on without a file, new requests go to
the decode stage directly, and it is started again in the background (``pd_prefill``); a dead
decode stage is the client's death (``alive``).

A request's updates reach its sink from the decode stage (also when its prefill failed: the
decode stage then computes the prompt itself), or one final update from here when it ended
before it got there. Invariants: request ids are unique across both stages (``_ids`` holds
every open one); a request is in ``_open`` exactly while its prefill runs, and ``_lock`` covers
the hand-over, so an ``abort`` reaches whichever stage holds the request.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from rltserve.config import EngineConfig
from rltserve.core.engine_info import EngineInfo, EngineStats
from rltserve.core.pd_prefill import PrefillStage, prefill_params, stage_configs
from rltserve.core.request_checks import check_params
from rltserve.core.stage import Sink, StageClient, StageError
from rltserve.core.transfer_files import TransferFiles, transfer_size
from rltserve.core.update_log import UpdateLog, stamps
from rltserve.prompt_truncation import truncated_prompt
from rltserve.sampling import SamplingParams
from rltserve.updates import SLEEP_TAGS, FinishReason, RequestUpdate

logger = logging.getLogger(__name__)

_CLOSED = "stage closed before the request finished"


def stage_client(config: EngineConfig, client_cls: Callable = StageClient):
    """The stage client ``config`` asks for: ``client_cls(config)``, or a ``PDClient`` over two
    of them with ``disaggregate``."""
    if config.execution.disaggregate:
        return PDClient(config, client_cls)
    return client_cls(config)


@dataclass
class _Handoff:
    """A request while its prompt runs on the prefill stage."""

    prompt: list[int]
    params: SamplingParams
    sink: Sink  # the user's, wrapped by ``_ending``
    group: str | None
    path: str
    stage: object = None  # the prefill stage client it runs on
    aborted: bool = False
    # A weight update that does not abort running requests aborted its prefill, or its stage
    # died: the decode stage computes the prompt instead.
    reroute: bool = False
    # The group's other samples, waiting to follow it to the decode stage: (request id,
    # prompt, params, sink).
    followers: list[tuple] = field(default_factory=list)


class PDClient:
    """A prefill stage and a decode stage (each ``client_cls(config)``) as one stage client."""

    def __init__(self, config: EngineConfig, client_cls: Callable = StageClient) -> None:
        prefill_config, decode_config = stage_configs(config)
        self._decode_config = decode_config
        self._prefill = PrefillStage(lambda: client_cls(prefill_config, role="prefill"))
        try:
            self.decode = client_cls(decode_config, role="decode")
        except BaseException:
            self.prefill.close(timeout=2.0)
            raise
        self._files = TransferFiles(config.execution.kv_transfer_gb)  # (bounded: its doc)
        # Guards _ids, _open, _leaders, _following, _moving, _closed and the hand-over.
        self._lock = threading.Lock()
        self._ids: set[str] = set()  # every open request, wherever it is
        self._open: dict[str, _Handoff] = {}  # those on the prefill stage
        self._leaders: dict[str, _Handoff] = {}  # group key -> its sample on the prefill stage
        self._following: dict[str, _Handoff] = {}  # a waiting follower -> its leader
        # Requests on their way to the decode stage (added outside the lock) -> aborted since.
        self._moving: dict[str, bool] = {}
        self._closed = False
        # Weight updates, sleep and wake-up run one at a time, on both stages; transfers
        # need the last update to have succeeded on both (``update_weights``).
        self._commands = threading.Lock()
        self._in_sync = True
        # The updates applied on the decode stage, for a restarted prefill stage to apply.
        self._updates = UpdateLog()
        self.info: EngineInfo | None = None
        self._stats_of: tuple = (None, None)
        self._stats: EngineStats | None = None

    # ---------------------------------------------------------------- lifecycle

    def wait_ready(self, timeout: float | None = None) -> EngineInfo:
        prefill = self.prefill.wait_ready(timeout)
        decode = self.decode.wait_ready(timeout)
        length = min(prefill.max_model_len, decode.max_model_len)
        self.info = replace(decode, max_model_len=length)
        if not self._closed:
            self._prefill.watch(self)  # (once both serve: a failed start is the caller's)
        return self.info

    @property
    def prefill(self):
        """The current prefill stage client (a dead one until its restart serves)."""
        return self._prefill.client

    @property
    def prefill_down(self) -> str | None:
        """Why no prefill stage serves now (the decode stage computes every prompt meanwhile);
        None while one does."""
        return self._prefill.down

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def alive(self) -> bool:
        """The decode stage's: without a prefill stage the decode stage serves alone."""
        return self.decode.alive and not self._closed

    @property
    def error(self) -> str | None:
        if self.decode.error is not None:
            return f"decode stage: {self.decode.error}"
        return "closed" if self._closed else None

    def close(self, timeout: float = 10.0) -> None:
        """Closes both stages; a request still in its prefill ends as aborted."""
        with self._lock:
            self._closed = True
        self._prefill.close(timeout)
        self.decode.close(timeout)
        self._files.close()

    def kill(self) -> None:
        """Kills both stages' workers (clients without workers have nothing to kill)."""
        for stage in (self.prefill, self.decode):
            kill = getattr(stage, "kill", None)
            if kill is not None:
                kill()

    def kill_prefill(self) -> None:
        """Kills the prefill stage's worker (a hung one: the server's watchdog); its prefills,
        and a command waiting for it, move on to the decode stage, and it is started again
        (``pd_prefill``)."""
        self._prefill.kill()

    def _prefill_died(self, stage) -> None:
        """For ``PrefillStage``, once ``stage`` died: its prefills move on to the decode stage
        whatever final update they get (closing it aborts those its death did not end)."""
        with self._lock:
            for handoff in self._open.values():
                handoff.reroute = handoff.reroute or handoff.stage is stage

    # ---------------------------------------------------------------- requests

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        sink: Sink,
        group: str | None = None,
    ) -> None:
        """``StageClient.add_request``: through the prefill stage when the prompt has KV to
        move, else to the decode stage directly."""
        with self._lock:
            if not self.alive:
                raise StageError(f"stage is not running: {self.error}")
            if request_id in self._ids:
                raise ValueError(f"request_id={request_id!r}: already in use")
            self._ids.add(request_id)
        prompt = list(prompt_token_ids)
        if self.info is not None:  # (the prompt the decode stage's engine runs)
            with contextlib.suppress(ValueError):  # (which refuses it then, in its own words)
                prompt = truncated_prompt(
                    prompt, params.truncate_prompt_tokens, self.info.max_model_len
                )
        handoff = None
        try:
            # (``_in_sync`` is read under the lock: an update marks the open prefills.)
            transfers = self._transfers(prompt, params)
            with self._lock:
                transfers = transfers and self._in_sync
                leader = self._leaders.get(group) if transfers and group is not None else None
                if leader is not None and leader.prompt == prompt:
                    ending = self._ending(request_id, sink)
                    leader.followers.append((request_id, prompt, params, ending))
                    self._following[request_id] = leader
                    return
                path = None
                if transfers:  # (None past the files' bound: the decode stage computes it)
                    path = self._files.claim(*transfer_size(self.info, prompt, params))
                if path is not None:
                    ending = self._ending(request_id, sink, path)
                    handoff = _Handoff(prompt, params, ending, group, path, self.prefill)
                    self._open[request_id] = handoff
                    if group is not None:
                        self._leaders[group] = handoff
            if handoff is None:
                ending = self._ending(request_id, sink)
                self.decode.add_request(request_id, prompt, params, ending, group)
                return
            ref = weakref.ref(self)

            def on_prefill(update: RequestUpdate) -> None:  # (holds the client weakly)
                client = ref()
                if client is not None and update.finish_reason is not None:
                    client._prefilled(request_id, update)

            transfer = ("export", handoff.path)
            one_token = prefill_params(params, self.info)
            try:
                handoff.stage.add_request(
                    request_id, prompt, one_token, on_prefill, group, transfer
                )
            except StageError:  # it died since _transfers: as a prefill that failed
                if handoff.stage.alive:
                    raise
                failed = RequestUpdate(request_id, finish_reason=FinishReason.ERROR)
                self._prefilled(request_id, failed)
        except BaseException:
            with self._lock:
                self._ids.discard(request_id)
                moves = []
                if handoff is not None and self._open.pop(request_id, None) is handoff:
                    self._files.release(handoff.path)
                    for follower in self._detach(handoff):  # (a leader that never was)
                        self._moving[follower[0]] = False
                        moves.append((follower, None))
            self._move(moves, group)
            raise

    def _transfers(self, prompt: list[int], params: SamplingParams) -> bool:
        """Whether the request goes through the prefill stage (see the module doc): not one
        the decode stage will refuse (its prefill would be wasted)."""
        info = self.info
        if info is None or len(prompt) - 1 < info.block_size:
            return False
        prefill = self.prefill
        if self._prefill.down is not None or not prefill.alive or prefill.sleeping:
            return False
        if prefill.weight_version != self.decode.weight_version:
            return False
        if params.prompt_logprobs is not None:
            return False
        try:  # (EngineInfo has the model facts the checks read)
            check_params(
                prompt, params, info, self._decode_config, info.max_model_len, info.pool_limited
            )
        except ValueError:
            return False  # the decode stage refuses it at once, in its own words
        return not (
            info.family == "huginn_raven" and params.init_state != "zero" and params.seed is None
        )

    def _ending(self, request_id: str, sink: Sink, path: str | None = None) -> Sink:
        """``sink``, which on the request's first update frees its transfer file (the decode
        stage read it by then, or the request ended without it) and on its final update
        forgets the request."""

        def ending(update: RequestUpdate) -> None:
            nonlocal path
            if path is not None:
                self._files.release(path)
                path = None
            if update.finish_reason is not None:
                with self._lock:
                    self._ids.discard(request_id)
            sink(update)

        return ending

    def _prefilled(self, request_id: str, update: RequestUpdate) -> None:
        """The prefill stage's final update: the request moves to the decode stage with its
        file (without one when the prefill failed, or a weight update that does not abort
        running requests aborted it: the decode stage then computes the prompt, and refuses
        the request itself if it is bad), or ends here when it was aborted (by the user, by
        closing, by a weight update that aborts running requests). Its group's waiting
        samples follow it (after it: there it leads the group; also after an aborting
        update ended it, as requests waiting on one stage survive one)."""
        finals: list[tuple[Sink, RequestUpdate]] = []
        moves: list[tuple[tuple, tuple | None]] = []
        with self._lock:
            handoff = self._open.pop(request_id, None)
            if handoff is None:
                return
            followers = self._detach(handoff)
            if handoff.aborted or self._closed:
                final = RequestUpdate(request_id, finish_reason=FinishReason.ABORT)
                if self._closed and not handoff.aborted:
                    final.error = _CLOSED
                finals.append((handoff.sink, final))
            elif update.finish_reason is FinishReason.ABORT and not handoff.reroute:
                finals.append((handoff.sink, update))  # (an update that aborts)
            else:
                done = update.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
                entry = (request_id, handoff.prompt, handoff.params, handoff.sink)
                # (the file's real size is held until the decode stage reads it; a prefill
                # that failed may have left part of one)
                (self._files.settle if done else self._files.release)(handoff.path)
                moves.append((entry, ("import", handoff.path) if done else None))
            for follower in followers:
                if self._closed:
                    final = RequestUpdate(follower[0], finish_reason=FinishReason.ABORT)
                    final.error = _CLOSED
                    finals.append((follower[3], final))
                else:
                    moves.append((follower, None))
            for entry, _ in moves:
                self._moving[entry[0]] = False
        for sink, final in finals:
            sink(final)
        self._move(moves, handoff.group)

    def _detach(self, handoff: _Handoff) -> list[tuple]:
        """Under the lock, for a handoff leaving ``_open``: it stops leading its group, and its
        followers stop waiting (returned, for the caller to move or end)."""
        if handoff.group is not None and self._leaders.get(handoff.group) is handoff:
            del self._leaders[handoff.group]
        for follower in handoff.followers:
            del self._following[follower[0]]
        return handoff.followers

    def _move(self, moves: list[tuple[tuple, tuple | None]], group: str | None) -> None:
        """Adds each (request id, prompt, params, sink) to the decode stage with its transfer,
        in order, outside the lock (a send pickles its message, a compiled index's too, which
        the decode stage's updates need not wait for); an abort that came meanwhile
        (``_moving``) follows the add, and a failed add ends the request with the error."""
        for (request_id, prompt, params, sink), transfer in moves:
            final = None
            try:
                self.decode.add_request(request_id, prompt, params, sink, group, transfer)
            except Exception as exc:  # (a dead decode stage, params it cannot send)
                error = f"decode stage: {type(exc).__name__}: {exc}"
                final = RequestUpdate(request_id, finish_reason=FinishReason.ERROR, error=error)
            with self._lock:
                aborted = self._moving.pop(request_id, False)
            if final is not None:
                sink(final)
            elif aborted:
                self.decode.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._moving:  # (its mover aborts it once it is added)
                self._moving[request_id] = True
                return
            leader = self._following.pop(request_id, None)
            if leader is not None:  # a sample waiting for its group's prefill
                follower = next(f for f in leader.followers if f[0] == request_id)
                leader.followers.remove(follower)
            else:
                handoff = self._open.get(request_id)
                if handoff is not None:
                    handoff.aborted = True
        if leader is not None:
            follower[3](RequestUpdate(request_id, finish_reason=FinishReason.ABORT))
            return
        (handoff.stage if handoff is not None else self.decode).abort(request_id)

    # ---------------------------------------------------------------- both stages

    def update_weights(self, paths: list[str], abort: bool, timeout_s: float) -> int:
        """The decode stage first, as one stage would run it: where long requests make a
        timeout likely (nothing is then applied anywhere), and where requests added
        meanwhile go and wait for the update (no KV moves until it is done). Then the
        prefill stage, which never waits: it aborts its prefills, and those the update does
        not abort move on to the decode stage, whose prompts it computes under the new
        weights. Applied once the decode stage has it: should the prefill stage fail to
        load what the decode stage loaded, it keeps its weights and no KV moves from it
        again (logged). A prefill stage that is down gets it when it is started again."""
        with self._commands:
            in_sync, self._in_sync = self._in_sync, False
            try:
                before: tuple | str = stamps(paths)
            except (OSError, ValueError) as exc:  # (the stage will say so, if it fails too)
                before = str(exc)
            try:
                version = self.decode.update_weights(paths, abort, timeout_s)
            except BaseException:
                self._in_sync = in_sync  # (nothing changed on either stage)
                raise
            self._updates.add(list(paths), version, before)
            with self._lock:
                for handoff in self._open.values():
                    handoff.reroute = not abort
            try:
                self._prefill.command("update_weights", paths, True, timeout_s)
            except Exception as exc:
                logger.warning(
                    "weight update applied on the decode stage only; the prefill stage failed "
                    "(%s: %s): prompts are computed on the decode stage from now on",
                    type(exc).__name__,
                    exc,
                )
                return self.decode.weight_version
            self._in_sync = True  # (the versions tell whether the stages are in step)
            return self.decode.weight_version

    def sleep(self, level: int, timeout_s: float) -> None:
        """The prefill stage first (its requests move on to the decode stage, whose sleep
        then waits for them), then the decode stage; if that fails the prefill stage is woken
        again (after level 2 with weights to load: no KV moves until an update)."""
        with self._commands:
            self._prefill.command("sleep", level, timeout_s)
            try:
                self.decode.sleep(level, timeout_s)
            except BaseException:
                if level == 2:
                    self._in_sync = False
                with contextlib.suppress(Exception):
                    self._prefill.command("wake_up", list(SLEEP_TAGS))
                raise

    def wake_up(self, tags: list[str]) -> None:
        with self._commands:
            self.decode.wake_up(tags)
            self._prefill.command("wake_up", tags)

    def reset_prefix_cache(self) -> None:
        with self._commands:
            self.decode.reset_prefix_cache()
            self._prefill.command("reset_prefix_cache")

    @property
    def weight_version(self) -> int:
        return self.decode.weight_version

    @property
    def sleeping(self) -> set[str]:
        return self._prefill.sleeping | self.decode.sleeping  # (a dead stage's would stick)

    @property
    def prefill_stats(self) -> EngineStats | None:
        """The prefill stage's own stats (its KV pool and cache; ``stats`` is the decode's),
        its counters carried over its restarts."""
        return self._prefill.stats

    def stalled_stage(self) -> str:
        """The stage ``stats`` waits for (the server's watchdog names it): the prefill stage
        while it has prefills and sent no stats since they last moved, else the decode's."""
        return "prefill" if self._open and self.prefill.stats is self._stats_of[0] else "decode"

    def control_stage(self) -> str:
        """The stage a command (update, sleep, wake-up, cache reset) waits for (the server's
        watchdog names it): the prefill stage while it runs one, else the decode's."""
        return "prefill" if self._prefill.commanding else "decode"

    @property
    def stats(self) -> EngineStats | None:
        """The decode stage's stats, its waiting requests counting those in their prefill.
        A new object (what the server's watchdog reads as progress) only once every stage
        with work has sent new stats: a stage that hangs while the other progresses is
        noticed."""
        prefill, decode = self.prefill.stats, self.decode.stats
        moved_p, moved_d = prefill is not self._stats_of[0], decode is not self._stats_of[1]
        busy_p = bool(self._open)
        # (also the requests handed to it: the last stats of a stage that hung idle show none)
        busy_d = len(self._ids) > len(self._open) + len(self._following) or (
            decode is not None and bool(decode.num_running or decode.num_waiting)
        )
        if (moved_p or moved_d) and (moved_p or not busy_p) and (moved_d or not busy_d):
            self._stats_of = (prefill, decode)
            self._stats = decode
            if decode is not None:
                waiting = decode.num_waiting + len(self._following)
                if prefill is not None:
                    waiting += prefill.num_running + prefill.num_waiting
                skipped = self._files.skipped_tokens
                self._stats = replace(decode, num_waiting=waiting, kv_transfer_skipped=skipped)
        return self._stats
