"""Frozen configuration of an engine, validated on construction.

Every field's ``metadata["help"]`` is the one description of that setting: the CLI derives its
flags (``--max-num-seqs`` from ``max_num_seqs``) and help texts from these dataclasses.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields

from rltserve.caller_values import is_int, is_number
from rltserve.kv_policy import KVPolicy

DTYPES = ("float32", "bfloat16", "float16")
SCHEDULING = ("refill", "no_refill")
EXIT_MODES = ("gate", "delayed", "trace")
# Device strings torch accepts for the backends this engine runs on (a type, optionally ":N");
# checked here, torch-free, so a typo fails before a model is loaded.
_DEVICE = re.compile(r"(cpu|cuda|mps|xpu)(:\d+)?")
KV_RESERVATIONS = ("ondemand", "full")
PREEMPTION_MODES = ("recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "priority")
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


def _help(text: str, **extra: object) -> dict:
    return {"help": text, **extra}


def _check_device(name: str, value: object) -> None:
    if not isinstance(value, str) or not _DEVICE.fullmatch(value):
        why = "must be cpu, cuda, cuda:N, mps or xpu (a torch device)"
        raise ValueError(f"{name}={value!r}: {why}")


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = field(
        default=None,
        metadata=_help(
            "checkpoint directory, or a Hugging Face repo id in the local cache (default: the "
            "built-in demo model)"
        ),
    )
    tokenizer: str | None = field(
        default=None,
        metadata=_help(
            "tokenizer directory, or a Hugging Face repo id in the local cache (default: the "
            "checkpoint's)"
        ),
    )
    # The two below find repo ids in the cache: a built config holds the directories found
    # (model, tokenizer), no revision, and download_dir for repo ids of weight updates.
    revision: str | None = field(
        default=None,
        metadata=_help("branch, tag or commit of a repo id given as the model (default: main)"),
    )
    download_dir: str | None = field(
        default=None,
        metadata=_help(
            "Hugging Face cache folder to find repo ids in (default: HF_HUB_CACHE, or the hub "
            "folder of HF_HOME)"
        ),
    )
    dtype: str = field(
        default="float32",
        metadata=_help(
            "weight and activation dtype: float32, bfloat16, float16 (half), or auto: the "
            "checkpoint's"
        ),
    )
    device: str = field(default="cpu", metadata=_help("torch device, e.g. cpu or cuda"))
    seed: int = field(default=0, metadata=_help("engine seed for requests without a seed"))
    max_model_len: int | None = field(
        default=None,
        metadata=_help(
            "context limit in tokens, e.g. 4096, 4k or 4K (default, or -1 or auto as vLLM's: "
            "the model's, lowered to what the KV pool holds)"
        ),
    )
    logprobs_mode: str = field(
        default="raw_logprobs",
        metadata=_help(
            "what returned logprobs describe (vLLM's): raw_logprobs, the model's distribution; "
            "processed_logprobs, the one the token was drawn from (after penalties, logit_bias, "
            "temperature, top_k, top_p, min_p)"
        ),
    )

    max_logprobs: int = field(
        default=20,
        # (No CLI flag: ``serve`` has the HTTP API's own, --max-logprobs, at most 20.)
        metadata=_help(
            "most logprobs / prompt_logprobs a request may ask for (-1: no bound)", cli=False
        ),
    )

    def __post_init__(self) -> None:
        if type(self.max_logprobs) is not int or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs={self.max_logprobs!r}: must be an int >= -1")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"logprobs_mode={self.logprobs_mode!r}: must be one of {LOGPROBS_MODES}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: must be one of {DTYPES}")
        if type(self.device).__name__ == "device":  # a torch.device: kept as its string
            object.__setattr__(self, "device", str(self.device))
        _check_device("device", self.device)
        if not is_int(self.seed):
            raise ValueError(f"seed={self.seed!r}: must be an int")
        if self.max_model_len == -1:  # vLLM's "auto": the model's, fitted to the KV pool
            object.__setattr__(self, "max_model_len", None)
        length = self.max_model_len
        if length is not None and (type(length) is not int or length < 2):
            raise ValueError(f"max_model_len={length!r}: must be an int >= 2 (or -1: the model's)")


@dataclass(frozen=True)
class CacheConfig:
    kv_policy: str = field(
        default="last_exited",
        metadata=_help("KV policy: full, last_exited, shared or ring:K (Huginn)"),
    )
    block_size: int = field(default=16, metadata=_help("tokens per KV block"))
    num_blocks: int | None = field(
        default=None,
        metadata=_help(
            "KV blocks in the pool (default: sized from kv_cache_gb)",
            aliases=("--num-gpu-blocks-override",),  # (vLLM's name of the flag)
        ),
    )
    kv_cache_gb: float = field(
        default=1.0, metadata=_help("KV pool size in GiB when num_blocks is not given")
    )
    gpu_memory_utilization: float | None = field(
        default=None,
        metadata=_help(
            "vLLM's: the share of the device's memory in (0, 1] the engine may use; on CUDA the "
            "KV pool gets what the weights and a reserve for activations leave of it, unless "
            "num_blocks or kv_cache_gb is given (they win); no effect on the CPU, where "
            "kv_cache_gb sizes the pool"
        ),
    )
    kv_reservation: str = field(
        default="ondemand",
        metadata=_help(
            "ondemand: blocks are taken as steps write them (preemption under pressure); "
            "full: a request reserves prompt + max_tokens at admission (never preempted)"
        ),
    )
    kv_watermark: float = field(
        default=0.01,
        metadata=_help("ondemand: fraction of the KV pool that admission keeps free"),
    )
    swap_space_gb: float = field(
        default=4.0,
        metadata=_help(
            "host memory in GiB for KV of swapped-out requests (preemption_mode=swap)",
            aliases=("--swap-space",),  # (vLLM's name of the flag, in GiB too)
        ),
    )
    enable_prefix_caching: bool | None = field(
        default=None,
        metadata=_help(
            "reuse the KV of cached prompt prefixes on every plane (default: on where exact, "
            "i.e. kv_policy full or last_exited; shared and ring:K cannot have it)"
        ),
    )

    def __post_init__(self) -> None:
        KVPolicy.parse(self.kv_policy)  # raises ValueError naming the bad value
        size = self.block_size
        if not is_int(size) or size < 1 or size & (size - 1):
            raise ValueError(f"block_size={size!r}: must be a power of two")
        if self.num_blocks is not None and (not is_int(self.num_blocks) or self.num_blocks < 1):
            raise ValueError(f"num_blocks={self.num_blocks!r}: must be an int >= 1")
        gb = self.kv_cache_gb
        if not (is_number(gb) and 0 < gb < math.inf):
            raise ValueError(f"kv_cache_gb={gb!r}: must be a finite number > 0")
        share = self.gpu_memory_utilization
        if share is not None and (
            isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1
        ):
            raise ValueError(f"gpu_memory_utilization={share!r}: must be in (0, 1]")
        if self.kv_reservation not in KV_RESERVATIONS:
            raise ValueError(
                f"kv_reservation={self.kv_reservation!r}: must be one of {KV_RESERVATIONS}"
            )
        if not is_number(self.kv_watermark) or not 0.0 <= self.kv_watermark < 1.0:
            raise ValueError(f"kv_watermark={self.kv_watermark!r}: must be in [0, 1)")
        swap = self.swap_space_gb
        # (not inf: the space is counted in whole bytes at start)
        if not (is_number(swap) and 0 <= swap < math.inf):
            raise ValueError(f"swap_space_gb={swap!r}: must be a finite number >= 0")
        if self.enable_prefix_caching not in (None, True, False):
            raise ValueError(
                f"enable_prefix_caching={self.enable_prefix_caching!r}: must be True, False "
                "or None (on where exact)"
            )
        if self.enable_prefix_caching and not KVPolicy.parse(self.kv_policy).per_depth:
            raise ValueError(
                f"enable_prefix_caching=True: kv_policy={self.kv_policy!r} makes prompt KV depend "
                "on chunk boundaries, so cached prefixes would not be exact; use full or "
                "last_exited"
            )

    @property
    def prefix_caching(self) -> bool:
        """Whether prefix caching is on (resolving the default)."""
        if self.enable_prefix_caching is None:
            return KVPolicy.parse(self.kv_policy).per_depth
        return self.enable_prefix_caching


@dataclass(frozen=True)
class SchedulerConfig:
    scheduling: str = field(
        default="refill",
        metadata=_help("refill: free rows take new work every loop; no_refill: lockstep cohorts"),
    )
    exit_mode: str = field(
        default="gate",
        metadata=_help("gate: exit decided in the step; delayed: one loop late; trace: replay"),
    )
    max_num_seqs: int = field(default=64, metadata=_help("running requests at most"))
    max_num_batched_tokens: int = field(default=2048, metadata=_help("tokens per step at most"))
    prefill_chunk_size: int = field(default=512, metadata=_help("prompt tokens per chunk at most"))
    wavefront_prefill: bool = field(
        default=False,
        metadata=_help("run prompt chunks as a wavefront over (chunk, depth) cells"),
    )
    speculative_tokens: int = field(
        default=0,
        metadata=_help("token pipelining: draft tokens in flight per request (0 = off)"),
    )
    draft_loops: int | None = field(
        default=None,
        metadata=_help(
            "token pipelining: loops after which a token drafts the next "
            "(default: 2, or the model's loops - 1 when it has fewer than 3)"
        ),
    )
    carry_decode: bool = field(
        default=True,
        metadata=_help(
            "plan a decode token once; the runner runs its loops to the exit by itself "
            "(off: every loop is planned, the reference schedule)"
        ),
    )
    async_scheduling: bool = field(
        default=False,
        metadata=_help("plan the next step while the current one runs (two steps in flight)"),
    )
    preemption_mode: str = field(
        default="recompute",
        metadata=_help(
            "recompute: a preempted request's KV is freed and rebuilt on resume; "
            "swap: it goes to host swap space (recompute when that is full)"
        ),
    )
    preemption_time_slice: int = field(
        default=0,
        metadata=_help(
            "on-demand KV: a preempted request that has waited this many steps for blocks "
            "preempts, among the requests that ran as long since their admission and produced "
            "a token meanwhile, the one furthest ahead in outputs (swap) or with the fewest "
            "(recompute), which then queues as a new arrival: the admitted requests take turns "
            "instead of the last ones waiting for the first to end; 0: off (a preempted request "
            "waits for blocks to free)"
        ),
    )
    scheduling_policy: str = field(
        default="fcfs",
        metadata=_help(
            "fcfs: admit and preempt by arrival (a request's priority other than 0 is refused, "
            "as vLLM refuses it); priority: by SamplingParams.priority (lower first), and a "
            "better-priority arrival preempts running requests (not under --kv-reservation "
            "full, which never preempts: it waits for a seat)"
        ),
    )

    @property
    def whole_chunk_size(self) -> int:
        """Where prompts are cut under ``shared``/``ring``, whose prompt KV depends on chunk
        boundaries: every this many tokens, whatever else runs. A chunk then waits for a step
        whose budget holds it whole, which the decode rows of the other running requests
        (``max_num_seqs`` - 1 at most) never prevent alone."""
        room = self.max_num_batched_tokens - self.max_num_seqs + 1
        return max(1, min(self.prefill_chunk_size, room))

    def __post_init__(self) -> None:
        if self.scheduling not in SCHEDULING:
            raise ValueError(f"scheduling={self.scheduling!r}: must be one of {SCHEDULING}")
        if self.exit_mode not in EXIT_MODES:
            raise ValueError(f"exit_mode={self.exit_mode!r}: must be one of {EXIT_MODES}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode={self.preemption_mode!r}: must be one of {PREEMPTION_MODES}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy={self.scheduling_policy!r}: must be one of "
                f"{SCHEDULING_POLICIES}"
            )
        if not is_int(self.preemption_time_slice) or self.preemption_time_slice < 0:
            raise ValueError(
                f"preemption_time_slice={self.preemption_time_slice!r}: must be an int >= 0"
            )
        if not is_int(self.speculative_tokens) or self.speculative_tokens < 0:
            raise ValueError(f"speculative_tokens={self.speculative_tokens!r}: must be >= 0")
        for name in ("max_num_seqs", "max_num_batched_tokens", "prefill_chunk_size", "draft_loops"):
            value = getattr(self, name)
            if name == "draft_loops" and value is None:
                continue  # resolved against the model's loop count when the engine starts
            if not is_int(value) or value < 1:
                raise ValueError(f"{name}={value!r}: must be an int >= 1")
        if self.draft_loops is not None and not self.speculative_tokens:
            raise ValueError(
                f"draft_loops={self.draft_loops}: only with token pipelining "
                "(speculative_tokens >= 1)"
            )
        if self.wavefront_prefill and self.scheduling == "no_refill":
            raise ValueError("wavefront_prefill=True: needs scheduling='refill'")
        if self.prefill_chunk_size > self.max_num_batched_tokens:
            raise ValueError(
                f"prefill_chunk_size={self.prefill_chunk_size}: must be <= "
                f"max_num_batched_tokens ({self.max_num_batched_tokens})"
            )


@dataclass(frozen=True)
class ExecutionConfig:
    cuda_graphs: bool = field(
        default=False,
        metadata=_help("replay the loop of decode-only steps from CUDA graphs (device cuda)"),
    )
    cuda_graph_max_rows: int = field(
        default=256, metadata=_help("largest decode batch captured in a CUDA graph")
    )
    cuda_graph_max_context: int = field(
        default=4096,
        metadata=_help("longest context a CUDA graph covers (longer decode steps run eagerly)"),
    )
    attention_pad_budget: int = field(
        default=0,
        metadata=_help(
            "a step's attention groups (decode rows, prompt chunks, contexts of different "
            "lengths) attend as one padded batch when it has at most this many query-key "
            "pairs per head and gathers at most twice the context blocks the groups would "
            "(0: never; for GPUs, where a small model's step is bound by kernel launches: "
            "docs/benchmarks.md)"
        ),
    )
    disaggregate: bool = field(
        default=False,
        metadata=_help(
            "prefill/decode disaggregation: prompts run on a prefill stage, decoding on a "
            "decode stage (two worker processes on this host; a prompt's KV moves between them "
            "through shared memory)"
        ),
    )
    prefill_device: str | None = field(
        default=None,
        metadata=_help("disaggregate: the prefill stage's torch device (default: device)"),
    )
    kv_transfer_gb: float | None = field(
        default=None,
        metadata=_help(
            "disaggregate: GiB of moved prompt KV that may wait in shared memory (files whose "
            "requests the decode stage has not admitted yet); a prompt past it is computed on "
            "the decode stage instead (0: none moves; default: half the space free there at "
            "start)"
        ),
    )

    def __post_init__(self) -> None:
        if self.disaggregate not in (True, False):
            raise ValueError(f"disaggregate={self.disaggregate!r}: must be True or False")
        if self.prefill_device is not None:
            if not self.disaggregate:
                raise ValueError(
                    f"prefill_device={self.prefill_device!r}: only with disaggregate=True"
                )
            _check_device("prefill_device", self.prefill_device)
        space = self.kv_transfer_gb
        if space is not None:
            # (not inf: the bound is counted in whole bytes; a large number is no bound)
            if not (is_number(space) and 0 <= space < math.inf):
                raise ValueError(f"kv_transfer_gb={space!r}: must be None or a finite number >= 0")
            if not self.disaggregate:
                raise ValueError(f"kv_transfer_gb={space!r}: only with disaggregate=True")
        for name in ("cuda_graph_max_rows", "cuda_graph_max_context"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name}={value!r}: must be an int >= 1")
        budget = self.attention_pad_budget
        if not is_int(budget) or budget < 0:
            raise ValueError(f"attention_pad_budget={budget!r}: must be an int >= 0")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)

    def __post_init__(self) -> None:
        device = self.model.device
        if self.execution.cuda_graphs and not device.startswith("cuda"):
            raise ValueError(f"cuda_graphs=True: needs a CUDA device (device={device!r})")
        if self.scheduler.preemption_mode == "swap":
            if self.cache.kv_reservation == "full":
                raise ValueError(
                    "preemption_mode='swap': only with kv_reservation='ondemand' (a request "
                    "that reserves its whole context is never preempted, so nothing is swapped)"
                )
            if self.cache.swap_space_gb == 0:
                raise ValueError(
                    "preemption_mode='swap': needs swap_space_gb > 0 (without swap space every "
                    "preemption recomputes; use preemption_mode='recompute')"
                )
        if self.scheduler.preemption_time_slice and self.cache.kv_reservation == "full":
            raise ValueError(
                f"preemption_time_slice={self.scheduler.preemption_time_slice}: only with "
                "kv_reservation='ondemand' (a request that reserves its whole context is never "
                "preempted, so there are no turns to take)"
            )
        if self.execution.disaggregate:
            if not KVPolicy.parse(self.cache.kv_policy).per_depth:
                raise ValueError(
                    f"disaggregate=True: kv_policy={self.cache.kv_policy!r} makes prompt KV "
                    "depend on chunk boundaries, so it cannot move between stages; use full or "
                    "last_exited"
                )
            if self.cache.enable_prefix_caching is False:
                raise ValueError(
                    "disaggregate=True: needs prefix caching (the decode stage finds the "
                    "transferred prompt blocks in its prefix cache); leave "
                    "enable_prefix_caching unset or True"
                )

    @classmethod
    def from_flat(cls, **values: object) -> EngineConfig:
        """Builds the nested config from flat keyword arguments (LLM and CLI use this)."""
        parts = {}
        for name, sub in (
            ("model", ModelConfig),
            ("cache", CacheConfig),
            ("scheduler", SchedulerConfig),
            ("execution", ExecutionConfig),
        ):
            parts[name] = sub(**_take(values, sub))
        if values:
            raise ValueError(f"unknown engine option(s): {', '.join(sorted(values))}")
        return cls(**parts)


def _take(values: dict, cls: type) -> dict:
    names = {f.name for f in fields(cls)}
    return {k: values.pop(k) for k in list(values) if k in names}
