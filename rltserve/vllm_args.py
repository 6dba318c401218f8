"""vLLM's ``LLM(...)`` arguments that scripts written for it pass, as rltserve takes them.

- ``trust_remote_code``: accepted and without effect: rltserve never runs a checkpoint's code
  (the model families are built in).
- ``tensor_parallel_size``: 1 only. One engine runs on one device; for more, run replicas
  (``rltserve.ray``).
- ``enforce_eager=True``: no CUDA graphs (``cuda_graphs=False``, the default anyway).
- ``gpu_memory_utilization`` (``CacheConfig``'s, so also the engine commands'
  ``--gpu-memory-utilization``): on CUDA, when neither ``num_blocks`` nor ``kv_cache_gb`` is
  given, the KV pool gets that share of the device's memory less the weights and a reserve for
  activations (``kv_budget_bytes``, ``pool_kv_cache_gb``); on the CPU it has no effect
  (``kv_cache_gb`` sizes the pool there, as vLLM's CPU backend has its own setting).
- ``tokenizer``: a directory (or a Hugging Face repo id in the local cache) to load the
  tokenizer from instead of the checkpoint's.
- ``dtype``: also vLLM's ``auto`` (the checkpoint's), ``half`` and ``float``, or a
  ``torch.dtype`` (``preflight.resolve_dtype``).
- ``generation_config``: where ``get_default_sampling_params`` reads sampling defaults:
  ``auto`` the checkpoint's ``generation_config.json``, ``vllm`` none (vLLM's defaults), or a
  folder holding one (``generation_config_folder``).
- ``override_generation_config``: a dict of ``generation_config.json`` sampling keys
  (``GENERATION_CONFIG_KEYS``, ``max_new_tokens``) laid over what ``generation_config`` gives
  ``get_default_sampling_params`` (``generation_overrides``; None drops a default).
- ``swap_space`` (GiB): the host swap space, ``swap_space_gb``.
- ``model`` may be a Hugging Face repo id found in the local Hugging Face cache (``revision``
  picks the snapshot, ``download_dir`` is the cache folder, huggingface_hub's ``cache_dir``);
  nothing is downloaded (``preflight.resolve_model``).
- The arguments RL frameworks pass on every construction (``INERT``: TRL's ``enable_sleep_mode``,
  ``model_impl``, ``distributed_executor_backend``, ...) are accepted where their value asks
  for what rltserve does anyway; another value is a ValueError saying why it cannot be had.
  Among them verl's ``compilation_config`` (any value: it tunes vLLM's compilation and CUDA
  graph capture, and rltserve captures its own graphs, ``cuda_graphs``), vLLM's performance
  switches (``disable_cascade_attn``, ``num_scheduler_steps``, ``disable_async_output_proc``)
  and ``hf_overrides`` (empty only: the checkpoint's config is loaded as it is); vLLM's
  engine arguments at their defaults or other harmless values (``runner="generate"``,
  ``served_model_name``, ``hf_token``, ``disable_log_requests``, ``logits_processors=None``,
  ``kv_transfer_config=None``, ...). ``enable_chunked_prefill`` only True (or None): rltserve
  always prefills in chunks, and no setting of its own runs a prompt whole.
- ``reasoning_parser`` (also ``--reasoning-parser``): one of vLLM's parsers of
  ``<think>...</think>`` spans (``THINK_TAG_PARSERS``) or none: rltserve splits a chat answer's
  reasoning at those tags itself; a parser of another format is a ValueError.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from rltserve.caller_values import is_int
from rltserve.generation_config import GENERATION_CONFIG_KEYS
from rltserve.preflight import resolve_dtype
from rltserve.sampling import SamplingParams
from rltserve.utils.argparse_utils import json_object_arg

if TYPE_CHECKING:
    from rltserve.config import EngineConfig

# vLLM's chat_template_content_format values (LLM.chat, preprocess_chat).
CONTENT_FORMATS = ("auto", "string", "openai")
# What the weights and the KV pool leave of the device for activations and the allocator.
ACTIVATION_RESERVE_BYTES = 2**30
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def _any_bool(value: object) -> bool:
    return isinstance(value, bool)


def _one_of(*accepted: object) -> Callable[[object], bool]:
    return lambda value: any(
        value is a or (value == a and type(value) is type(a)) for a in accepted
    )


def _anything(value: object) -> bool:
    return True


def _is_str_or_none(value: object) -> bool:
    return value is None or isinstance(value, str)


def _is_str_list(value: object) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)


# vLLM's reasoning parsers of <think>...</think> spans: rltserve splits a chat answer's
# reasoning at those tags itself (``thinking.split_reasoning``), so naming one asks for nothing
# more; "" (or None) names none, as vLLM's default.
THINK_TAG_PARSERS = ("deepseek_r1", "qwen3", "glm45", "minimax_m2")

# vLLM's structured output backends: any of them is outlines-core's work here (``structured``),
# whose constraints are the same languages (JSON schema, regex, choice).
STRUCTURED_BACKENDS = ("auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer")
# vLLM's StructuredOutputsConfig switches rltserve has only off, and what to do instead.
STRUCTURED_OFF = {
    "disable_any_whitespace": "a request's structured_outputs.disable_any_whitespace asks for it",
    "disable_additional_properties": "give the schema additionalProperties: false",
    "enable_in_reasoning": "the constraint binds where the reasoning ends",
}


def structured_outputs_problem(value: object) -> str | None:
    """Why vLLM's ``structured_outputs_config`` (a dict of its StructuredOutputsConfig fields)
    asks for what rltserve lacks; None where it asks for nothing."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        return "a dict of vLLM's StructuredOutputsConfig fields"
    for key, field_value in value.items():
        if key == "backend" and field_value not in STRUCTURED_BACKENDS:
            return f"backend: one of {', '.join(STRUCTURED_BACKENDS)}"
        if key == "disable_fallback" and not isinstance(field_value, bool):
            return "disable_fallback: true or false"
        if key == "reasoning_parser" and not _one_of(None, "", *THINK_TAG_PARSERS)(field_value):
            return f"reasoning_parser: one of {', '.join(THINK_TAG_PARSERS)}, or none"
        if key in STRUCTURED_OFF and field_value is not False:
            return f"{key}: false only ({STRUCTURED_OFF[key]})"
        if key not in ("backend", "disable_fallback", "reasoning_parser", *STRUCTURED_OFF):
            return f"{key!r} is no StructuredOutputsConfig field rltserve knows"
    return None


