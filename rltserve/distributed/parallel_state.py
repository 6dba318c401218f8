"""vLLM's ``vllm.distributed.parallel_state`` clean-up calls, as RL scripts and tests make them
before building the next engine in the same process::

    destroy_model_parallel(); destroy_distributed_environment()
    del llm.llm_engine.model_executor; del llm; gc.collect()

or in one call, as vLLM's examples do: ``del llm; cleanup_dist_env_and_memory()``.

An engine here runs on one device in its own stage, with no process groups: there is nothing to
destroy, so both are no-ops; deleting ``llm.llm_engine.model_executor`` stops the stage (as
``llm.close()``), which frees the device memory it held."""

from __future__ import annotations

import gc
import sys

__all__ = [
    "cleanup_dist_env_and_memory",
    "destroy_distributed_environment",
    "destroy_model_parallel",
]


def destroy_model_parallel() -> None:
    """vLLM's: tears down its tensor/pipeline parallel groups; there are none here."""


def destroy_distributed_environment() -> None:
    """vLLM's: tears down ``torch.distributed``; the engine does not start it."""


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """vLLM's clean-up after ``del llm``: an engine caught in a reference cycle is collected (its
    finalizer stops the stage, freeing what it held on the device), then the CUDA caching
    allocator's free blocks go back to the driver, as vLLM's; ``shutdown_ray`` stops a Ray
    this process started."""
    destroy_model_parallel()
    destroy_distributed_environment()
    if shutdown_ray and "ray" in sys.modules:
        ray = sys.modules["ray"]
        if ray.is_initialized():
            ray.shutdown()
    gc.collect()
    # Only a process that has used CUDA holds cached blocks (an in-process engine): asking a
    # process that has not would start a CUDA context in it.
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
