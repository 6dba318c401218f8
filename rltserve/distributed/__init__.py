"""vLLM's import path ``vllm.distributed``, for ``parallel_state``'s clean-up calls that scripts
make before building a second engine in the same process. vLLM's package holds those names too
(``cleanup_dist_env_and_memory``, ``destroy_model_parallel``, ...), so ``from
rltserve.distributed import ...`` works as ``from vllm.distributed import ...`` does."""

from rltserve.distributed.parallel_state import (
    cleanup_dist_env_and_memory,
    destroy_distributed_environment,
    destroy_model_parallel,
)

__all__ = [
    "cleanup_dist_env_and_memory",
    "destroy_distributed_environment",
    "destroy_model_parallel",
]