# name -> (the values that ask for nothing rltserve lacks, why another value cannot be had:
# a text, or a function of the value giving one).
INERT: dict[str, tuple[Callable[[object], bool], str | Callable[[object], str | None]]] = {
    "enable_sleep_mode": (_any_bool, ""),  # sleep() and wake_up() need no preparation
    "model_impl": (_one_of("auto", "vllm"), "rltserve runs its own model code"),
    "distributed_executor_backend": (
        _one_of(None, "uni", "mp", "external_launcher"),
        "an engine runs in one worker on one device",
    ),
    "quantization": (_one_of(None), "quantized checkpoints are not supported"),
    "kv_cache_dtype": (_one_of("auto"), "the KV cache has the model's dtype"),
    # "dummy" (verl's: the trainer sends the weights before the first rollout) loads the
    # checkpoint's, which update_weights then replaces.
    "load_format": (_one_of("auto", "safetensors", "dummy"), "checkpoints load from safetensors"),
    # No scheduler mode runs a prompt whole: a chunk is cut wherever the step's budget ends.
    "enable_chunked_prefill": (
        _one_of(None, True),
        "rltserve always prefills prompts in chunks of at most prefill_chunk_size tokens; "
        "raise it, up to max_num_batched_tokens, for fewer chunks",
    ),
    "disable_log_stats": (_any_bool, ""),
    "disable_custom_all_reduce": (_any_bool, ""),
    "disable_mm_preprocessor_cache": (_any_bool, ""),
    "limit_mm_per_prompt": (lambda v: v is None or isinstance(v, Mapping), ""),  # text only
    "enable_lora": (
        _one_of(False),
        "LoRA adapters are not supported; serve a checkpoint with the adapter merged in",
    ),
    "max_lora_rank": (is_int, ""),  # (without enable_lora: unused)
    "max_loras": (is_int, ""),
    "speculative_config": (
        _one_of(None),
        "draft models are not supported (token pipelining: speculative_tokens=K)",
    ),
    "worker_extension_cls": (_one_of(None, ""), "no worker extensions (update_weights instead)"),
    "tokenizer_mode": (_one_of("auto", "hf"), "the checkpoint's fast tokenizer is used"),
    "task": (_one_of("auto", "generate"), "rltserve generates (no embeddings or scores)"),
    "cpu_offload_gb": (_one_of(0, 0.0), "the weights stay on the device"),
    "pipeline_parallel_size": (_one_of(1), "an engine runs on one device"),
    "data_parallel_size": (_one_of(1), "one engine per LLM (replicas: rltserve.ray.generate)"),
    "max_seq_len_to_capture": (is_int, ""),  # (CUDA graphs: cuda_graph_max_context)
    "compilation_config": (_anything, ""),  # (vLLM's graph capture; rltserve's: cuda_graphs)
    "disable_cascade_attn": (_any_bool, ""),
    "num_scheduler_steps": (lambda v: is_int(v) and v >= 1, "an int >= 1"),
    "disable_async_output_proc": (_any_bool, ""),
    "hf_overrides": (
        lambda v: v is None or (isinstance(v, Mapping) and not v),
        "rltserve loads the checkpoint's config as it is",
    ),
    "runner": (_one_of("auto", "generate"), "rltserve generates (no pooling models)"),
    "tokenizer_revision": (
        _one_of(None),
        "the tokenizer loads at the model's revision, or from the folder tokenizer= names",
    ),
    "code_revision": (_is_str_or_none, ""),  # (the checkpoint's code never runs here)
    "served_model_name": (
        lambda v: v is None or isinstance(v, str) or _is_str_list(v),
        "a name or a list of names",
    ),  # (a server's; offline nothing reads it)
    "disable_sliding_window": (_any_bool, ""),  # (the model families attend to all)
    "disable_log_requests": (_any_bool, ""),
    "enable_log_requests": (_any_bool, ""),  # (AsyncEngineArgs' newer name of the above)
    "enable_prompt_embeds": (_one_of(False), "prompts are token ids or text, not embeddings"),
    "kv_transfer_config": (
        _one_of(None),
        "no KV connectors (prefill/decode disaggregation: disaggregate=True)",
    ),
    "structured_outputs_config": (
        lambda v: structured_outputs_problem(v) is None,
        structured_outputs_problem,
    ),
    "guided_decoding_backend": (_is_str_or_none, "a backend name"),
    "hf_token": (lambda v: v is None or isinstance(v, (bool, str)), ""),  # (nothing downloads)
    "max_num_partial_prefills": (lambda v: is_int(v) and v >= 1, "an int >= 1"),
    "logits_processors": (
        lambda v: v is None or (isinstance(v, (list, tuple)) and not v),
        "no custom logits processors (logit_bias and allowed_token_ids shape sampling)",
    ),
    # (any: the prefix cache keys blocks by its own BLAKE2b digests, ``prefix_cache``)
    "prefix_caching_hash_algo": (lambda v: isinstance(v, str), "an algorithm's name"),
    "reasoning_parser": (
        _one_of(None, "", *THINK_TAG_PARSERS),
        "rltserve splits reasoning at <think> and </think> itself; the parsers of that format: "
        + ", ".join(THINK_TAG_PARSERS),
    ),
}
ONE_DEVICE = (
    "rltserve runs an engine on one device; for more devices run replicas "
    "(rltserve.ray.generate, serve --replicas)"
)
# LLM's own vLLM arguments that have flags, as INERT's entries (``check_flags``).
NAMED: dict[str, tuple[Callable[[object], bool], str]] = {
    "trust_remote_code": (_any_bool, ""),  # (rltserve never runs a checkpoint's code)
    "tensor_parallel_size": (_one_of(1), ONE_DEVICE),
    "enforce_eager": (_any_bool, ""),  # (no CUDA graphs: cuda_graphs off)
}
# The engine commands' flags of vLLM's for these arguments (``engine_args.add_vllm_args``), as
# ``vllm serve`` spells them: name -> the value's type (bool: --name and --no-name, as vLLM's;
# json_object_arg: a JSON object), and vLLM's short forms. The ones whose values are objects
# (logits_processors, ...) have none.
FLAGS: dict[str, Callable[[str], object]] = {
    "trust_remote_code": bool,
    "tensor_parallel_size": int,
    "enforce_eager": bool,
    "enable_sleep_mode": bool,
    "model_impl": str,
    "distributed_executor_backend": str,
    "quantization": str,
    "kv_cache_dtype": str,
    "load_format": str,
    "enable_chunked_prefill": bool,
    "disable_log_stats": bool,
    "disable_custom_all_reduce": bool,
    "disable_mm_preprocessor_cache": bool,
    "enable_lora": bool,
    "max_lora_rank": int,
    "max_loras": int,
    "tokenizer_mode": str,
    "task": str,
    "cpu_offload_gb": float,
    "pipeline_parallel_size": int,
    "data_parallel_size": int,
    "max_seq_len_to_capture": int,
    "compilation_config": str,
    "disable_cascade_attn": bool,
    "num_scheduler_steps": int,
    "disable_async_output_proc": bool,
    "runner": str,
    "tokenizer_revision": str,
    "code_revision": str,
    "disable_sliding_window": bool,
    "disable_log_requests": bool,
    "enable_prompt_embeds": bool,
    "guided_decoding_backend": str,
    "hf_token": str,
    "max_num_partial_prefills": int,
    "prefix_caching_hash_algo": str,
    "reasoning_parser": str,
    "structured_outputs_config": json_object_arg,
}
SHORT_FLAGS = {"tensor_parallel_size": "-tp", "pipeline_parallel_size": "-pp",
               "data_parallel_size": "-dp"}  # fmt: skip


