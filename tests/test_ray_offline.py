"""``rltserve.ray.offline`` without a cluster: how a batch is split into prompts and params, the
pool's refusal of a disabled config, and ``bench offline --replicas``'s report (a fake pool
stands for the Ray actors)."""

from __future__ import annotations

import argparse
import types

import pytest

from rltserve.ray import offline
from rltserve.ray.config import ReplicaConfig
from rltserve.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=2)


def test_a_single_text_is_one_prompt():
    assert offline._batch("hello there", None) == (["hello there"], None)
    assert offline._batch(("a", [5, 6]), GREEDY) == (["a", [5, 6]], [GREEDY, GREEDY])


def test_prompts_are_taken_as_llm_generate_takes_them():
    one = {"prompt_token_ids": [9, 10, 11]}
    assert offline._batch(one, GREEDY) == ([one], [GREEDY])  # (not its keys)
    with pytest.raises(ValueError, match="not one flat list of ids"):
        offline._batch([5, 6, 7], None)


def test_one_params_list_per_prompt():
    other = SamplingParams(temperature=0.5, max_tokens=3)
    assert offline._batch([[1], [2]], [GREEDY, other]) == ([[1], [2]], [GREEDY, other])
    with pytest.raises(ValueError, match="params: 1 given for 2 prompts"):
        offline._batch([[1], [2]], [GREEDY])


def test_a_pool_needs_replicas():
    with pytest.raises(ValueError, match="replicas: must be an int >= 1"):
        offline.ReplicaPool(ReplicaConfig(), {})


class FakePool:
    """A ReplicaPool whose replicas answer at once with their prompts."""

    made: list[FakePool] = []

    def __init__(self, config: ReplicaConfig, engine_kw: dict) -> None:
        self.config, self.engine_kw, self.vocab_size = config, engine_kw, 50
        self.calls: list[tuple[list, SamplingParams]] = []
        FakePool.made.append(self)

    def __enter__(self) -> FakePool:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def generate(self, prompts, params, priority=None):
        self.calls.append((prompts, params))
        return list(prompts)


def test_the_replicas_bench_reports_its_workload(monkeypatch):
    monkeypatch.setattr(offline, "ReplicaPool", FakePool)
    args = argparse.Namespace(
        replicas=2,
        ray_address=None,
        concurrency=8,
        num_prompts=6,
        input_len=4,
        output_len=3,
        exit_threshold=0.5,
        max_loops=None,  # (as the parser leaves them unset)
        exit_criterion=None,
    )
    clock = iter([10.0, 11.5, 12.0, 15.0])  # start, pool ready, timed run's start and end
    monkeypatch.setattr(offline, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    monkeypatch.setattr(FakePool, "made", [])
    report = offline.run_replicas_bench(args, {"model": "/m"})
    (pool,) = FakePool.made
    assert pool.config.replicas == 2
    assert pool.engine_kw == {"model": "/m", "max_num_seqs": 8}
    warmup, timed = pool.calls
    assert len(warmup[0]) == 2 and len(timed[0]) == 6  # one warm-up prompt per replica
    assert all(len(p) == 4 and max(p) < 50 for p in timed[0])
    params = timed[1]
    assert (params.temperature, params.max_tokens, params.ignore_eos) == (0.0, 3, True)
    assert params.exit_threshold == 0.5
    assert report == {
        "model": "/m",
        "replicas": 2,
        "replica_cpus": 1.0,
        "replica_gpus": 0.0,  # (a CPU engine: none)
        "num_prompts": 6,
        "input_len": 4,
        "output_len": 3,
        "outputs": 6,
        "startup_s": 1.5,
        "elapsed_s": 3.0,
        "output_tok_per_s": 6.0,  # ignore_eos: 6 prompts x 3 tokens in 3 s
    }


@pytest.mark.parametrize("owned", [False, True])
def test_closing_a_pool_stops_only_a_cluster_it_started(monkeypatch, owned):
    ray = pytest.importorskip("ray")
    stops: list[bool] = []
    monkeypatch.setattr(ray, "shutdown", lambda: stops.append(True))
    pool = object.__new__(offline.ReplicaPool)  # no actors: only what close does
    pool._actors, pool._owned = [], owned
    pool.close()
    pool.close()  # (idempotent: `with` and an explicit close)
    assert stops == ([True] if owned else [])


def test_a_pool_places_replicas_with_their_resources_and_stops_them_when_one_fails(monkeypatch):
    pytest.importorskip("ray.serve")  # (imported before ray.remote is replaced: it uses it)
    import ray

    monkeypatch.setattr(offline, "connect", lambda config: True)  # it started the cluster
    placed, killed, stops = [], [], []

    class Actors:
        def options(self, **resources) -> Actors:
            placed.append(resources)
            return self

        def remote(self, engine_kw: dict, threads: int, log_setup=None) -> object:
            ref = types.SimpleNamespace(remote=lambda: "vocab-ref")
            return types.SimpleNamespace(vocab_size=ref, threads=threads, seed=engine_kw["seed"])

    def get(refs, timeout=None):
        raise RuntimeError("the actor died")

    monkeypatch.setattr(ray, "remote", lambda cls: Actors())
    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "kill", killed.append)
    monkeypatch.setattr(ray, "shutdown", lambda: stops.append(True))
    config = ReplicaConfig(replicas=2, replica_cpus=2.0, replica_gpus=0.5)
    with pytest.raises(RuntimeError, match="the actor died"):
        offline.ReplicaPool(config, {"model": "/m"})
    assert placed == [{"num_cpus": 2.0, "num_gpus": 0.5}]
    assert [actor.threads for actor in killed] == [2, 2]  # both started, both stopped
    assert [actor.seed for actor in killed] == [0, 1]  # (unseeded requests differ by replica)
    assert stops == [True]


