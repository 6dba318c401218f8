"""Bad input for the Ray scale-out flags: one ``rltserve: error:`` line and exit code 2, before
any model loads or cluster starts, whether or not Ray is installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rltserve.ray.config import ReplicaConfig

ROOT = Path(__file__).resolve().parents[1]


def rltserve(*args: str, pythonpath: str | None = None) -> subprocess.CompletedProcess:
    paths = [p for p in (pythonpath, str(ROOT), os.environ.get("PYTHONPATH")) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    return subprocess.run(
        [sys.executable, "-m", "rltserve.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def error_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("rltserve: error:")]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    return lines[0]


@pytest.mark.parametrize("command", [["serve", "--port", "0"], ["bench", "offline"]])
def test_zero_replicas_is_a_usage_error(command):
    result = rltserve(*command, "--replicas", "0")
    assert result.returncode == 2
    assert "--replicas 0: must be an int >= 1" in error_line(result)


def test_replicas_without_ray_installed_say_how_to_install_it(tmp_path):
    fake = tmp_path / "ray"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'ray'\", name='ray')\n"
    )
    result = rltserve("serve", "--replicas", "2", "--port", "0", pythonpath=str(tmp_path))
    assert result.returncode == 2
    line = error_line(result)
    assert "--replicas: Ray Serve is not installed" in line
    assert "pip install 'rltserve[ray]'" in line


def test_an_unreachable_ray_address_is_a_usage_error():
    pytest.importorskip("ray")
    result = rltserve("serve", "--replicas", "1", "--ray-address", "127.0.0.1:1", "--port", "0")
    assert result.returncode == 2
    assert "--ray-address 127.0.0.1:1: cannot reach 127.0.0.1:1" in error_line(result)


def test_ray_address_also_comes_from_ray_address_in_the_environment(monkeypatch):
    pytest.importorskip("ray")
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    result = rltserve("serve", "--replicas", "1", "--port", "0")
    assert result.returncode == 2
    assert "RAY_ADDRESS 127.0.0.1:1: cannot reach 127.0.0.1:1" in error_line(result)
    monkeypatch.setenv("RAY_ADDRESS", "ray://127.0.0.1:1")
    result = rltserve("serve", "--replicas", "1", "--port", "0")
    assert result.returncode == 2
    assert "RAY_ADDRESS ray://127.0.0.1:1: a Ray Client address cannot stream" in error_line(result)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"replicas": -1}, "--replicas -1: must be an int >= 1"),
        ({"replicas": True}, "--replicas True: must be an int >= 1"),
        ({"replicas": 1, "replica_gpus": True}, "--replica-gpus True: must be a number >= 0"),
        ({"replicas": 1, "replica_cpus": -1}, "--replica-cpus -1: must be a number >= 0"),
        ({"replicas": 1, "replica_affinity": "x"}, "--replica-affinity x: must be one of"),
        ({"replicas": 1, "ray_address": " "}, "--ray-address ' ': must not be empty"),
        ({"ray_address": "auto", "replica_gpus": 1}, "--ray-address, --replica-gpus: only with"),
        ({"replica_cpus": 2.0}, "--replica-cpus: only with --replicas N"),
        ({"replicas": 1, "ray_app": " "}, "--ray-app ' ': must not be empty"),
        ({"ray_replace_app": True}, "--ray-replace-app: only with --replicas N"),
        ({"replicas": 1, "ray_replace_app": "yes"}, "--ray-replace-app 'yes': must be a bool"),
    ],
)
def test_replica_config_names_the_bad_flag(kwargs, message):
    with pytest.raises(ValueError) as info:
        ReplicaConfig(**kwargs)
    assert str(info.value).startswith(message)


def test_replica_gpus_follow_the_engines_devices_unless_given():
    """One GPU per distinct CUDA device (``cuda`` is ``cuda:0``), none on CPU; a CUDA engine on
    0 GPUs is refused (Ray would leave every replica every GPU, and they would share GPU 0)."""
    config = ReplicaConfig(replicas=2)
    assert config.replica_gpus is None
    gpus = [
        config.for_devices(devices).replica_gpus
        for devices in [("cpu", None), ("cuda", None), ("cuda", "cuda:0"), ("cuda:0", "cuda:1")]
    ]
    assert gpus == [0.0, 1.0, 1.0, 2.0]
    given = ReplicaConfig(replicas=2, replica_gpus=0.5)
    assert given.for_devices(("cuda", None)) is given
    assert ReplicaConfig(replicas=1, replica_gpus=1).for_devices(("cpu", None)).replica_gpus == 1
    with pytest.raises(ValueError) as info:
        ReplicaConfig(replicas=2, replica_gpus=0).for_devices(("cuda", "cuda:1"))
    assert str(info.value) == (
        "--replica-gpus 0: the engine runs on CUDA (cuda:0, cuda:1), so each replica needs GPUs "
        "from Ray; leave --replica-gpus out (one per CUDA device) or give a share (0.5: two "
        "replicas per GPU)"
    )


def test_replica_threads_follow_cpus():
    assert ReplicaConfig(replicas=2, replica_cpus=2.0).threads == 2
    assert ReplicaConfig(replicas=2, replica_cpus=0.5).threads == 1
    assert ReplicaConfig(replicas=2, replica_cpus=1.5).threads == 1  # never more than its CPUs


def test_offline_generate_refuses_what_llm_would_before_any_cluster_starts():
    from rltserve.ray import generate
    from rltserve.sampling import SamplingParams

    with pytest.raises(ValueError, match="model='/no/such/dir': no such checkpoint directory"):
        generate([[1]], replicas=1, model="/no/such/dir")
    with pytest.raises(ValueError, match="replicas='2': must be an int >= 1"):
        generate([[1]], replicas="2")
    with pytest.raises(ValueError, match="params: 2 given for 1 prompts"):
        generate([[1]], [SamplingParams(temperature=0.0)] * 2, replicas=1)
    with pytest.raises(ValueError, match="prompts: required"):
        generate(replicas=1)


def test_offline_generate_takes_older_vllms_prompt_token_ids(monkeypatch):
    from rltserve.ray import offline

    pools = []

    class Pool:
        def __init__(self, config, engine_kw, startup_timeout_s) -> None:
            pools.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            pass

        def generate(self, prompts, params, priority=None):
            return prompts

    monkeypatch.setattr(offline, "ReplicaPool", Pool)
    monkeypatch.setattr(offline, "check_checkpoint_dir", lambda *a: None)
    got = offline.generate(prompt_token_ids=[[1, 2], [3]], replicas=1, model="/m")
    assert got == [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}]


def test_serve_with_replicas_hands_its_limits_to_the_replica_set(monkeypatch):
    """``serve --replicas``: the replica set takes --max-concurrent, --drain-timeout-s and the
    cluster it owns (neither a cluster nor a model is started here: only what serve passes on)."""
    import rltserve.http.server
    import rltserve.ray.cluster
    from rltserve.cli import build_parser
    from rltserve.http.cli import cmd_serve
    from rltserve.ray.client import ReplicaSetClient

    factories, served = [], []
    monkeypatch.setattr(rltserve.ray.cluster, "connect", lambda config: True)
    monkeypatch.setattr(ReplicaSetClient, "factory", lambda *a: factories.append(a) or "made")
    monkeypatch.setattr(rltserve.http.server, "run_server", lambda *a: served.append(a) or 0)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    flags = ["--replicas", "2", "--max-concurrent", "8", "--port", "0", "--log-level", "error"]
    flags += ["--drain-timeout-s", "42"]
    assert cmd_serve(build_parser().parse_args(["serve", *flags])) == 0
    [(replica_config, max_ongoing, owned, drain_timeout_s)] = factories
    assert (replica_config.replicas, max_ongoing, owned) == (2, 8, True)
    # A replica Serve stops (`ray drain-node`) gives its streams what the server gives its own.
    assert drain_timeout_s == 42.0
    [(server_config, _, factory)] = served
    assert server_config.max_concurrent == 8 and factory == "made"


def test_serve_refuses_the_stage_watchdog_with_replicas(monkeypatch):
    """It would do nothing: Ray Serve's health checks replace a hung replica (refused before a
    cluster starts)."""
    import rltserve.ray.cluster
    from rltserve.cli import build_parser
    from rltserve.http.cli import cmd_serve

    monkeypatch.setattr(rltserve.ray.cluster, "connect", lambda config: pytest.fail("started"))
    flags = ["serve", "--replicas", "2", "--stage-watchdog-s", "30", "--port", "0"]
    with pytest.raises(ValueError) as info:
        cmd_serve(build_parser().parse_args(flags))
    assert str(info.value) == (
        "--stage-watchdog-s 30: not with --replicas N (Ray Serve's health checks replace a "
        "replica that stops answering)"
    )


def test_bench_offline_replicas_runs_the_single_engines_requests(monkeypatch):
    """``bench offline --replicas`` sends the requests the single-engine run sends: its depth,
    exit threshold and criterion (they were left out, the flags silently ignored)."""
    from rltserve.bench.offline import _params
    from rltserve.cli import build_parser
    from rltserve.ray import offline

    sent = []

    class Pool:
        vocab_size = 100

        def __init__(self, config, engine_kw) -> None:
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            pass

        def generate(self, prompts, params, priority=None):
            sent.append(params)
            return [None] * len(prompts)

    monkeypatch.setattr(offline, "ReplicaPool", Pool)
    flags = ["--replicas", "2", "--max-loops", "3", "--exit-criterion", "kl", "--num-prompts", "4"]
    args = build_parser().parse_args(["bench", "offline", *flags])
    offline.run_replicas_bench(args, {"model": "/m"})
    assert sent == [_params(args)] * 2  # (the warm-up's and the run's)
    assert (sent[0].max_loops, sent[0].exit_criterion) == (3, "kl")


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (["serve", "--port", "0"], "one engine per replica; for 2 engines: --replicas 2"),
        (["bench", "offline"], "one engine per replica; for 2 engines: --replicas 2"),
        (["generate", "x"], "one engine per LLM (replicas: rltserve.ray.generate)"),
    ],
)
def test_data_parallelism_is_refused_naming_the_commands_way_to_replicas(command, expected):
    from rltserve.cli import build_parser
    from rltserve.engine_args import checked_engine_kwargs

    args = build_parser().parse_args([*command, "--data-parallel-size", "2"])
    with pytest.raises(ValueError) as info:
        checked_engine_kwargs(args)
    assert str(info.value) == f"--data-parallel-size 2: not supported ({expected})"


def test_bench_offline_refuses_replica_resources_without_replicas():
    from rltserve.cli import build_parser

    args = build_parser().parse_args(["bench", "offline", "--replica-gpus", "1"])
    with pytest.raises(ValueError) as info:
        args.func(args)
    assert str(info.value) == "--replica-gpus: only with --replicas N"
