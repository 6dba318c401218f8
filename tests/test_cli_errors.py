"""The ``rltserve`` command as a user runs it (a subprocess per case): bad input ends with one
``rltserve: error: ...`` line and exit code 2, a failure at run time with one line and exit
code 1; never a traceback, never a hang."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from test_http_harness import tiny_checkpoint

from rltserve import __version__
from rltserve.models.presets import make_model

TIMEOUT_S = 180


def rltserve(*args: str, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rltserve", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def assert_fails(proc: subprocess.CompletedProcess, code: int, *message: str) -> str:
    """One error line naming the cause, the exit code, no traceback; returns the line."""
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("rltserve: error: ")]
    assert len(errors) == 1, proc.stderr
    for part in message:
        assert part in errors[0], errors[0]
    assert proc.returncode == code, proc.stderr
    return errors[0]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cli-errors")
    ouro = tiny_checkpoint(tmp_path_factory)
    empty = root / "empty"
    empty.mkdir()
    afile = root / "afile"
    afile.write_text("not a checkpoint\n")
    corrupt = make_model("ouro-tiny", root / "corrupt", tokenizer=False)
    weights = corrupt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    unknown = make_model("ouro-tiny", root / "unknown", tokenizer=False)
    config = orjson.loads((unknown / "config.json").read_bytes())
    (unknown / "config.json").write_bytes(orjson.dumps({**config, "model_type": "bogus"}))
    return {"ouro": ouro, "empty": empty, "afile": afile, "corrupt": corrupt, "unknown": unknown}


# ------------------------------------------------------------------ usage errors (exit 2)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--model", "{root}/missing"], "no such checkpoint directory"),
        (["--model", "{empty}"], "has no config.json"),
        (["--model", "{afile}"], "is a file; pass the checkpoint's directory"),
        (["--device", "bogus"], "device='bogus': must be cpu, cuda"),
        (["--max-tokens", "0"], "max_tokens=0: must be >= 1"),
        (["--kv-policy", "bogus"], "kv policy 'bogus'"),
    ],
)
def test_generate_usage_errors(ckpts, args, message):
    paths = {k: str(v) for k, v in ckpts.items()} | {"root": str(ckpts["empty"].parent)}
    args = [a.format(**paths) for a in args]
    assert_fails(rltserve("generate", "Hi", *args), 2, message)


def test_generate_on_cuda_without_cuda_is_a_usage_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert_fails(rltserve("generate", "Hi", "--device", "cuda"), 2, "CUDA is not available")


def test_bench_offline_usage_errors():
    assert_fails(rltserve("bench", "offline", "--device", "bogus"), 2, "device='bogus'")
    for n in ("0", "-3"):
        assert_fails(rltserve("bench", "offline", "--num-prompts", n), 2, f"--num-prompts {n}")
    # --concurrency sets the running requests: --max-num-seqs would be silently replaced
    proc = rltserve("bench", "offline", "--n", "64", "--num-prompts", "8")
    assert_fails(proc, 2, "--n 64: above --num-prompts (8)")
    for sizes in ("", "8,0"):
        assert_fails(rltserve("bench", "offline", "--chunk-sizes", sizes), 2, "--chunk-sizes")
    proc = rltserve("bench", "host", "--quick", "--out", "/nonexistent/x.json")
    assert_fails(proc, 2, "--out /nonexistent/x.json: its directory does not exist")
    proc = rltserve("bench", "offline", "--max-num-seqs", "4")
    assert_fails(proc, 2, "--max-num-seqs 4: bench offline runs --concurrency requests")


def test_make_model_out_on_a_file_or_an_uncreatable_path(ckpts):
    afile = ckpts["afile"]
    assert_fails(rltserve("make-model", "--preset", "ouro-tiny", "--out", afile), 2, "is a file")
    proc = rltserve("make-model", "--preset", "ouro-tiny", "--out", afile / "sub")
    assert_fails(proc, 2, "cannot create it")
    proc = rltserve("make-model", "--preset", "ouro-tiny", "--out", "/proc/rltserve-test")
    assert_fails(proc, 2, "cannot create it")
    proc = rltserve("make-model", "--preset", "ouro-tiny", "--out", ckpts["ouro"])
    assert_fails(proc, 2, "is not empty (use --force to write into it)")


def test_serve_usage_errors(tmp_path, monkeypatch):
    monkeypatch.delenv("RLTSERVE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    proc = rltserve("serve", "--metrics-auth", "--port", "0")
    assert_fails(
        proc, 2, "--metrics-auth: needs an API key (--api-key, RLTSERVE_API_KEY or VLLM_API_KEY)"
    )
    proc = rltserve("serve", "--metrics-prefix", "sglang", "--port", "0")
    assert_fails(proc, 2, "metrics_prefix='sglang': must be one of 'rltserve', 'vllm'")
    proc = rltserve("serve", "--host", "no-such-host.invalid", "--port", "0")
    assert_fails(proc, 2, "--host no-such-host.invalid: cannot be resolved")
    missing = tmp_path / "cert.pem"
    proc = rltserve("serve", "--ssl-certfile", missing, "--ssl-keyfile", missing, "--port", "0")
    assert_fails(proc, 2, f"--ssl-certfile {missing}: no such file")
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    proc = rltserve("serve", "--ssl-certfile", junk, "--ssl-keyfile", junk, "--port", "0")
    assert_fails(proc, 2, "cannot load them")


def test_no_arguments_print_help_and_exit_2():
    proc = rltserve()
    assert proc.returncode == 2
    assert "usage: rltserve" in proc.stderr and "generate" in proc.stderr
    assert proc.stdout == ""
    proc = rltserve("bench")  # named by the choices, not by argparse's dest "bench_command"
    assert proc.returncode == 2
    assert "required: {offline,serve,rollout,host}" in proc.stderr


def test_python_m_rltserve_is_the_command():
    proc = rltserve("info")
    assert proc.returncode == 0, proc.stderr
    assert orjson.loads(proc.stdout)["version"]
    proc = rltserve("--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage: rltserve")
    # (plain text, no RST markup; every subcommand named, chat and complete too)
    words = " ".join(proc.stdout.split())
    assert "The rltserve command: generate, serve, chat, complete, bench, make-model" in words
    proc = rltserve("--version")
    assert proc.returncode == 0 and proc.stdout == f"rltserve {__version__}\n"


def test_a_reader_that_goes_away_is_not_an_error():
    # `rltserve info | head -c 1`: stdout closed before the command writes
    proc = subprocess.Popen(
        [sys.executable, "-m", "rltserve", "info"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    proc.stdout.close()
    _, err = proc.communicate(timeout=TIMEOUT_S)
    assert err == b"" and proc.returncode == 1


def test_exit_mode_trace_is_refused_by_the_commands():
    # trace replays the depths each request gives, which no command or HTTP request can
    # (serve started and then answered every request with a 400)
    for command in (["generate", "Hi"], ["serve"]):
        assert_fails(rltserve(*command, "--exit-mode", "trace"), 2, "--exit-mode trace: replays")


def test_an_unknown_flag_before_any_command_is_named():
    # (argparse reported "the following arguments are required: {generate,...}")
    proc = rltserve("--bogus")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("usage: rltserve ")
    assert "rltserve: error: unrecognized arguments: --bogus" in proc.stderr
    assert rltserve("--vers").stdout.startswith("rltserve ")  # (a prefix of --version)


def test_an_unknown_flag_shows_its_command_usage():
    for command in (["generate"], ["bench", "offline"], ["serve"]):
        proc = rltserve(*command, "--bogus")
        assert proc.returncode == 2 and proc.stdout == ""
        name = " ".join(["rltserve", *command])
        assert proc.stderr.startswith(f"usage: {name} ")
        assert f"{name}: error: unrecognized arguments: --bogus" in proc.stderr


# ------------------------------------------------------------------ runtime failures (exit 1)


@pytest.mark.parametrize(
    ("name", "message"), [("corrupt", "model.safetensors"), ("unknown", "model_type 'bogus'")]
)
def test_generate_on_a_checkpoint_that_does_not_load(ckpts, name, message):
    proc = rltserve("generate", "Hi", "--model", ckpts[name])
    line = assert_fails(proc, 1, message)  # (a ValueError now, but still a failure: exit 1)
    assert "stage failed" not in line


@pytest.mark.parametrize(
    "args,message",
    [
        (["--kv-policy", "ring:2"], "kv_policy='ring:2': ring:K is for Huginn only"),
        (["--speculative-tokens", "1", "--draft-loops", "9"], "draft_loops=9: must be below"),
    ],
)
def test_generate_with_flags_the_model_cannot_take(ckpts, args, message):
    """Refused by the engine as it starts: bad input like the config's own checks."""
    proc = rltserve("generate", "Hi", "--model", ckpts["ouro"], "--num-blocks", "64", *args)
    line = assert_fails(proc, 2, message)
    assert "stage failed" not in line


