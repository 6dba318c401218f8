"""Request logs (``serve --enable-log-requests``, ``--enable-log-outputs``), in vLLM's words.

Each generating request is named by its response id (``cmpl-<X-Request-Id>`` where the client
sent one), which is what vLLM's lines name too:

- ``Received request ID: params: SamplingParams(...), prompt_tokens: N.`` once planned (N is a
  list for a request of several prompts); its prompts' text and token ids follow at DEBUG
  (``Request ID details: prompt: ..., prompt_token_ids: [...]``), as vLLM keeps them there;
- ``Generated response ID: output: ..., output_token_ids: [...], finish_reason: ...`` per
  choice with ``--enable-log-outputs`` (`` (streaming complete)`` after the ID for a stream);
- ``Finished request ID.``; ``Failed request ID: <error>`` (a warning) for one its stage or
  replica failed; or ``Aborted request ID.`` for one cut short (its client left, its stream
  stalled, the server shut down).

``max_len`` (``--max-log-len``) bounds the characters and token ids a line shows.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rltserve.http.frontend import PromptInput
    from rltserve.outputs import Completion
    from rltserve.sampling import SamplingParams

log = logging.getLogger("rltserve.http.requests")
MAX_NAMED = 8  # request ids one line names at most (``id_list``)


@dataclass(frozen=True)
class RequestLog:
    """What the server logs of each generating request."""

    enabled: bool = False  # ``enable_log_requests``
    outputs: bool = False  # ``enable_log_outputs`` (only with ``enabled``)
    max_len: int | None = None  # ``max_log_len``: None shows all

    def received(
        self, request_id: str, params: SamplingParams, prompts: Sequence[PromptInput]
    ) -> None:
        if not self.enabled:
            return
        lengths = [len(p.token_ids) for p in prompts]
        shown = lengths[0] if len(lengths) == 1 else lengths
        log.info("Received request %s: params: %s, prompt_tokens: %s.", request_id, params, shown)
        if not log.isEnabledFor(logging.DEBUG):
            return  # (decoding and cutting prompts costs: only when shown)
        for i, prompt in enumerate(prompts):
            name = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            log.debug(
                "Request %s details: prompt: %r, prompt_token_ids: %s.",
                name,
                self._cut(prompt.text),
                self._cut(prompt.token_ids),
            )

    def finished(self, request_id: str, outputs: Sequence[Completion], stream: bool) -> None:
        if not self.enabled:
            return
        if self.outputs:
            streamed = " (streaming complete)" if stream else ""
            for output in outputs:
                log.info(
                    "Generated response %s%s: output: %r, output_token_ids: %s, finish_reason: %s",
                    request_id,
                    streamed,
                    self._cut(output.text),
                    self._cut(output.token_ids),
                    output.finish_reason,
                )
        failed = next((o.error or "failed" for o in outputs if o.finish_reason == "error"), None)
        if failed is not None:  # (a failed stage or replica: not a finished request)
            log.warning("Failed request %s: %s", request_id, failed)
        else:
            log.info("Finished request %s.", request_id)

    def aborted(self, request_id: str) -> None:
        if self.enabled:
            log.info("Aborted request %s.", request_id)

    def _cut(self, value: str | list[int] | None) -> str | list[int] | None:
        if value is None or self.max_len is None:
            return value
        return value[: self.max_len]


def id_list(ids: Sequence[str], most: int = MAX_NAMED) -> str:
    """Request ids for one log line: ``a, b, c``; beyond ``most`` of them, ``... and N more``
    (a drain or a stage failure may end thousands)."""
    shown = ", ".join(ids[:most])
    return shown if len(ids) <= most else f"{shown} and {len(ids) - most} more"
