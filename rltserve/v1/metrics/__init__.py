"""vLLM's ``vllm.v1.metrics``: see ``rltserve.v1``."""
