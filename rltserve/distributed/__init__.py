"""vLLM's import path ``vllm.distributed``, for ``parallel_state``'s clean-up calls that scripts
make before building a second engine in the same process."""
