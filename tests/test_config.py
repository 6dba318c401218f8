"""The engine config dataclasses (``rltserve.config``): each setting is checked where it is
built, a bad value is a ValueError naming the field and the value, and the edge of every range
is accepted."""

from __future__ import annotations

import pytest
import torch

from rltserve.config import (
    CacheConfig,
    EngineConfig,
    ExecutionConfig,
    ModelConfig,
    SchedulerConfig,
)


def _refused(cls: type, prefix: str, **kwargs: object) -> None:
    with pytest.raises(ValueError, match="^" + prefix):
        cls(**kwargs)


def test_model_settings_name_the_bad_value():
    _refused(ModelConfig, r"max_logprobs=-2: must be an int >= -1", max_logprobs=-2)
    _refused(ModelConfig, r"max_logprobs=True:", max_logprobs=True)
    _refused(ModelConfig, r"max_logprobs=2.0:", max_logprobs=2.0)
    _refused(ModelConfig, r"logprobs_mode='raw_logits': must be one of", logprobs_mode="raw_logits")
    _refused(ModelConfig, r"dtype='half': must be one of", dtype="half")
    _refused(ModelConfig, r"seed='1': must be an int", seed="1")
    _refused(ModelConfig, r"max_model_len=1: must be an int >= 2 \(or -1", max_model_len=1)
    _refused(ModelConfig, r"max_model_len='1k': must be an int", max_model_len="1k")  # (as vLLM)
    config = ModelConfig(max_logprobs=-1, max_model_len=2, logprobs_mode="processed_logprobs")
    assert (config.max_logprobs, config.max_model_len) == (-1, 2)
    assert ModelConfig(max_model_len=-1).max_model_len is None  # vLLM's -1: the model's


@pytest.mark.parametrize("bad", ["gpu", "cuda0", "cuda:", "cpux", "cuda:1x", "CPU", "", None])
def test_a_device_must_be_one_torch_takes(bad):
    _refused(ModelConfig, rf"device={bad!r}: must be cpu, cuda", device=bad)


def test_devices_with_an_index_and_torch_devices_are_taken():
    assert ModelConfig(device="cuda:1").device == "cuda:1"
    assert ModelConfig(device="xpu").device == "xpu"
    config = ModelConfig(device=torch.device("cuda", 1))  # (no CUDA needed to describe one)
    assert config.device == "cuda:1" and type(config.device) is str


def test_cache_settings_name_the_bad_value():
    _refused(CacheConfig, r"kv policy 'dense'", kv_policy="dense")
    for bad in (0, 3, 12, -16):
        _refused(CacheConfig, rf"block_size={bad}: must be a power of two", block_size=bad)
    _refused(CacheConfig, r"num_blocks=0: must be an int >= 1", num_blocks=0)
    # (a str, a float or a bool from Python: a ValueError naming the field, not a TypeError)
    for bad in ("16", 16.0, True):
        _refused(CacheConfig, rf"block_size={bad!r}: must be a power of two", block_size=bad)
    for bad in ("10", 2.5, True):
        _refused(CacheConfig, rf"num_blocks={bad!r}: must be an int >= 1", num_blocks=bad)
    for bad in (0, float("inf"), "1"):  # (inf: the pool is sized in whole blocks)
        _refused(CacheConfig, rf"kv_cache_gb={bad!r}: must be a finite number > 0", kv_cache_gb=bad)
    _refused(CacheConfig, r"kv_reservation='partial': must be one of", kv_reservation="partial")
    for bad in (1.0, -0.01, "0.1"):
        _refused(CacheConfig, rf"kv_watermark={bad!r}: must be in \[0, 1\)", kv_watermark=bad)
    for bad in (-1, float("inf"), float("nan"), True):  # (inf: counted in whole bytes)
        why = rf"swap_space_gb={bad!r}: must be a finite number >= 0"
        _refused(CacheConfig, why, swap_space_gb=bad)
    _refused(CacheConfig, r"enable_prefix_caching='yes'", enable_prefix_caching="yes")
    for bad in (0, 1.01, -0.5, True, "0.5", float("nan")):
        why = r": must be in \(0, 1\]$"
        _refused(CacheConfig, rf"gpu_memory_utilization={bad!r}{why}", gpu_memory_utilization=bad)


def test_cache_settings_at_the_edges_of_their_ranges_are_taken():
    for size in (1, 2, 16, 256):
        assert CacheConfig(block_size=size).block_size == size
    config = CacheConfig(num_blocks=1, kv_cache_gb=0.001, kv_watermark=0.0, swap_space_gb=0)
    assert (config.num_blocks, config.kv_watermark, config.swap_space_gb) == (1, 0.0, 0)
    assert CacheConfig(kv_watermark=0.99, kv_reservation="full").kv_watermark == 0.99
    for share in (1, 1.0, 0.01):
        assert CacheConfig(gpu_memory_utilization=share).gpu_memory_utilization == share


