"""The offline API as users run it: the README example as a script file, on stdin and with a
``__main__`` guard (no guard needed: the stage worker never re-runs the caller's script), Ctrl-C
to the whole process group, and a worker that stops at interpreter exit. Every case runs in a
subprocess with a bounded timeout."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 300


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Using it") :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README 'Using it' has no python example"
    return match.group(1)


def readme_async_example() -> str:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    (code,) = [b for b in blocks if "AsyncLLM(" in b]
    return code


def example_on(model: Path, code: str | None = None) -> str:
    code = readme_example() if code is None else code
    assert '"path/to/Ouro-1.4B"' in code
    return code.replace('"path/to/Ouro-1.4B"', repr(str(model)))


def run_python(args: list[str], **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=TIMEOUT_S, **kw
    )


def check_example_output(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr
    assert "bootstrapping phase" not in proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 2, proc.stdout  # one line per prompt
    assert all(line.endswith((" length", " stop")) for line in lines), proc.stdout


def test_readme_example_runs_as_a_script_file(tiny, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(example_on(tiny))
    check_example_output(run_python([str(script)], cwd=tmp_path))


def test_readme_example_runs_from_stdin(tiny, tmp_path):
    check_example_output(run_python(["-"], input=example_on(tiny), cwd=tmp_path))


def test_readme_async_example_runs_as_a_script_file(tiny, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(example_on(tiny, readme_async_example()))
    proc = run_python([str(script)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith((" [length]\n", " [stop]\n")), proc.stdout


def test_readme_structured_outputs_example_runs_as_a_script_file(tiny, tmp_path):
    # Every offline example names its checkpoint the same way, so a reader (and this test)
    # swaps one placeholder for their path.
    pytest.importorskip("outlines_core")
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    (code,) = [b for b in blocks if "StructuredOutputsParams(" in b]
    script = tmp_path / "example.py"
    script.write_text(example_on(tiny, code))
    proc = run_python([str(script)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.lstrip().startswith("{") and '"age"' in proc.stdout, proc.stdout


def test_readme_example_runs_with_a_main_guard(tiny, tmp_path):
    body = "".join(f"    {line}\n" for line in example_on(tiny).splitlines())
    script = tmp_path / "guarded.py"
    script.write_text(f'if __name__ == "__main__":\n{body}')
    check_example_output(run_python([str(script)], cwd=tmp_path))


def test_worker_that_cannot_start_is_named_in_the_error(tiny, tmp_path):
    code = (
        "import sys\n"
        "from rltserve import LLM\n"
        "from rltserve.core.stage import StageError\n"
        "sys.executable = '/nonexistent/python'\n"
        f"try:\n    LLM({str(tiny)!r})\n"
        "except StageError as exc:\n    print('ERR', exc)\n"
    )
    proc = run_python(["-c", code], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "ERR cannot start the stage worker (/nonexistent/python -c" in proc.stdout


def test_ctrl_c_to_the_process_group_interrupts_generate_not_the_engine(tiny, tmp_path):
    # A terminal's Ctrl-C goes to the whole foreground group: the script and its worker. The
    # generate call is interrupted (and aborts its requests); the worker keeps serving.
    code = f"""
import json, os, signal, threading, time
from rltserve import LLM, SamplingParams
llm = LLM({str(tiny)!r}, num_blocks=1024)
def interrupt_when_running():
    for _ in range(30000):
        stats = llm._client.stats
        if stats is not None and stats.num_running:
            os.killpg(0, signal.SIGINT)
            return
        time.sleep(0.001)
threading.Thread(target=interrupt_when_running, daemon=True).start()
try:
    llm.generate([[1, 2, 3], [4, 5, 6]], SamplingParams(max_tokens=1500, ignore_eos=True))
    print("NOT INTERRUPTED")
except KeyboardInterrupt:
    print("INTERRUPTED")