def test_each_replica_has_an_engine_seed_of_its_own():
    """One engine seed on every replica would draw the same samples for the k-th unseeded
    request on each: offline replica i takes seed + i (None: each its own), a Serve replica
    the seed mixed with its id."""
    from rltserve.config import EngineConfig
    from rltserve.ray.replica import replica_config

    assert [offline.replica_engine_kw({"model": "/m"}, i)["seed"] for i in range(3)] == [0, 1, 2]
    assert offline.replica_engine_kw({"seed": 7}, 2) == {"seed": 9}
    assert offline.replica_engine_kw({"seed": None}, 2) == {"seed": None}
    config = EngineConfig.from_flat(model="/m", seed=5)
    seeds = {replica_config(config, rid).model.seed for rid in ("7hsxm4wn", "a1b2c3d4", "x")}
    assert len(seeds) == 3 and all(seed >= 5 for seed in seeds)
    assert replica_config(config, "x") == replica_config(config, "x")  # (the id decides)
    assert replica_config(config, "x").model.model == "/m"


def test_replicas_the_cluster_cannot_place_time_out_saying_what_they_ask(monkeypatch):
    pytest.importorskip("ray.serve")  # (imported before ray.remote is replaced: it uses it)
    import ray

    monkeypatch.setattr(offline, "connect", lambda config: False)
    killed = []

    class Actors:
        def options(self, **resources) -> Actors:
            return self

        def remote(self, engine_kw: dict, threads: int, log_setup=None) -> object:
            return types.SimpleNamespace(vocab_size=types.SimpleNamespace(remote=lambda: "ref"))

    def get(refs, timeout=None):
        assert timeout == 5.0
        raise ray.exceptions.GetTimeoutError("pending")

    monkeypatch.setattr(ray, "remote", lambda cls: Actors())
    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "kill", killed.append)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 1.0, "memory": 5.0})
    config = ReplicaConfig(replicas=2, replica_cpus=0.7, replica_gpus=1.0)
    with pytest.raises(TimeoutError) as err:
        offline.ReplicaPool(config, {"model": "/m"}, startup_timeout_s=5.0)
    assert str(err.value) == (
        "the replicas did not start within 5 s: 2 replica(s) of 0.7 CPU and 1 GPU each, on a "
        "cluster of {'CPU': 1.0}"
    )
    assert len(killed) == 2  # (stopped, not left pending)


def test_pool_outputs_are_numbered_in_input_order(monkeypatch):
    pytest.importorskip("ray.serve")
    import ray

    from rltserve.outputs import RequestOutput

    dealt = []

    def shard(prompts, params, priority):
        dealt.append(priority)
        return [RequestOutput("0" if i == 0 else str(i), p, [1], []) for i, p in enumerate(prompts)]

    pool = object.__new__(offline.ReplicaPool)
    pool._actors = [
        types.SimpleNamespace(generate=types.SimpleNamespace(remote=shard)) for _ in range(2)
    ]
    monkeypatch.setattr(ray, "get", lambda calls: calls)
    outs = pool.generate(["a", "b", "c"], GREEDY)
    assert [(o.request_id, o.prompt) for o in outs] == [("0", "a"), ("1", "b"), ("2", "c")]
    pool.generate(["a", "b", "c"], GREEDY, priority=[3, 4, 5])  # (dealt as the prompts)
    assert dealt == [None, None, [3, 5], [4]]
    with pytest.raises(ValueError, match="^priority: 2 values for 3 prompts$"):
        pool.generate(["a", "b", "c"], GREEDY, priority=[1, 2])


