"""Per-request generation settings: token sampling plus the looped-model loop controls."""

from __future__ import annotations

import enum
import logging
import math
from dataclasses import dataclass, field, fields

from rltserve.caller_values import (
    check_int,
    check_number,
    is_number,
    is_token_id,
    nonempty,
    plain_fields,
    plain_number,
)
from rltserve.kv_policy import is_policy_name
from rltserve.prompt_truncation import truncation_error
from rltserve.structured import StructuredOutputsParams, resolve
from rltserve.thinking_budget import add_budget_alias

logger = logging.getLogger(__name__)

INIT_STATES = ("random", "zero")
# Zero-shot exit criteria of models without an exit gate (Huginn, Nanbeige; MODELS.md §2.5), with
# the threshold each takes when ``exit_threshold`` is not given (Hugging Face's "auto" values).
# ``argmax-stability``'s threshold counts loops; ``none`` never exits early (a fixed depth).
EXIT_CRITERIA = {
    "kl": 5e-4,
    "minp-kl": 1e-6,
    "entropy-diff": 1e-3,
    "latent-diff": 0.03,
    "argmax-stability": 5,
    "none": 1.0,
}
# KV policies a request may pick for itself on an engine running either (the per-depth ones: the
# same planes); besides, any engine takes a request naming its own policy (``check_kv_policy``).
REQUEST_KV_POLICIES = ("full", "last_exited")
MAX_LOGPROBS = 20  # OpenAI's top_logprobs bound; vLLM's default max_logprobs
# vLLM's temperature floor: logits divided by a smaller one overflow to inf (then NaN
# probabilities), so a positive temperature below it is raised to it, with a warning.
MIN_TEMPERATURE = 1e-2