def test_serve_with_a_setting_the_model_cannot_take_exits_2():
    # found as the engine starts (the model's context), reported as generate reports it
    proc = rltserve("serve", "--port", "0", "--max-model-len", "100000")
    assert_fails(proc, 2, "max_model_len=100000")


def test_serve_on_a_port_in_use():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = rltserve("serve", "--port", port)
    assert_fails(proc, 1, f"cannot listen on 127.0.0.1:{port}", "in use")


# ------------------------------------------------------------------ bench serve


def test_bench_serve_rejects_a_malformed_url_at_once():
    for url in ("notaurl", "ftp://127.0.0.1", "http://127.0.0.1:99999"):
        proc = rltserve("bench", "serve", "--url", url, timeout=60)
        assert_fails(proc, 2, f"url={url!r}: must be an http(s) URL")


def test_bench_serve_against_nothing_says_it_waits_then_fails():
    proc = rltserve("bench", "serve", "--url", "http://127.0.0.1:1", "--wait-timeout", "1")
    assert "waiting up to 1 s for the server at http://127.0.0.1:1" in proc.stderr
    assert_fails(proc, 1, "no server ready at http://127.0.0.1:1 after 1 s")
    assert proc.stdout == ""


def test_exit_codes_by_kind_of_failure():
    from rltserve.cli import exit_code
    from rltserve.core.stage import StageCheckpointError, StageConfigError, StageError
    from rltserve.models import CheckpointError

    assert exit_code(ValueError("bad flag")) == 2
    assert exit_code(CheckpointError("weights do not load")) == 1  # a ValueError, but not input
    assert exit_code(StageError("stage failed")) == 1
    assert exit_code(StageConfigError("max_model_len=9999: ...")) == 2  # the engine refused it
    assert exit_code(StageCheckpointError("config.json: ...")) == 1  # the loader's refusal
    assert exit_code(ConnectionRefusedError()) == 1
    assert exit_code(KeyError("a bug")) is None  # re-raised: its traceback is the report