def test_what_llm_would_refuse_is_refused_before_a_cluster_starts(monkeypatch, ouro_rv1):
    """Not as a dead actor's error, after the replicas started."""
    monkeypatch.setattr(offline, "ReplicaPool", None)  # (never reached)
    with pytest.raises(TypeError, match="foo"):
        offline.generate(["a"], GREEDY, replicas=2, model=str(ouro_rv1), foo=1)
    with pytest.raises(ValueError, match="enable_prompt_embeds"):
        offline.generate(["a"], GREEDY, replicas=2, model=str(ouro_rv1), enable_prompt_embeds=True)
    with pytest.raises(ValueError, match="^priority: 1 values for 2 prompts$"):
        offline.generate(["a", "b"], GREEDY, replicas=2, model=str(ouro_rv1), priority=[0])


def test_a_config_the_engine_refuses_is_its_value_error_and_the_replicas_stop(monkeypatch):
    pytest.importorskip("ray.serve")  # (imported before ray.remote is replaced: it uses it)
    import ray

    monkeypatch.setattr(offline, "connect", lambda config: False)
    killed = []
    refused = ValueError("max_model_len=9: too long")

    class Actors:
        def options(self, **resources) -> Actors:
            return self

        def remote(self, engine_kw: dict, threads: int, log_setup=None) -> object:
            return types.SimpleNamespace(vocab_size=types.SimpleNamespace(remote=lambda: "ref"))

    monkeypatch.setattr(ray, "remote", lambda cls: Actors())
    monkeypatch.setattr(ray, "get", lambda refs, timeout=None: [refused, refused])
    monkeypatch.setattr(ray, "kill", killed.append)
    with pytest.raises(ValueError) as err:
        offline.ReplicaPool(ReplicaConfig(replicas=2), {"model": "/m"})
    assert err.value is refused
    assert len(killed) == 2


def test_a_shard_keeps_the_refusal_of_its_engine_for_the_pool(monkeypatch, ouro_rv1):
    import torch

    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # (this process's, kept)
    shard = offline._Shard({"model": str(ouro_rv1), "max_model_len": 10**6}, threads=1)
    refused = shard.vocab_size()
    assert isinstance(refused, ValueError) and "max_model_len=1000000" in str(refused)


def test_the_replicas_bench_places_replicas_as_its_flags_and_device_say(monkeypatch):
    """``bench offline --replicas``: ``--replica-cpus``/``--replica-gpus`` (ReplicaConfig's) reach
    the pool; without ``--replica-gpus`` a CUDA engine's replicas get one GPU each."""
    from rltserve.cli import build_parser

    monkeypatch.setattr(offline, "ReplicaPool", FakePool)
    monkeypatch.setattr(FakePool, "made", [])
    for flags, device, expected in [
        (["--replica-cpus", "2", "--replica-gpus", "0.5"], "cuda", (2.0, 0.5)),
        ([], "cuda", (1.0, 1.0)),
        ([], "cpu", (1.0, 0.0)),
    ]:
        argv = ["bench", "offline", "--replicas", "2", "--num-prompts", "2", *flags]
        report = offline.run_replicas_bench(build_parser().parse_args(argv), {"device": device})
        config = FakePool.made[-1].config
        assert (config.replica_cpus, config.replica_gpus) == expected
        assert (report["replica_cpus"], report["replica_gpus"]) == expected


def test_offline_generate_asks_a_gpu_per_replica_of_a_cuda_engine(monkeypatch):
    configs = []

    class Pool(FakePool):
        def __init__(self, config, engine_kw, startup_timeout_s) -> None:
            configs.append(config)
            super().__init__(config, engine_kw)

    monkeypatch.setattr(offline, "ReplicaPool", Pool)
    monkeypatch.setattr(offline, "check_checkpoint_dir", lambda *a: None)
    offline.generate([[1]], replicas=2, model="/m", device="cuda")
    offline.generate([[1]], replicas=2, model="/m")  # (LLM's default device: cpu)
    offline.generate([[1]], replicas=2, model="/m", device="cuda:0", replica_gpus=0.25)
    assert [c.replica_gpus for c in configs] == [1.0, 0.0, 0.25]
    with pytest.raises(ValueError, match="--replica-gpus 0: the engine runs on CUDA"):
        offline.generate([[1]], replicas=2, model="/m", device="cuda", replica_gpus=0)
    assert len(configs) == 3  # (refused before a cluster starts)
