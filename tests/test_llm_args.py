"""vLLM's ``EngineArgs`` / ``AsyncEngineArgs`` and ``AsyncLLMEngine``: the lines a vLLM async
script starts with (``AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=...))``) run with
the import changed."""

from __future__ import annotations

import pytest
from async_llm_util import ENGINE, GREEDY, collect

import rltserve
from rltserve import AsyncEngineArgs, AsyncLLM, AsyncLLMEngine, EngineArgs


def test_the_names_are_exported_as_vllms():
    assert AsyncLLMEngine is AsyncLLM
    assert {"EngineArgs", "AsyncEngineArgs", "AsyncLLMEngine"} <= set(rltserve.__all__)
    assert issubclass(AsyncEngineArgs, EngineArgs)


def test_engine_args_hold_llms_keyword_arguments():
    args = AsyncEngineArgs(
        model="m", max_model_len=4096, enable_prefix_caching=True, enable_log_requests=False
    )
    assert vars(args) == {
        "model": "m",
        "max_model_len": 4096,
        "enable_prefix_caching": True,
        "enable_log_requests": False,
    }
    assert args.max_num_seqs == 64 and args.block_size == 16  # (LLM's defaults: left out)
    args.max_num_seqs = 8  # (mutable, as vLLM's dataclass)
    assert args.max_num_seqs == 8 and args == AsyncEngineArgs(**vars(args))
    assert repr(EngineArgs("m")) == "EngineArgs(model='m')"
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_model_length'"):
        EngineArgs(model="m", max_model_length=4096)
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        _ = args.nothing


async def test_from_engine_args_builds_the_engine(tiny):
    args = AsyncEngineArgs(model=str(tiny), disable_log_requests=True, **ENGINE)
    with pytest.raises(ValueError, match="stat_loggers"):
        AsyncLLMEngine.from_engine_args(args, stat_loggers=[object()])
    engine = AsyncLLMEngine.from_engine_args(args, start_engine_loop=True)
    try:
        assert engine.model_config.max_model_len == 256
        assert (await engine.get_model_config()).model == str(tiny)
        outs = await collect(engine, [1, 2, 3], GREEDY, "r1")
        assert outs[-1].finished and len(outs[-1].token_ids) == 8
    finally:
        engine.shutdown()
