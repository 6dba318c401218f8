"""vLLM's ``vllm.distributed.parallel_state`` clean-up calls, as RL scripts and tests make them
before building the next engine in the same process::

    destroy_model_parallel(); destroy_distributed_environment()
    del llm.llm_engine.model_executor; del llm; gc.collect()

An engine here runs on one device in its own stage, with no process groups: there is nothing to
destroy, so both are no-ops; deleting ``llm.llm_engine.model_executor`` stops the stage (as
``llm.close()``), which frees the device memory it held."""

from __future__ import annotations

__all__ = ["destroy_distributed_environment", "destroy_model_parallel"]


def destroy_model_parallel() -> None:
    """vLLM's: tears down its tensor/pipeline parallel groups; there are none here."""


def destroy_distributed_environment() -> None:
    """vLLM's: tears down ``torch.distributed``; the engine does not start it."""
