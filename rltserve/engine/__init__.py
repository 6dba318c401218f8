"""vLLM's import paths under ``vllm.engine``, so that scripts written for vLLM run with the
package name changed: ``rltserve.engine.arg_utils`` (``EngineArgs``, ``AsyncEngineArgs``) and
``rltserve.engine.async_llm_engine`` (``AsyncLLMEngine``). The classes live in ``llm_args`` and
``async_llm``. ``rltserve.engine.llm_engine.LLMEngine`` refuses when made (no step-wise
engine here)."""