class RequestOutputKind(enum.Enum):
    """vLLM's streaming mode of a request's outputs (its values). The offline ``LLM`` returns
    each request's final output whatever the kind (vLLM's sets ``FINAL_ONLY``); the HTTP API
    streams by its own ``stream`` field."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


# Keyword-only: vLLM's SamplingParams (a msgspec Struct) takes ``n`` first, so a positional
# argument from code written for vLLM would silently set another field here.
@dataclass(kw_only=True)
class SamplingParams:
    """How one request is decoded, from keyword arguments only (a positional one is a
    ``TypeError``). Validated on construction: a bad value raises ``ValueError``
    naming the field. Mutable, as vLLM's (RL code sets ``max_tokens`` on a clone): the front
    ends submit a validated copy (``clone``), so a change after submission touches no request
    in flight and a bad value set later is refused then.

    Loop controls: a token exits at the first depth ``t >= min_loops`` whose exit-gate CDF reaches
    ``exit_threshold``, and at ``max_loops`` at the latest (None = the model's loop count).
    ``exit_threshold >= 1.0`` means a fixed depth of ``max_loops``; not given (None), it is 1.0.
    Models without a gate (Huginn, Nanbeige) exit by a zero-shot criterion instead
    (``exit_criterion``, Huginn's names; "kl" when unset and ``exit_threshold < 1``): a token exits
    at the first depth ``t >= min_loops`` where the criterion's value after loop t is below
    ``exit_threshold`` (with a criterion named, any positive threshold, 1.0 included; not given,
    that criterion's default, ``EXIT_CRITERIA``), or, for
    ``argmax-stability``, where the argmax of the next-token logits has stayed the same for
    ``exit_threshold`` loops in a row (a whole number); ``none`` runs ``max_loops``; the first
    output token, the prompt's, always runs ``max_loops``. ``trace_depths`` (benchmarks and tests;
    only with an engine in ``exit_mode='trace'``) replays given exit depths, one per output token,
    each within ``[min_loops, max_loops]``.

    vLLM's names mean what they mean there: ``max_tokens`` (None: all the context the prompt
    leaves), ``n`` samples per prompt (sample j seeded with
    ``seed + j`` when ``seed`` is set; a ``seed`` of -1 means unset, a derived -1 does not:
    ``sample_seed``), ``stop`` and ``stop_token_ids`` (lists,
    empty when not given), ``logprobs=k`` returns the sampled token's logprob plus
    the top ``k``, ``skip_special_tokens``, ``include_stop_str_in_output`` and ``detokenize``
    (False: token ids only, no text work) shape the text.

    Bounded thinking (``max_thinking_tokens=K``): the thinking span is open from the start of
    the output (the prompt ends inside ``<think>``, as chat templates with thinking leave it)
    until ``thinking_end_token_ids`` appears in the output. When the K-th output token is
    generated and the span is still open, the engine appends ``thinking_interruption`` followed
    by ``thinking_end_token_ids`` to the output as forced tokens (they count toward
    ``max_tokens``) and decodes the answer in the same request (``core/thinking.py``); K = 0
    forces them before the first output token, so the model answers without thinking.
    ``thinking_end_token_ids`` defaults to the tokenizer's ``</think>``; the interruption may be
    text (the ``LLM`` front end tokenizes it) or token ids. ``thinking_token_budget`` (vLLM's
    name) is an alias of ``max_thinking_tokens``: given, read or set, it is that field.

    ``logit_bias`` ({token id: bias in [-100, 100]}, OpenAI's) is added to the logits and
    ``allowed_token_ids`` (vLLM's) restricts sampling to the ids listed. Both shape what is
    sampled, greedy or not, before penalties (vLLM's order: a repetition penalty scales the
    biased logit); default (raw) ``logprobs`` describe the model's distribution without any.

    ``temperature``: 0 is greedy; a positive one below ``MIN_TEMPERATURE`` is raised to it
    (vLLM's), as dividing by it would overflow the logits.

    ``prompt_logprobs=k`` (vLLM's) returns, for each prompt token after the first, its logprob
    and the top ``k`` as the model predicts it from the position before after ``max_loops``
    loops (the model's count when unset; never an adaptive exit); such a request computes its
    whole prompt (no prefix-cache hits, as in vLLM).
    """

    max_tokens: int | None = 16
    temperature: float = 1.0  # vLLM's default (0: greedy)
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # -1: None (vLLM's)
    stop: list[str] | None = None  # a string or None given: stored as a list (vLLM's)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    min_loops: int = 1
    max_loops: int | None = None
    # None (not given): 1.0, or the named criterion's default (``EXIT_CRITERIA``); a value
    # given is kept, 1.0 too (a sweep over thresholds must not jump at 1.0). A number once
    # constructed.
    exit_threshold: float | None = None
    exit_criterion: str | None = None
    # The request's KV policy where it differs from the engine's: "full" or "last_exited", on
    # an engine running either (they lay out planes alike); the engine's own (a no-op) on any;
    # None: the engine's.
    kv_policy: str | None = None
    priority: int = 0
    logprobs: int | None = None
    # Huginn's recurrent state's start: "random" (noise from the seed) or "zero"; None: the
    # model's ("random" on Huginn). Models without one (Ouro, Nanbeige) refuse a value.
    init_state: str | None = None
    # Token pipelining (self-speculative decode) when the engine has it on: None uses it where
    # the request allows (greedy, fixed full depth), True requires it, False opts out.
    speculative: bool | None = None
    trace_depths: tuple[int, ...] | None = field(default=None, repr=False)
    n: int = 1
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    # vLLM's; it shapes only slow tokenizers' text, and checkpoints load fast ones here.
    spaces_between_special_tokens: bool = True
    max_thinking_tokens: int | None = None
    thinking_end_token_ids: tuple[int, ...] | None = None
    thinking_interruption: str | tuple[int, ...] | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    # vLLM's left truncation: only the prompt's last k tokens are run (-1: as many as the
    # engine takes, ``max_model_len - 1``); ``prompt_truncation.truncated_prompt``.
    truncate_prompt_tokens: int | None = None
    # vLLM's ``cache_salt`` (a prompt dict's key there, and an HTTP field): prompts with
    # different salts never share prefix-cache blocks (tenants cannot probe each other's).
    cache_salt: str | None = None
    # vLLM's structured outputs (``structured.StructuredOutputsParams``): ``guided_decoding``,
    # its older name, is moved here. ``extra_args`` (for custom sampling code, which has no
    # hook here) is carried along unused.
    guided_decoding: StructuredOutputsParams | None = None
    structured_outputs: StructuredOutputsParams | None = None
    extra_args: dict | None = None
    # vLLM's, accepted where they ask for nothing more: ``best_of`` None or ``n`` (no best-of
    # selection or beam search), ``bad_words`` and ``logits_processors`` empty (no hook for
    # custom sampling code: ``logit_bias`` and ``allowed_token_ids`` shape what is sampled).
    best_of: int | None = None
    bad_words: list[str] | None = None
    logits_processors: list | None = None
    # vLLM's streaming mode (``RequestOutputKind``; its int value is taken too). Kept, and
    # without effect: the offline API returns final outputs, HTTP streams by ``stream``.
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # vLLM's logprobs layout: False only (outputs hold vLLM's list of dicts).
    flat_logprobs: bool = False
    # vLLM's hint that its engine may use the params without copying them: without effect (the
    # front ends always submit a copy, ``clone``).
    skip_clone: bool = False

    @classmethod
    def from_optional(cls, **kwargs: object) -> SamplingParams:
        """vLLM's: the params with None for ``n``, the penalties, ``temperature`` and ``top_p``
        meaning their defaults, and each ``logit_bias`` entry clamped to [-100, 100] (its
        keys may be strings of digits), as vLLM's OpenAI server builds them."""
        defaults = {f.name: f.default for f in fields(cls)}
        nullable = ("n", "presence_penalty", "frequency_penalty", "repetition_penalty")
        for name in (*nullable, "temperature", "top_p"):
            if name in kwargs and kwargs[name] is None:
                kwargs[name] = defaults[name]
        bias = kwargs.get("logit_bias")
        if bias is not None:
            try:
                bias = {int(k): min(100.0, max(-100.0, v)) for k, v in dict(bias).items()}
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias={bias!r}: must map token ids to biases") from None
            kwargs["logit_bias"] = bias
        return cls(**kwargs)

    def __post_init__(self) -> None:
        # vLLM's fields are stored as lists, as vLLM stores them (RL code appends to ``stop``),
        # rltserve's as tuples; copies either way (the caller's list may change). A bare string
        # is one stop string, None none; a ``logit_bias`` is a dict of plain numbers.
        plain_fields(self)  # (NumPy numbers as Python's: ``NUMBER_FIELDS``)
        if isinstance(self.seed, int) and self.seed == -1:  # vLLM's "no seed"
            self.seed = None
        if type(self.max_thinking_tokens) is int and self.max_thinking_tokens == -1:
            self.max_thinking_tokens = None  # vLLM's thinking_token_budget=-1: "unlimited"
        self.stop = [self.stop] if isinstance(self.stop, str) else self.stop
        for name in ("stop", "stop_token_ids"):
            self._to_list(name, [] if getattr(self, name) is None else getattr(self, name))
        if self.allowed_token_ids is not None:
            self._to_list("allowed_token_ids", self.allowed_token_ids)
        if self.trace_depths is not None:
            self._to_tuple("trace_depths")
        if self.thinking_end_token_ids is not None:
            self._to_tuple("thinking_end_token_ids")
        if self.logit_bias is not None:
            try:
                bias = {plain_number(k): plain_number(v) for k, v in dict(self.logit_bias).items()}
                self.logit_bias = bias
            except (TypeError, ValueError):
                raise ValueError(
                    f"logit_bias={self.logit_bias!r}: must map token ids to biases"
                ) from None
        if self.thinking_interruption is not None and not isinstance(
            self.thinking_interruption, str
        ):
            self._to_tuple("thinking_interruption")
        kinds = {k.value: k for k in RequestOutputKind}
        if type(self.output_kind) is int and self.output_kind in kinds:  # (another: refused)
            self.output_kind = kinds[self.output_kind]
        if is_number(self.temperature) and 0.0 < self.temperature < MIN_TEMPERATURE:
            logger.warning(
                "temperature %s is below %s, which would overflow the logits: raised to %s "
                "(as vLLM does; 0 is greedy)",
                self.temperature,
                MIN_TEMPERATURE,
                MIN_TEMPERATURE,
            )
            self.temperature = MIN_TEMPERATURE
        if self.exit_threshold is None:
            named = isinstance(self.exit_criterion, str)  # (another type: refused below)
            self.exit_threshold = EXIT_CRITERIA.get(self.exit_criterion, 1.0) if named else 1.0
            self._auto_threshold = True  # (``__setattr__``)
        self.structured_outputs = resolve(self.guided_decoding, self.structured_outputs)
        self.guided_decoding = None  # (one field holds it, as vLLM's moves it)
        self._validate()
        self._validate_vllm()

    def _to_tuple(self, name: str) -> None:
        self._to_list(name, getattr(self, name))
        setattr(self, name, tuple(getattr(self, name)))

    def _to_list(self, name: str, value: object) -> None:
        try:
            setattr(self, name, list(map(plain_number, value)))
        except TypeError:  # not iterable: a ValueError naming the field, like every bad value
            raise ValueError(f"{name}={value!r}: must be a list") from None

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name}={getattr(self, name)!r}: {why}")

        if self.max_tokens is not None:
            check_int(self, "max_tokens")
            if self.max_tokens < 1:
                raise bad("max_tokens", "must be >= 1 (or None: up to the context)")
        check_number(self, "temperature")
        # vLLM's range; the HTTP API keeps OpenAI's [0, 2] (``http/schemas.py``).
        if not 0.0 <= self.temperature < math.inf:
            raise bad("temperature", "must be a finite number >= 0")
        check_number(self, "top_p")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        check_int(self, "top_k")
        if self.top_k < -1:
            raise bad("top_k", "must be 0 or -1 (disabled) or >= 1")
        check_number(self, "min_p")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        check_number(self, "repetition_penalty")
        if self.repetition_penalty <= 0.0:
            raise bad("repetition_penalty", "must be > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            check_number(self, name)
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, "must be in [-2, 2]")
        if self.seed is not None:
            check_int(self, "seed")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise bad("stop", "must be non-empty strings")
        if not all(map(is_token_id, self.stop_token_ids)):
            raise bad("stop_token_ids", "must be non-negative ints")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "must be a bool")
        check_int(self, "min_tokens")
        if self.min_tokens < 0:
            raise bad("min_tokens", "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        check_int(self, "min_loops")
        if self.min_loops < 1:
            raise bad("min_loops", "must be >= 1")
        if self.max_loops is not None:
            check_int(self, "max_loops")
            if self.max_loops < 1:  # (below any min_loops: the bound itself is the fault)
                raise bad("max_loops", "must be >= 1")
            if self.max_loops < self.min_loops:
                raise bad("max_loops", f"must be >= min_loops ({self.min_loops})")
        check_number(self, "exit_threshold")
        if self.exit_threshold <= 0.0:
            raise bad("exit_threshold", "must be > 0")
        if self.exit_criterion is not None and not (
            isinstance(self.exit_criterion, str) and self.exit_criterion in EXIT_CRITERIA
        ):
            raise bad("exit_criterion", f"must be one of {sorted(EXIT_CRITERIA)} (or None)")
        if (
            self.exit_criterion == "argmax-stability"
            and not float(self.exit_threshold).is_integer()
        ):
            raise bad("exit_threshold", "argmax-stability counts loops: must be a whole number")
        if self.kv_policy is not None and not is_policy_name(self.kv_policy):
            raise bad(
                "kv_policy",
                f"must be one of {REQUEST_KV_POLICIES} or the engine's own policy (None: the "
                "engine's)",
            )
        check_int(self, "priority")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                check_int(self, name)
                if getattr(self, name) < -1:  # (the engine bounds it: ``max_logprobs``)
                    raise bad(name, "must be >= 0 (or -1: every token)")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise bad("extra_args", "must be a dict or None")
        if self.speculative is not None and not isinstance(self.speculative, bool):
            raise bad("speculative", "must be true, false or null")
        if self.init_state is not None and self.init_state not in INIT_STATES:
            raise bad("init_state", f"must be one of {INIT_STATES} (or None)")
        if self.trace_depths is not None:
            # A replayed depth obeys the same loop bounds as a gate's exit would.
            top = self.max_loops
            for d in self.trace_depths:
                if not isinstance(d, int) or isinstance(d, bool) or d < 1:
                    raise bad("trace_depths", "must be ints >= 1")
                if d < self.min_loops:
                    raise bad("trace_depths", f"depth {d} is below min_loops ({self.min_loops})")
                if top is not None and d > top:
                    raise bad("trace_depths", f"depth {d} is above max_loops ({top})")

    def _validate_vllm(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name}={getattr(self, name)!r}: {why}")

        check_int(self, "n")
        if self.n < 1:
            raise bad("n", "must be >= 1")
        if self.best_of is not None:
            check_int(self, "best_of")
            if self.best_of != self.n:
                raise bad("best_of", f"no best-of or beam search (must be None or n={self.n})")
        if nonempty(self.bad_words):
            raise bad("bad_words", "not supported (None or empty; logit_bias={id: -100} bans)")
        if nonempty(self.logits_processors):
            raise bad(
                "logits_processors",
                "not supported (None or empty; logit_bias and allowed_token_ids shape sampling)",
            )
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", "must be a RequestOutputKind (0, 1 or 2)")
        if self.flat_logprobs is not False:
            raise bad("flat_logprobs", "not supported (False: logprobs are lists of dicts)")
        # Sample j draws with seed + j (``sample_seed``). torch reads a seed modulo 2**64 (a
        # negative one draws what seed + 2**64 does), and the generators tell those 64 bits
        # apart (``rltserve.seeds``: the CPU's mt19937 alone reads only the low 32).
        if self.seed is not None and not -(2**63) <= self.seed <= 2**64 - self.n:
            raise bad(
                "seed", f"must be in [-2**63, 2**64 - n] (n={self.n}: sample j uses seed + j)"
            )
        for name in (
            "skip_special_tokens",
            "include_stop_str_in_output",
            "detokenize",
            "spaces_between_special_tokens",
            "skip_clone",
        ):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be a bool")
        if self.max_thinking_tokens is not None:
            check_int(self, "max_thinking_tokens")
            if self.max_thinking_tokens < 0:
                raise bad("max_thinking_tokens", "must be >= 0 (-1: no bound)")
        for name in ("thinking_end_token_ids", "thinking_interruption"):
            value = getattr(self, name)
            if value is None or isinstance(value, str):
                continue
            if not all(map(is_token_id, value)):
                raise bad(name, "must be non-negative token ids")
        if self.thinking_end_token_ids is not None and not self.thinking_end_token_ids:
            raise bad("thinking_end_token_ids", "must hold at least one token id")
        for token, bias in (self.logit_bias or {}).items():
            if not is_token_id(token):
                raise bad("logit_bias", f"key {token!r} is not a token id (an int >= 0)")
            if not isinstance(bias, (int, float)) or isinstance(bias, bool):
                raise bad("logit_bias", f"the bias of {token} must be a number")
            if not -100.0 <= bias <= 100.0:  # (NaN fails too)
                raise bad("logit_bias", f"the bias of {token} must be in [-100, 100]")
        if self.cache_salt is not None and not (
            isinstance(self.cache_salt, str) and self.cache_salt
        ):
            raise bad("cache_salt", "must be a non-empty string (or None)")
        if self.truncate_prompt_tokens is not None:
            check_int(self, "truncate_prompt_tokens")
            if why := truncation_error(self.truncate_prompt_tokens):
                raise ValueError(why)
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise bad("allowed_token_ids", "must hold at least one token id")
            if not all(map(is_token_id, self.allowed_token_ids)):
                raise bad("allowed_token_ids", "must be non-negative token ids")

    def vocab_token_ids(self) -> list[tuple[str, tuple[int, ...]]]:
        """The token ids, by field, that must be in the model's vocabulary (the front ends and
        the engine check them, knowing its size): the bounded-thinking ids the engine may
        force, and the ids ``logit_bias`` and ``allowed_token_ids`` name. (A stop id outside
        it is harmless: it never comes.)"""
        return [
            ("logit_bias", tuple(self.logit_bias or ())),
            ("allowed_token_ids", tuple(self.allowed_token_ids or ())),
            *self.forced_token_ids(),
        ]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adaptive_exit(self) -> bool:
        """Tokens exit by the gate (``exit_threshold < 1``) or by a named criterion (at any
        threshold: a criterion's values are not bounded by 1) other than ``none``."""
        if self.exit_criterion == "none":
            return False
        return self.exit_threshold < 1.0 or self.exit_criterion is not None

    def forced_token_ids(self) -> list[tuple[str, tuple[int, ...]]]:
        """The bounded-thinking ids the engine may force into the output (and feed back as
        inputs), by field: ``thinking_end_token_ids`` and a token-id ``thinking_interruption``
        (a text one is not ids until the front end encodes it)."""
        interruption = self.thinking_interruption
        return [
            ("thinking_end_token_ids", self.thinking_end_token_ids or ()),
            ("thinking_interruption", () if isinstance(interruption, str) else interruption or ()),
        ]

    def for_engine(self, vocab_size: int) -> SamplingParams:
        """These params as the front ends hand them to the engine (the caller's stay as given,
        as vLLM keeps them): each ``stop_token_ids`` and ``allowed_token_ids`` id once, in the
        order first given (a repeat changes nothing a request does, yet every copy would ride
        to the engine with each sample), and no stop id outside a vocabulary of ``vocab_size``
        (never produced; vLLM takes such ids unchecked, so they are dropped rather than
        refused, unlike ``allowed_token_ids`` ones: ``vocab_token_ids``)."""
        stops = [t for t in dict.fromkeys(self.stop_token_ids) if t < vocab_size]
        allowed = self.allowed_token_ids
        if allowed is not None:
            allowed = list(dict.fromkeys(allowed))
        if stops == self.stop_token_ids and allowed == self.allowed_token_ids:
            return self
        return self.replace(stop_token_ids=stops, allowed_token_ids=allowed)

    def clone(self) -> SamplingParams:
        """A copy (vLLM's ``clone``: RL code clones a template and changes ``n`` or ``seed``)."""
        return self.replace()

    def __setattr__(self, name: str, value: object) -> None:
        # A threshold defaulted at construction belongs to the criterion then named: one set
        # later (``params.exit_criterion = "argmax-stability"``) takes its own default, not
        # kl's or 1.0 (copies too: ``replace``). A threshold set by hand is given, and kept.
        if name == "exit_threshold":
            self.__dict__.pop("_auto_threshold", None)
        elif name == "exit_criterion" and self.__dict__.get("_auto_threshold"):
            auto = EXIT_CRITERIA.get(value, 1.0) if isinstance(value, str) else 1.0
            object.__setattr__(self, "exit_threshold", auto)
        object.__setattr__(self, name, value)

    def replace(self, **changes: object) -> SamplingParams:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.__dict__.get("_auto_threshold") and "exit_threshold" not in changes:
            values["exit_threshold"] = None
        values.update(changes)
        return SamplingParams(**values)


add_budget_alias(SamplingParams)  # (vLLM's thinking_token_budget)