def generation_config_folder(value: object, model: str) -> str | None:
    """Where sampling defaults come from for vLLM's ``generation_config`` argument: the
    checkpoint for ``auto``, none for ``vllm``, else the folder named (which must exist)."""
    if value == "auto":
        return model
    if value == "vllm":
        return None
    if isinstance(value, (str, Path)) and Path(value).is_dir():
        return str(value)
    raise ValueError(
        f"generation_config={value!r}: must be 'auto', 'vllm' or a folder holding a "
        "generation_config.json"
    )


def generation_overrides(value: object) -> dict[str, object]:
    """vLLM's ``override_generation_config`` as ``SamplingParams`` keywords (``max_new_tokens``
    as ``max_tokens``; a None value kept: it drops the default of that name). ValueError for
    a key vLLM does not read as a sampling default, or a value ``SamplingParams`` refuses."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"override_generation_config={value!r:.80}: must be a dict")
    keys = (*GENERATION_CONFIG_KEYS, "max_new_tokens")
    for key in value:
        if key not in keys:
            raise ValueError(
                f"override_generation_config: {key!r} is not a sampling default "
                f"(accepted: {', '.join(keys)})"
            )
    found = {"max_tokens" if k == "max_new_tokens" else k: v for k, v in value.items()}
    try:
        SamplingParams(**{k: v for k, v in found.items() if v is not None})
    except ValueError as exc:
        raise ValueError(f"override_generation_config: {exc}") from None
    return found


def check_inert(options: Mapping[str, object]) -> None:
    """TypeError for a name that is not a vLLM argument rltserve knows (as Python's own for an
    unexpected keyword), ValueError for a value it cannot honour."""
    for name, value in options.items():
        if name not in INERT:
            raise TypeError(f"LLM() got an unexpected keyword argument {name!r}")
        accepts, why = INERT[name]
        if not accepts(value):
            raise ValueError(f"{name}={value!r}: not supported ({refusal(why, value)})")


def check_flags(given: Mapping[str, object], replicas: bool = False) -> None:
    """``check_inert`` for the ``FLAGS`` an engine command was given, ValueErrors naming the
    flag (``--tensor-parallel-size 2: not supported (...)``). ``replicas``: the command has
    ``--replicas N`` (``serve``, ``bench offline``), which data parallelism's refusal names."""
    for name, value in given.items():
        accepts, why = NAMED.get(name) or INERT[name]
        if name == "data_parallel_size" and replicas and is_int(value) and value > 1:
            why = f"one engine per replica; for {value} engines: --replicas {value}"
        if not accepts(value):
            flag = "--" + name.replace("_", "-")
            if isinstance(value, bool):  # (--name or --no-name)
                flag = flag if value else "--no-" + flag[2:]
            else:  # (a JSON flag's value as it was written)
                flag += f" {json.dumps(value) if isinstance(value, dict) else value}"
            raise ValueError(f"{flag}: not supported ({refusal(why, value)})")