@pytest.mark.parametrize(
    ("field", "bad"),
    [
        ("scheduling", "greedy"),
        ("exit_mode", "early"),
        ("preemption_mode", "kill"),
        ("scheduling_policy", "lifo"),
    ],
)
def test_scheduler_choices_name_the_bad_value(field, bad):
    _refused(SchedulerConfig, rf"{field}={bad!r}: must be one of", **{field: bad})


def test_scheduler_counts_name_the_bad_value():
    _refused(SchedulerConfig, r"speculative_tokens=-1: must be >= 0", speculative_tokens=-1)
    _refused(SchedulerConfig, r"max_num_seqs=True: must be an int >= 1", max_num_seqs=True)
    _refused(ModelConfig, r"seed=True: must be an int", seed=True)
    _refused(ExecutionConfig, r"attention_pad_budget='0': must be an int >= 0",
             attention_pad_budget="0")  # fmt: skip
    for field in ("max_num_seqs", "max_num_batched_tokens", "prefill_chunk_size"):
        _refused(SchedulerConfig, rf"{field}=0: must be an int >= 1", **{field: 0})
    _refused(
        SchedulerConfig,
        r"draft_loops=0: must be an int >= 1",
        speculative_tokens=1,
        draft_loops=0,
    )
    _refused(SchedulerConfig, r"draft_loops=2: only with token pipelining", draft_loops=2)
    _refused(
        SchedulerConfig,
        r"wavefront_prefill=True: needs scheduling='refill'",
        wavefront_prefill=True,
        scheduling="no_refill",
    )
    _refused(
        SchedulerConfig,
        r"prefill_chunk_size=65: must be <= max_num_batched_tokens \(64\)",
        prefill_chunk_size=65,
        max_num_batched_tokens=64,
    )


def test_scheduler_counts_at_the_edges_of_their_ranges_are_taken():
    config = SchedulerConfig(
        max_num_seqs=1, max_num_batched_tokens=64, prefill_chunk_size=64, speculative_tokens=0
    )
    assert (config.max_num_seqs, config.prefill_chunk_size) == (1, 64)
    assert SchedulerConfig(speculative_tokens=1, draft_loops=1).draft_loops == 1


def test_execution_settings_name_the_bad_value():
    _refused(ExecutionConfig, r"disaggregate='yes': must be True or False", disaggregate="yes")
    _refused(ExecutionConfig, r"cuda_graph_max_context=0: must be an int >= 1",
             cuda_graph_max_context=0)  # fmt: skip
    config = ExecutionConfig(cuda_graph_max_rows=1, cuda_graph_max_context=1)
    assert (config.cuda_graph_max_rows, config.cuda_graph_max_context) == (1, 1)


def test_cuda_graphs_need_a_cuda_device_of_any_index():
    with pytest.raises(ValueError, match=r"^cuda_graphs=True: needs a CUDA device \(device='cpu'"):
        EngineConfig.from_flat(cuda_graphs=True)
    for device in ("cuda", "cuda:1"):
        assert EngineConfig.from_flat(cuda_graphs=True, device=device).execution.cuda_graphs


def test_time_slices_are_refused_where_nothing_is_preempted():
    """(They were ignored: a fully reserved request never takes turns.)"""
    with pytest.raises(ValueError, match=r"^preemption_time_slice=4: only with kv_reservation="):
        EngineConfig.from_flat(preemption_time_slice=4, kv_reservation="full")
    assert EngineConfig.from_flat(preemption_time_slice=4).scheduler.preemption_time_slice == 4
    assert EngineConfig.from_flat(kv_reservation="full").cache.kv_reservation == "full"


def test_swap_preemption_is_refused_where_nothing_could_be_swapped():
    """A fully reserved request is never preempted, and without swap space every preemption
    recomputes: swap would only seem to be on."""
    with pytest.raises(ValueError, match=r"^preemption_mode='swap': only with kv_reservation="):
        EngineConfig.from_flat(preemption_mode="swap", kv_reservation="full")
    with pytest.raises(ValueError, match=r"^preemption_mode='swap': needs swap_space_gb > 0 "):
        EngineConfig.from_flat(preemption_mode="swap", swap_space_gb=0)
    for kw in (
        {"preemption_mode": "swap", "swap_space_gb": 1e-6},  # (a full space falls back too)
        {"preemption_mode": "recompute", "kv_reservation": "full", "swap_space_gb": 0},
    ):
        EngineConfig.from_flat(**kw)


def test_flat_options_reach_their_part_and_unknown_ones_are_named():
    config = EngineConfig.from_flat(
        dtype="bfloat16", block_size=32, max_num_seqs=3, attention_pad_budget=5
    )
    assert config.model.dtype == "bfloat16" and config.cache.block_size == 32
    assert config.scheduler.max_num_seqs == 3 and config.execution.attention_pad_budget == 5
    assert EngineConfig.from_flat() == EngineConfig()
    with pytest.raises(ValueError, match=r"^unknown engine option\(s\): blocksize, max_seqs$"):
        EngineConfig.from_flat(max_seqs=3, blocksize=32)
