"""vLLM's ``EngineArgs`` / ``AsyncEngineArgs`` and ``AsyncLLMEngine``: the lines a vLLM async
script starts with (``AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=...))``) run with
the import changed."""

from __future__ import annotations

import dataclasses

import pytest
from async_llm_util import ENGINE, GREEDY, collect

import rltserve
from rltserve import AsyncEngineArgs, AsyncLLM, AsyncLLMEngine, EngineArgs


def test_the_names_are_exported_as_vllms():
    from rltserve.engine import arg_utils, async_llm_engine

    assert AsyncLLMEngine is AsyncLLM
    assert {"EngineArgs", "AsyncEngineArgs", "AsyncLLMEngine"} <= set(rltserve.__all__)
    assert issubclass(AsyncEngineArgs, EngineArgs)
    # (vLLM's module paths: vllm.engine.arg_utils, vllm.engine.async_llm_engine)
    assert (arg_utils.EngineArgs, arg_utils.AsyncEngineArgs) == (EngineArgs, AsyncEngineArgs)
    assert async_llm_engine.AsyncLLMEngine is AsyncLLM


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


def test_engine_args_are_a_dataclass_of_llms_arguments(tiny):
    """vLLM's scripts build the engine from ``asdict(engine_args)``; an accepted vLLM argument
    changes nothing, so asdict leaving it out loses nothing, and one LLM would refuse is
    refused when the arguments are made, not dropped."""
    args = EngineArgs(model=str(tiny), disable_log_stats=True, **{**ENGINE, "max_model_len": 64})
    kwargs = dataclasses.asdict(args)
    assert list(kwargs)[0] == "model" and kwargs["max_model_len"] == 64
    assert kwargs["max_num_seqs"] == 64 and "disable_log_stats" not in kwargs
    assert dataclasses.replace(args, max_num_seqs=4).max_num_seqs == 4
    # (equal as dataclasses are: field by field, whether a value was given or is the default)
    plain = EngineArgs(model="m", max_model_len=64)
    assert dataclasses.replace(plain) == plain == EngineArgs("m", max_model_len=64, seed=0)
    assert plain != dataclasses.replace(plain, max_num_seqs=4)
    assert dataclasses.is_dataclass(AsyncEngineArgs("m"))
    with pytest.raises(ValueError, match="quantization='awq': not supported"):
        EngineArgs(model="m", quantization="awq")
    with rltserve.LLM(**kwargs) as llm:
        (out,) = llm.generate({"prompt_token_ids": [1, 2, 3]}, GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 8


def test_vllms_example_command_line_runs(tiny):
    """vLLM's ``examples/offline_inference/basic/generate.py``, the import changed: engine
    flags from ``EngineArgs.add_cli_args``, the script's own popped, ``LLM(**args)``."""
    from rltserve.utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(model=str(tiny))
    parser.add_argument_group("Sampling parameters").add_argument("--max-tokens", type=int)
    line = ["--max_model_len=64", "--num_blocks", "128", "--enable-prefix-caching"]
    args = vars(parser.parse_args([*line, "--max-tokens", "5"]))
    max_tokens = args.pop("max_tokens")
    assert "quantization" not in args and args["enable_prefix_caching"] is True
    with rltserve.LLM(**args, in_process=True) as llm:
        params = GREEDY.replace(max_tokens=max_tokens)
        (out,) = llm.generate({"prompt_token_ids": [1, 2, 3]}, params, use_tqdm=False)
        assert llm.llm_engine.model_config.max_model_len == 64
    assert len(out.outputs[0].token_ids) == 5
    engine_args = EngineArgs.from_cli_args(parser.parse_args(line))
    assert engine_args.max_model_len == 64 and engine_args.model == str(tiny)
    assert engine_args.enable_prefix_caching is True and engine_args.num_blocks == 128
    with pytest.raises(ValueError, match="quantization='awq'"):
        EngineArgs.from_cli_args(parser.parse_args(["--quantization", "awq"]))


def test_flexible_parser_leaves_values_and_positionals_as_they_are():
    from rltserve.utils import FlexibleArgumentParser, random_uuid

    assert len(random_uuid()) == 32 and random_uuid() != random_uuid()  # (vLLM's request ids)

    parser = FlexibleArgumentParser()
    parser.add_argument("--stop-text")
    parser.add_argument("rest", nargs="*")
    args = parser.parse_args(["--stop_text=a_b", "--", "--x_y"])
    assert args.stop_text == "a_b" and args.rest == ["--x_y"]


def test_flexible_parser_leaves_a_value_with_spaces_as_it_is():
    """argparse reads an argument that starts with ``--`` and holds a space as a value, not a
    flag: a prompt (YAML front matter, a Markdown rule) keeps its underscores."""
    from rltserve.cli import build_parser
    from rltserve.utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    parser.add_argument("--max-model-len")
    parser.add_argument("rest", nargs="*")
    args = parser.parse_args(["--max_model_len=a_b c", "--- title: snake_case ---"])
    assert args.max_model_len == "a_b c" and args.rest == ["--- title: snake_case ---"]
    prompt = "---\nname: my_doc\n---\nSummarise it."
    args = build_parser().parse_args(["generate", "--max_tokens", "3", prompt])
    assert args.prompt == [prompt] and args.max_tokens == 3
