"""vLLM's import path ``vllm.distributed``, for ``parallel_state``'s clean-up calls that scripts
make before building a second engine in the same process. vLLM's package holds
``parallel_state``'s names too, so ``from rltserve.distributed import destroy_model_parallel``
works as ``from vllm.distributed import ...`` does."""

from rltserve.distributed.parallel_state import (
    destroy_distributed_environment,
    destroy_model_parallel,
)

__all__ = ["destroy_distributed_environment", "destroy_model_parallel"]