out = llm.generate([[7, 8]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
stats = llm._client.stats
print(json.dumps({{"tokens": len(out.token_ids), "running": stats.num_running,
                  "kv": stats.kv_usage, "worker": llm._client.pid}}))
llm.close()
"""
    proc = run_python(["-c", code], cwd=tmp_path, start_new_session=True)
    assert proc.returncode == 0, proc.stderr
    first, last = proc.stdout.strip().splitlines()
    assert first == "INTERRUPTED"
    result = json.loads(last)
    assert result["tokens"] == 3
    assert result["running"] == 0 and result["kv"] == 0.0  # the interrupted requests were aborted
    assert_gone(result["worker"])


def test_unclosed_llm_stops_its_worker_at_interpreter_exit(tiny, tmp_path):
    code = (
        "from rltserve import LLM, SamplingParams\n"
        f"llm = LLM({str(tiny)!r}, num_blocks=64)\n"
        "llm.generate([[1, 2]], SamplingParams(max_tokens=2))\n"
        "print(llm._client.pid)\n"
    )
    proc = run_python(["-c", code], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert_gone(int(proc.stdout.strip()))


def test_worker_exits_when_its_parent_is_killed(tiny, tmp_path):
    code = (
        "import os, signal\n"
        "from rltserve import LLM\n"
        f"llm = LLM({str(tiny)!r}, num_blocks=64)\n"
        "print(llm._client.pid, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = run_python(["-c", code], cwd=tmp_path)
    assert proc.returncode == -signal.SIGKILL
    assert_gone(int(proc.stdout.strip()))


def assert_gone(pid: int, timeout_s: float = 30.0) -> None:
    """The process no longer exists (not even as a zombie: it was reaped)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        state = Path(f"/proc/{pid}/stat")
        if state.exists() and state.read_text().split(")")[-1].split()[0] == "Z":
            return  # a zombie of an exited parent, waiting for init to reap it
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    pytest.fail(f"worker {pid} still running {timeout_s} s later")


def test_worker_ignores_modules_in_the_current_directory(tiny, tmp_path):
    # A decoy package named like ours (another checkout, say) in the directory the user runs
    # from: the script itself does not see it (its own folder comes first), and neither may
    # the worker.
    decoy = tmp_path / "rltserve"
    decoy.mkdir()
    (decoy / "__init__.py").write_text("raise SystemExit('decoy rltserve imported')\n")
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    script = scripts / "example.py"
    script.write_text(example_on(tiny))
    check_example_output(run_python([str(script)], cwd=tmp_path))


# A script's first lines for the exit tests below: an exit hook, registered first so that it
# runs last, that prints the stage loop threads still alive; and a model load made slower by
# ``SLOW_S`` (a large checkpoint's), to be filled in.
EXIT_CHECK = """
import atexit, os, signal, threading, time
def check():
    alive = [t.name for t in threading.enumerate() if t.name == "rltserve-stage-loop"]
    print("ALIVE AT EXIT", alive, flush=True)
atexit.register(check)
from rltserve.core import engine
load = engine.EngineCore.__init__
def slow_load(self, *args, **kwargs):
    time.sleep(SLOW_S)
    load(self, *args, **kwargs)
engine.EngineCore.__init__ = slow_load
"""


def test_ctrl_c_while_an_in_process_stage_loads_lets_it_end_before_exit(tiny, tmp_path):
    # Ctrl-C during LLM(..., in_process=True): close() stops waiting for the stage's thread,
    # which cannot stop before its model has loaded. It must still end before the interpreter
    # finalizes: a daemon thread caught in torch's C++ code there aborts the process ("terminate
    # called without an active exception", exit code 134). A slow load stands in for a large
    # checkpoint; the check, registered first, runs last among the exit hooks.
    slow = EXIT_CHECK.replace("SLOW_S", "4.0")  # (longer than close()'s wait after Ctrl-C)
    code = (
        slow
        + f"""
from rltserve import LLM
threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
try:
    LLM({str(tiny)!r}, in_process=True, num_blocks=64)
except KeyboardInterrupt:
    print("INTERRUPTED", flush=True)
"""
    )
    proc = run_python(["-c", code], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["INTERRUPTED", "ALIVE AT EXIT []"], proc.stdout


def test_a_stage_still_loading_at_exit_ends_before_the_interpreter(tiny, tmp_path):
    # An in-process stage never closed: its finalizer stops it at exit, and a loop that
    # outlives the finalizer's wait (still loading here) must still end before the interpreter
    # finalizes. An exit hook registered from within the finalizer is dropped, never run.
    slow = EXIT_CHECK.replace("SLOW_S", "3.0")  # (longer than the finalizer's wait)
    code = (
        slow
        + f"""
from rltserve.config import EngineConfig
from rltserve.core import stage
stage._stop_loop.__defaults__ = (0.5,)  # (the finalizer's wait, shortened)
client = stage.InProcessStageClient(EngineConfig.from_flat(model={str(tiny)!r}, num_blocks=64))
"""
    )
    proc = run_python(["-c", code], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["ALIVE AT EXIT []"], proc.stdout


def test_generate_runs_with_stderr_closed(tiny, tmp_path):
    # generate's default use_tqdm=True asks whether stderr is a terminal; a script run with
    # stderr closed (``2>&-``: Python's sys.stderr is None) has none to ask.
    code = (
        "from rltserve import LLM, SamplingParams\n"
        f"with LLM({str(tiny)!r}, num_blocks=64) as llm:\n"
        "    out = llm.generate([[1, 2]], SamplingParams(max_tokens=2))\n"
        "print(len(out[0].outputs[0].token_ids))\n"
    )
    proc = run_python(["-c", code], cwd=tmp_path, preexec_fn=lambda: os.close(2))
    assert (proc.returncode, proc.stdout) == (0, "2\n")
