"""What an RL trainer drives on the offline ``LLM`` between rollouts (``TrainerControls``, a base
of ``LLM``): weight updates, sleep mode, pausing generation and the prefix cache, and the path
vLLM-era scripts take to load weights, ``llm.llm_engine.model_executor.driver_worker.
model_runner.model.load_weights(pairs)`` (TRL's colocate mode and the scripts copied from it),
and the few other reads of ``llm.llm_engine`` they make (``LLMEngine``).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rltserve.caller_values import plain_number
from rltserve.core.stage import StageError
from rltserve.updates import SLEEP_TAGS
from rltserve.weights import WeightsArg, update_paths

# vLLM's objects from the engine down to the model; the model runs in rltserve's stage, so the
# path leads only to ``load_weights``. (vLLM V1 wraps the worker: ``driver_worker.worker``.)
_MODEL_PATH = ("model_executor", "driver_worker", "model_runner", "model")
_LOAD_PATH = "llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights"
_NO_WORKERS = (
    "rltserve runs the model in its own stage, with no workers to call; load weights with "
    f"llm.update_weights(pairs) or {_LOAD_PATH}(pairs)"
)


class TrainerControls:
    """The trainer-facing methods of ``LLM``; they use its stage client and generate's gate."""

    _client: Any
    _running: threading.Condition  # guards _paused
    _paused: bool
    _closed = False  # set by close()
    _model_name: str  # the model as given (a repo id stays one), vLLM's model_config.model
    _download_dir: Any  # where repo ids given to update_weights are found too

    def update_weights(
        self, weights: WeightsArg, *, abort: bool = False, timeout: float = 300.0
    ) -> int:
        """Replaces the model's weights in place and returns the new ``weight_version``.

        ``weights``: a checkpoint directory (or ``.safetensors`` file), a Hugging Face repo id
        in the local cache (as the model's, ``download_dir`` included), or an iterable of
        ``(name, tensor)`` pairs in checkpoint names, such as a trainer's
        ``state_dict().items()`` (or a mapping of names to tensors: the state_dict itself); a
        subset updates only those tensors, and no pairs at all (an empty last bucket of a
        streamed update) change nothing: the version stays. Strict:
        an unknown name, a wrong shape, a non-float tensor or a name given twice rejects the
        whole update (``ValueError`` listing them) and the old weights keep serving (vLLM's
        ``load_weights``, the path below, takes a repeated name's last tensor instead). The
        update runs once no request is running: requests submitted meanwhile wait for it,
        running ones finish first (``UpdateTimeout``, a ValueError, if they still run after
        ``timeout`` seconds; nothing is applied) or are aborted at once with ``abort=True``.
        Later outputs report the new ``weight_version``."""
        return self._update_weights(weights, abort, timeout, last_wins=False)

    def _update_weights(
        self, weights: WeightsArg, abort: bool, timeout: float, last_wins: bool
    ) -> int:
        """``update_weights``; ``last_wins``: a name given twice takes its last tensor."""
        if not isinstance(abort, bool):
            raise ValueError(f"abort={abort!r}: must be a bool")
        timeout = seconds("timeout", timeout)
        with update_paths(weights, self._download_dir, last_wins) as paths, self._stage():
            if not paths:  # (no pairs: the stage would refuse an update of nothing)
                if self._closed:  # (what an update of something raises then)
                    raise StageError("this LLM is closed (close() was called)")
                return self._client.weight_version
            return self._client.update_weights(paths, abort, timeout)

    @property
    def weight_version(self) -> int:
        """Weight updates applied so far (0: the checkpoint as loaded)."""
        return self._client.weight_version

    def sleep(self, level: int = 1, timeout: float = 300.0) -> None:
        """vLLM's sleep mode, for a trainer that shares the device between rollouts: frees the
        KV cache (forgetting cached prefixes) and, on CUDA, the weights: ``level=1`` keeps a
        host copy to restore, ``level=2`` drops them (wake the weights, ``update_weights``,
        then wake the KV cache). Waits up to ``timeout`` seconds for running requests (else
        ``UpdateTimeout``, nothing freed). ``generate`` raises ValueError until ``wake_up``."""
        if level not in (1, 2):
            raise ValueError(f"level={level!r}: must be 1 or 2")
        timeout = seconds("timeout", timeout)
        with self._stage():
            self._client.sleep(level, timeout)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Restores what ``sleep`` freed: ``tags`` ("weights", "kv_cache"; None: both)."""
        if tags is None:
            tags = SLEEP_TAGS
        if isinstance(tags, str) or not set(tags) <= set(SLEEP_TAGS):
            raise ValueError(f"tags={tags!r}: must be a list of {SLEEP_TAGS}")
        with self._stage():
            self._client.wake_up(list(tags))

    def is_sleeping(self) -> bool:
        return bool(self._client.sleeping)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forgets every cached prefix (vLLM's; a weight update already does). Blocks running
        requests hold stay theirs, so it always succeeds: True."""
        del reset_running_requests
        with self._stage():
            self._client.reset_prefix_cache()
        return True

    def pause_generation(self) -> None:
        """New ``generate`` calls wait (they start on ``resume_generation``); calls already
        running continue. For a trainer that updates weights between rollout steps."""
        with self._running:
            self._paused = True

    def resume_generation(self) -> None:
        with self._running:
            self._paused = False
            self._running.notify_all()

    def collective_rpc(self, *args: Any, **kwargs: Any) -> list:
        """vLLM's call of a method on every worker: a ValueError (there are none to call)."""
        raise ValueError(f"collective_rpc: not supported: {_NO_WORKERS}")

    def apply_model(self, *args: Any, **kwargs: Any) -> list:
        """vLLM's call of a function on the model in each worker: a ValueError (as above)."""
        raise ValueError(f"apply_model: not supported: {_NO_WORKERS}")

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's engine, as far as RL scripts and evaluation harnesses reach into it
        (``LLMEngine``)."""
        return LLMEngine(self)

    @contextlib.contextmanager
    def _stage(self) -> Iterator[None]:
        """Around calls on the stage client: once ``close()`` has run, the StageError they
        raise says so in the user's terms (the client's says its stage is "closed")."""
        try:
            yield
        except StageError as exc:
            if self._closed:
                raise StageError("this LLM is closed (close() was called)") from exc
            raise


@dataclass(frozen=True)
class VllmModelConfig:
    """``llm.llm_engine.model_config``: the fields of vLLM's ``ModelConfig`` rltserve knows
    (lm-eval reads ``max_model_len``). ``model`` is the checkpoint as given (a directory, or
    a Hugging Face repo id),
    ``max_model_len`` the engine's context limit, ``dtype`` a ``torch.dtype`` (as vLLM's);
    ``llm.info`` and ``llm.config`` hold the rest."""

    model: str
    max_model_len: int
    dtype: Any
    seed: int
    max_logprobs: int
    vocab_size: int

    def get_vocab_size(self) -> int:
        return self.vocab_size

    def __getattr__(self, name: str) -> Any:  # (only names that are not fields)
        raise AttributeError(
            f"llm.llm_engine.model_config.{name}: not here; it has model, max_model_len, dtype, "
            "seed, max_logprobs, vocab_size (llm.info and llm.config hold the rest)"
        )


class EnginePath:
    """One hop of ``llm.llm_engine.model_executor.driver_worker.model_runner.model``; the last
    has ``load_weights``. Any other attribute is an AttributeError saying what there is."""

    def __init__(self, llm: Any, hops: tuple[str, ...]) -> None:
        self._llm = llm
        self._hops = hops

    def __getattr__(self, name: str) -> EnginePath:
        hops = self._hops
        step = len([h for h in hops if h != "worker"])
        wrapped = name == "worker" and hops[-1:] == ("driver_worker",)
        if not name.startswith("__") and (wrapped or _MODEL_PATH[step : step + 1] == (name,)):
            return (_ModelHop if name == "model" else EnginePath)(self._llm, (*hops, name))
        path = ".".join(("llm.llm_engine", *hops, name))
        if name == "load_weights":
            raise AttributeError(f"{path}: the model's, {_LOAD_PATH}")
        raise AttributeError(
            f"{path}: rltserve runs the model in its own stage; llm.llm_engine has only "
            "model_config, get_model_config(), get_tokenizer(), tokenizer, reset_prefix_cache(), "
            f"is_sleeping() and {_LOAD_PATH} (on the LLM: llm.get_tokenizer(), "
            "llm.reset_prefix_cache(), llm.is_sleeping(), llm.info, llm.update_weights)"
        )


class LLMEngine(EnginePath):
    """``llm.llm_engine``: vLLM's engine as far as scripts read it (OpenRLHF resets the prefix
    cache through it, lm-eval reads ``model_config.max_model_len``), each name the LLM's own;
    and the first hop of the path to ``load_weights``."""

    def __init__(self, llm: Any) -> None:
        super().__init__(llm, ())

    @property
    def model_config(self) -> VllmModelConfig:
        llm = self._llm
        import torch  # (the stage has imported it already)

        return VllmModelConfig(
            model=llm._model_name,
            max_model_len=llm.info.max_model_len,
            dtype=getattr(torch, llm.config.model.dtype),
            seed=llm.config.model.seed,
            max_logprobs=llm.config.model.max_logprobs,
            vocab_size=llm.info.vocab_size,
        )

    def get_model_config(self) -> VllmModelConfig:
        return self.model_config

    @property
    def tokenizer(self) -> Any:
        """``llm.get_tokenizer()`` (vLLM V1's engine holds the tokenizer itself)."""
        return self._llm.get_tokenizer()

    def get_tokenizer(self) -> Any:
        return self._llm.get_tokenizer()

    def reset_prefix_cache(self, device: object = None) -> bool:
        del device  # (vLLM's: one KV pool here)
        return self._llm.reset_prefix_cache()

    def is_sleeping(self) -> bool:
        return self._llm.is_sleeping()

    def __delattr__(self, name: str) -> None:
        # (vLLM's memory clean-up, ``del llm.llm_engine.model_executor``: its workers and their
        # device memory go; here the stage does, as ``llm.close()``)
        if name != "model_executor":
            raise AttributeError(f"llm.llm_engine.{name}: cannot be deleted")
        self._llm.close()


class _ModelHop(EnginePath):
    """``...model_runner.model``: the model, as far as ``load_weights``."""

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """vLLM's: loads ``(name, tensor)`` pairs in checkpoint names (all of a trainer's
        ``state_dict().items()`` or a few) and returns the names loaded; here one
        ``update_weights`` (a bad name or shape is a ValueError and nothing changes). As vLLM
        copies pairs in order, a name given twice (a re-sent bucket) ends with its last tensor,
        and an empty iterable loads nothing; a dict is taken as its items."""
        pairs = list(weights.items() if isinstance(weights, Mapping) else weights)
        self._llm._update_weights(pairs, False, 300.0, last_wins=True)  # (update_weights' defaults)
        return {pair[0] for pair in pairs}


def seconds(name: str, value: object) -> float:
    """A timeout argument as float seconds; ValueError naming it unless finite and >= 0 (NaN
    compares false with everything: a plain ``< 0`` check let it through as "never")."""
    value = plain_number(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(f"{name}={value!r}: must be a finite number of seconds >= 0")
    return float(value)