def refusal(why: str | Callable[[object], str | None], value: object) -> str:
    """An ``INERT`` entry's reason for refusing ``value``."""
    return (why(value) if callable(why) else why) or "wrong type"


def check_parallel(tensor_parallel_size: int) -> None:
    if tensor_parallel_size != 1:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size!r}: {ONE_DEVICE}")


def check_utilization(utilization: float) -> None:
    ok = isinstance(utilization, (int, float)) and not isinstance(utilization, bool)
    if not ok or not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization={utilization!r}: must be in (0, 1]")


def kv_budget_bytes(
    utilization: float, total_bytes: int, weight_bytes: int, stages: int = 1
) -> int:
    """The KV pool's share of a device of ``total_bytes`` used up to ``utilization`` by the
    engine: what the weights and ``ACTIVATION_RESERVE_BYTES`` leave; with ``stages`` engines
    on the device (prefill and decode), each one's share of what all their weights and
    reserves leave. ValueError when that is nothing."""
    check_utilization(utilization)
    reserve = stages * (weight_bytes + ACTIVATION_RESERVE_BYTES)
    budget = (int(utilization * total_bytes) - reserve) // stages
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization}: {utilization * total_bytes / 2**30:.1f} GiB "
            f"of the device leave no room for the KV cache beside the weights "
            f"({weight_bytes / 2**30:.1f} GiB) and the activations"
        )
    return budget


