"""vLLM's example scripts, ported by changing ``vllm`` to ``rltserve`` in their imports: the
module paths their current versions import from (``vllm.utils.argparse_utils``,
``vllm.v1.engine.async_llm``, ``vllm.v1.metrics.reader``, ``vllm.distributed``) hold the same
objects as rltserve's own, the clean-up between two engines in one process frees the first, and
``LLMEngine``, which rltserve has none of, refuses saying what to use. The offline API these
scripts drive: test_llm_vllm, test_llm_vllm_surface."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import rltserve

ROOT = Path(__file__).resolve().parent.parent


def test_vllms_current_module_paths_hold_rltserves_objects():
    from rltserve import distributed, metrics_reader, utils
    from rltserve.distributed import parallel_state
    from rltserve.utils import argparse_utils
    from rltserve.v1.engine import async_llm
    from rltserve.v1.metrics import reader

    assert argparse_utils.FlexibleArgumentParser is utils.FlexibleArgumentParser
    assert async_llm.AsyncLLM is rltserve.AsyncLLM
    for name in ("Counter", "Gauge", "Histogram", "Metric", "Vector"):
        assert getattr(reader, name) is getattr(metrics_reader, name)
    cleanup = parallel_state.cleanup_dist_env_and_memory
    assert distributed.cleanup_dist_env_and_memory is cleanup
    for module in (argparse_utils, async_llm, reader, distributed):
        assert all(getattr(module, name) for name in module.__all__)


def test_llm_engine_imports_and_refuses_naming_what_to_use():
    from rltserve.engine.llm_engine import LLMEngine

    assert rltserve.LLMEngine is LLMEngine and "LLMEngine" not in rltserve.__all__
    args = rltserve.EngineArgs(model="m")
    for make in (lambda: LLMEngine.from_engine_args(args), lambda: LLMEngine(args)):
        with pytest.raises(ValueError, match=r"LLMEngine: not supported: .*LLM\(\*\*vars\(args"):
            make()


def test_cleanup_after_del_stops_an_engine_held_in_a_cycle(tiny):
    """``del llm; cleanup_dist_env_and_memory()`` before the next engine, as vLLM's
    prefix-caching example runs it: an engine still referenced from a cycle is collected there,
    and its worker process has ended when the call returns."""
    from rltserve.distributed import cleanup_dist_env_and_memory

    llm = rltserve.LLM(str(tiny), num_blocks=64, max_model_len=128)
    pid = llm._client.pid
    cycle: list = [llm]
    cycle.append(cycle)
    gc.disable()  # (so that only the clean-up collects the cycle)
    try:
        del llm, cycle
        os.kill(pid, 0)  # (still running: the cycle holds it)
        cleanup_dist_env_and_memory()
    finally:
        gc.enable()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


# The key lines of vLLM's generate.py, metrics.py and prefix_caching.py examples with only the
# package name changed: the parser from vllm.utils.argparse_utils, the metric classes from
# vllm.v1.metrics.reader, and the clean-up between two engines from vllm.distributed.
PORTED = """
from rltserve import LLM, EngineArgs
from rltserve.distributed import cleanup_dist_env_and_memory
from rltserve.utils.argparse_utils import FlexibleArgumentParser
from rltserve.v1.metrics.reader import Counter, Gauge

parser = FlexibleArgumentParser()
EngineArgs.add_cli_args(parser)
parser.set_defaults(model={model!r})
parser.add_argument_group("sampling").add_argument("--max-tokens", type=int)
args = vars(parser.parse_args(["--max_model_len", "128", "--max-tokens", "3"]))
max_tokens = args.pop("max_tokens")
texts = []
for caching in (False, True):
    llm = LLM(**{{**args, "enable_prefix_caching": caching}})
    params = llm.get_default_sampling_params()
    params.max_tokens, params.temperature = max_tokens, 0.0
    outputs = llm.generate(["Hello, my name is", "The capital of France is"], params)
    texts.append([o.outputs[0].text for o in outputs])
    kinds = {{m.name: type(m).__name__ for m in llm.get_metrics()
             if isinstance(m, (Counter, Gauge))}}
    del llm
    cleanup_dist_env_and_memory()
print(json.dumps([texts[0] == texts[1], len(texts[0][0]) > 0, kinds["vllm:prompt_tokens"]]))
"""


def test_a_ported_example_with_vllms_current_imports_runs(tiny, tmp_path):
    script = tmp_path / "ported.py"
    script.write_text("import json\n" + textwrap.dedent(PORTED.format(model=str(tiny))))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [True, True, "Counter"]


def test_add_cli_args_takes_vllms_flags_of_llms_other_arguments(tiny):
    """vLLM's ``--generation-config vllm`` (its own sampling defaults, not the checkpoint's) and
    ``--override-generation-config`` on an example's command line reach ``LLM``."""
    from rltserve.utils.argparse_utils import FlexibleArgumentParser

    parser = rltserve.EngineArgs.add_cli_args(FlexibleArgumentParser())
    line = ["--model", str(tiny), "--generation-config", "vllm", "--max_logprobs", "3"]
    line += ["--num-blocks", "64", "--max-model-len", "64"]
    override = ["--override-generation-config", '{"temperature": 0.25}']
    args = vars(parser.parse_args([*line, *override, "--skip-tokenizer-init"]))
    assert args["override_generation_config"] == {"temperature": 0.25}
    assert args["skip_tokenizer_init"] is True and args["max_logprobs"] == 3
    del args["skip_tokenizer_init"]
    with rltserve.LLM(**args, in_process=True) as llm:
        assert llm.get_default_sampling_params().temperature == 0.25
        with pytest.raises(ValueError, match="max_logprobs"):
            llm.generate([[1, 2]], rltserve.SamplingParams(logprobs=5), use_tqdm=False)
    assert "generation_config" not in vars(parser.parse_args([]))  # (only when given)
    with pytest.raises(SystemExit):
        parser.parse_args(["--override-generation-config", "{not json"])
