"""Offline generation split over engine replicas: ``generate`` and ``bench offline --replicas``.

Each replica is a Ray actor holding one ``LLM`` (its stage runs on a thread of the actor's
process). A batch is dealt round-robin (prompt i to replica i mod N, so long and short prompts
spread evenly), every shard goes to its replica whole, and the outputs come back in input order,
as whatever ``LLM.generate`` returns. Actors rather than Ray Data's ``map_batches``: the engine
batches continuously and wants a whole shard in flight at once, not fixed-size blocks; outputs
stay the Python objects ``LLM.generate`` returns instead of passing through Arrow tables; and the
``ray[serve]`` extra needs no pyarrow.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence
from typing import Any

from rltserve.preflight import check_checkpoint_dir
from rltserve.prompt_inputs import normalize_prompts, token_id_prompts
from rltserve.ray.cluster import connect, replica_needs, require_ray
from rltserve.ray.config import ReplicaConfig, resource_kwargs
from rltserve.ray.logs import LogSetup, caller_logging, set_up_logging
from rltserve.sampling import SamplingParams


def replica_engine_kw(engine_kw: dict, index: int) -> dict:
    """Replica ``index``'s engine arguments: its engine seed is ``seed + index`` (None: each
    draws its own), so that unseeded requests on different replicas sample different streams
    (one engine seed would repeat the same samples on every replica)."""
    seed = engine_kw.get("seed", 0)
    return {**engine_kw, "seed": None if seed is None else seed + index}


class _Shard:
    """The actor's body: one LLM for the actor's lifetime."""

    def __init__(self, engine_kw: dict, threads: int, log_setup: LogSetup = None) -> None:
        """``log_setup``: the caller's logging (``rltserve.ray.logs.caller_logging``)."""
        import torch

        from rltserve.llm import LLM

        torch.set_num_threads(threads)
        # A config the engine refuses is kept and handed back by ``vocab_size``: raised here, it
        # would reach the caller as Ray's ActorDiedError with the ValueError buried in its text.
        self.refused: ValueError | None = None
        try:
            set_up_logging(log_setup)  # (a log config that does not load: its ValueError too)
            self.llm = LLM(in_process=True, **engine_kw)
        except ValueError as exc:
            self.refused = exc

    def vocab_size(self) -> int | ValueError:
        """The model's vocabulary size, or the ValueError the engine refused its config with."""
        return self.refused if self.refused is not None else self.llm.info.vocab_size

    def generate(
        self, prompts: list, params: list[SamplingParams] | None, priority: list[int] | None
    ) -> list:
        """``params`` None: the LLM's defaults (``get_default_sampling_params``)."""
        if not prompts:
            return []
        return self.llm.generate(prompts, params, use_tqdm=False, priority=priority)