def pool_kv_cache_gb(config: EngineConfig, given: float | None) -> float:
    """``kv_cache_gb`` as ``LLM`` and the engine commands size the KV pool of ``config`` (built
    with the default size): ``given`` where the caller gave one; else, with the config's
    ``gpu_memory_utilization`` and no ``num_blocks``, on CUDA what that share of the device
    leaves (``kv_cache_gb_for``; each stage's half where a disaggregated pair shares the
    device); else the config's."""
    cache, model, execution = config.cache, config.model, config.execution
    if given is not None:
        return given
    if cache.gpu_memory_utilization is None or cache.num_blocks is not None:
        return cache.kv_cache_gb
    device, prefill = model.device, execution.prefill_device
    shared = prefill is None or device_key(prefill) == device_key(device)
    stages = 2 if execution.disaggregate and shared else 1
    gb = kv_cache_gb_for(cache.gpu_memory_utilization, device, model.model, model.dtype, stages)
    return cache.kv_cache_gb if gb is None else gb


def device_key(device: str) -> tuple[str, int]:
    """A device name as the device it names: "cuda" is "cuda:0" (the current device of a
    process that set none), so "cuda" and "cuda:0" are one GPU."""
    kind, _, index = device.partition(":")
    return kind, int(index or 0)


def kv_cache_gb_for(
    utilization: float, device: str, model: str | None, dtype: str, stages: int = 1
) -> float | None:
    """``kv_cache_gb`` for ``gpu_memory_utilization`` on ``device`` (None off CUDA), for each
    of ``stages`` engines sharing it, of checkpoint ``model`` (None: the demo model)."""
    check_utilization(utilization)
    if not device.startswith("cuda"):
        return None
    import torch

    from rltserve.models.demo import model_or_demo

    model = model_or_demo(model)
    total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    stored = resolve_dtype("auto", model)
    files = sum(f.stat().st_size for f in Path(model).glob("*.safetensors"))
    weights = files * _ITEMSIZE.get(dtype, 4) // _ITEMSIZE[stored]
    return kv_budget_bytes(utilization, total, weights, stages) / 2**30
