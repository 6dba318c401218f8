"""vLLM's ``vllm.v1`` import paths of the names its example scripts take from there, so that
they run with the package name changed: ``rltserve.v1.engine.async_llm`` (``AsyncLLM``) and
``rltserve.v1.metrics.reader`` (``get_metrics``' classes). The names live in ``async_llm`` and
``metrics_reader``."""