class ReplicaPool:
    """N ``LLM`` replicas on Ray actors; ``close`` (or ``with``) stops them, and a local cluster
    this pool started."""

    def __init__(
        self, config: ReplicaConfig, engine_kw: dict, startup_timeout_s: float = 600.0
    ) -> None:
        """``startup_timeout_s``: how long the replicas may take to start (placed and loaded):
        a replica the cluster cannot place (resources no node has) is a TimeoutError saying
        what it asks for, not a wait forever. ``config.replica_gpus`` None: as the engine's
        devices need (``ReplicaConfig.for_devices``)."""
        if not config.enabled:
            raise ValueError("replicas: must be an int >= 1")
        devices = (engine_kw.get("device"), engine_kw.get("prefill_device"))
        self.config = config = config.for_devices(devices)
        ray = require_ray("replicas")
        self._owned = connect(config)
        self._actors: list = []
        try:
            log_setup = caller_logging()
            cls = ray.remote(_Shard).options(
                num_cpus=config.replica_cpus, num_gpus=config.replica_gpus
            )
            self._actors = [
                cls.remote(replica_engine_kw(engine_kw, i), config.threads, log_setup)
                for i in range(config.replicas)
            ]
            refs = [a.vocab_size.remote() for a in self._actors]
            try:
                sizes = ray.get(refs, timeout=startup_timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise TimeoutError(
                    f"the replicas did not start within {startup_timeout_s:g} s: "
                    f"{replica_needs(config)}"
                ) from None
            for size in sizes:
                if isinstance(size, ValueError):
                    raise size  # (every replica has the same config: the first says why)
            self.vocab_size = sizes[0]
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> ReplicaPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: Sequence[Any],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list:
        """``LLM.generate``'s outputs, the batch dealt over the replicas; ``priority``: one per
        prompt, as ``LLM.generate``'s."""
        import ray

        prompts, plist = _batch(prompts, params)
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority: {len(priority)} values for {len(prompts)} prompts")
        n = len(self._actors)
        calls = [
            actor.generate.remote(
                prompts[k::n],
                None if plist is None else plist[k::n],
                None if priority is None else list(priority[k::n]),
            )
            for k, actor in enumerate(self._actors)
        ]
        shards = ray.get(calls)  # a failed shard raises its own error (ValueError, ...)
        out: list = [None] * len(prompts)
        for k, shard in enumerate(shards):
            out[k::n] = shard
        for i, output in enumerate(out):  # (each shard numbered its own from 0)
            output.request_id = str(i)
        return out

    def close(self) -> None:
        import ray

        for actor in self._actors:
            ray.kill(actor)
        self._actors = []
        if self._owned:
            self._owned = False
            ray.shutdown()


def generate(
    prompts: Sequence[Any] | None = None,
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    replicas: int,
    prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
    ray_address: str | None = None,
    replica_cpus: float = 1.0,
    replica_gpus: float | None = None,
    startup_timeout_s: float = 600.0,
    priority: Sequence[int] | None = None,
    **engine_kw: Any,
) -> list:
    """``LLM(**engine_kw).generate(prompts, params)`` split over ``replicas`` Ray actors; the
    outputs in input order. Joins the cluster at ``ray_address`` (or the one this process is
    connected to, or ``RAY_ADDRESS``), else starts a local one for the call;
    ``replica_gpus`` None: one per CUDA device the engine runs on (``device``, ``prefill_device``),
    0 on CPU; ``startup_timeout_s``: ``ReplicaPool``'s; ``prompt_token_ids`` and ``priority``: as
    ``LLM.generate``'s (``prompt_token_ids``: older vLLM's keyword). An argument ``LLM`` does not
    take is its TypeError here, before a cluster starts."""
    if prompt_token_ids is not None:
        prompts = token_id_prompts(prompt_token_ids, prompts)
    if prompts is None:
        raise ValueError("prompts: required (or prompt_token_ids)")
    if isinstance(replicas, bool) or not isinstance(replicas, int):
        raise ValueError(f"replicas={replicas!r}: must be an int >= 1")
    config = ReplicaConfig(
        replicas=replicas,
        ray_address=ray_address,
        replica_cpus=replica_cpus,
        replica_gpus=replica_gpus,
    ).for_devices((engine_kw.get("device"), engine_kw.get("prefill_device")))
    # What LLM would refuse at once, refused before a cluster starts (not as a dead actor).
    check_checkpoint_dir(engine_kw.get("model"), "model=")
    check_llm_arguments(engine_kw)
    prompts, plist = _batch(prompts, params)
    if priority is not None and len(priority) != len(prompts):
        raise ValueError(f"priority: {len(priority)} values for {len(prompts)} prompts")
    with ReplicaPool(config, engine_kw, startup_timeout_s) as pool:
        return pool.generate(prompts, plist, priority)


def check_llm_arguments(engine_kw: dict) -> None:
    """The TypeError (or ValueError) ``LLM(**engine_kw)`` raises for an argument it does not take
    or a vLLM argument at a value it refuses, raised here rather than as an actor's death."""
    from rltserve.llm import LLM
    from rltserve.vllm_args import check_inert

    named = inspect.signature(LLM.__init__).parameters
    check_inert({k: v for k, v in engine_kw.items() if k not in named})


def _batch(
    prompts: Sequence[Any], params: SamplingParams | Sequence[SamplingParams] | None
) -> tuple[list, list[SamplingParams] | None]:
    """The prompts as a list and one SamplingParams per prompt (ValueError when a list of
    params does not match them); None for None (each replica's defaults, as ``LLM``'s)."""
    prompts = normalize_prompts(prompts)  # (as LLM.generate takes them: one dict is one prompt)
    if params is None:
        return prompts, None
    plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    if len(plist) != len(prompts):
        raise ValueError(f"params: {len(plist)} given for {len(prompts)} prompts")
    return prompts, plist


def bench_replica_config(args) -> ReplicaConfig:
    """``bench offline``'s replica flags (``--replicas``, ``--ray-address``, ``--replica-cpus``,
    ``--replica-gpus``) as a ``ReplicaConfig`` (ValueError naming a bad one, or one given
    without ``--replicas``)."""
    return ReplicaConfig(
        replicas=args.replicas, ray_address=args.ray_address, **resource_kwargs(args)
    )


def run_replicas_bench(args, engine_kw: dict) -> dict[str, Any]:
    """``bench offline --replicas N``: the offline workload split over N replicas."""
    from rltserve.bench.offline import _params, _workload

    engine_kw = {**engine_kw, "max_num_seqs": args.concurrency}
    devices = (engine_kw.get("device"), engine_kw.get("prefill_device"))
    config = bench_replica_config(args).for_devices(devices)  # (reported as placed)
    started = time.perf_counter()
    with ReplicaPool(config, engine_kw) as pool:
        ready = time.perf_counter() - started
        prompts = _workload(args.num_prompts, args.input_len, pool.vocab_size)
        params = _params(args)  # (the single engine's: depth, exit rule and criterion)
        pool.generate(prompts[: config.replicas], params)  # warm-up: one prompt per replica
        t0 = time.perf_counter()
        outputs = pool.generate(prompts, params)
        elapsed = time.perf_counter() - t0
    tokens = args.num_prompts * args.output_len  # ignore_eos: every request runs to max_tokens
    return {
        "model": engine_kw.get("model"),
        "replicas": config.replicas,
        "replica_cpus": config.replica_cpus,
        "replica_gpus": config.replica_gpus,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "outputs": len(outputs),
        "startup_s": round(ready, 2),
        "elapsed_s": round(elapsed, 3),
        "output_tok_per_s": round(tokens / elapsed, 1),
    }
