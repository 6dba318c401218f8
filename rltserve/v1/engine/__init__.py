"""vLLM's ``vllm.v1.engine``: see ``rltserve.v1``."""