def test_bench_offline_compare_of_cuda_graphs_runs_eager_cells_on_a_cpu(ckpts):
    """--cuda-graphs --compare picks graphs per cell, so the flag is no config error off CUDA
    (scripts/gpu_check.sh smoke-tests itself this way)."""
    proc = rltserve(
        "bench", "offline", "--model", ckpts["ouro"], "--cuda-graphs", "--compare",
        "--concurrency-list", "1", "--input-len", "4", "--output-len", "2", "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert orjson.loads(proc.stdout)["graphs_compare"]["modes"] == ["eager"]
    proc = rltserve("bench", "offline", "--model", ckpts["ouro"], "--cuda-graphs")
    assert_fails(proc, 2, "cuda_graphs=True: needs a CUDA device")


def test_a_config_the_engine_refuses_at_start_is_a_usage_error():
    """Checks only the engine can make (a context the KV pool cannot hold, one past the
    model's) fail like the config's own: one line, exit code 2. (The demo model: 4096 tokens.)"""
    base = ("generate", "Hello", "--max-tokens", "2")
    proc = rltserve(*base, "--max-model-len", "100", "--num-blocks", "8")
    assert_fails(proc, 2, "max_model_len=100: the KV pool (8 blocks of 16 tokens")
    proc = rltserve(*base, "--max-model-len", "100000")
    assert_fails(proc, 2, "max_model_len=100000: the model's context is 4096 tokens")
