"""LLM: the offline Python API over a stage worker, shaped as vLLM's offline ``LLM``.

from rltserve import LLM, SamplingParams
with LLM("path/to/checkpoint") as llm:
    out = llm.generate(["Hello"], SamplingParams(max_tokens=32))
    print(out[0].outputs[0].text)
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import secrets
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tqdm import tqdm

from rltserve.caller_values import at_prompt, outside_vocab, plain_number
from rltserve.config import EngineConfig
from rltserve.core.pd import stage_client
from rltserve.core.request_checks import check_priority
from rltserve.core.stage import InProcessStageClient, StageClient
from rltserve.generation_config import generation_config_defaults
from rltserve.guide_index import GuideCompiler, after_open_span
from rltserve.llm_batch import PendingBatch
from rltserve.llm_chat import ChatRendering
from rltserve.llm_controls import TrainerControls, seconds
from rltserve.llm_metrics import RequestCounts
from rltserve.llm_refusals import Refusals
from rltserve.models.tokenizer import load_tokenizer
from rltserve.outputs import OutputAssembler, RequestOutput, reported_stop_ids, request_output
from rltserve.preflight import (
    check_checkpoint_dir,
    check_device,
    resolve_dtype,
    resolve_model,
    resolve_tokenizer,
)
from rltserve.progress import in_notebook, progress_enabled
from rltserve.prompt_inputs import (
    PromptInput,
    encode_prompt,
    normalize_prompts,
    prompt_cache_salt,
    prompt_text,
    token_id_prompts,
)
from rltserve.prompt_truncation import truncated_prompt
from rltserve.samples import expand_samples, sample_ids
from rltserve.sampling import SamplingParams
from rltserve.thinking import bound_thinking, resolve_thinking, think_tag_ids
from rltserve.vllm_args import (
    check_inert,
    check_parallel,
    check_utilization,
    generation_config_folder,
    generation_overrides,
    pool_kv_cache_gb,
)


class LLM(TrainerControls, ChatRendering, Refusals):
    """Offline generation. The model runs in a stage worker process (``in_process=True`` runs it
    on a thread of this process instead). Close it with ``close()`` or use it as a context
    manager; works the same in a script, on stdin or in a notebook (no ``__main__`` guard)."""

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        kv_policy: str = "last_exited",
        scheduling: str = "refill",
        exit_mode: str = "gate",
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        prefill_chunk_size: int = 512,
        carry_decode: bool = True,
        async_scheduling: bool = False,
        wavefront_prefill: bool = False,
        speculative_tokens: int = 0,
        draft_loops: int | None = None,
        num_blocks: int | None = None,
        block_size: int = 16,
        seed: int | None = 0,
        max_model_len: int | None = None,
        kv_cache_gb: float | None = None,
        cuda_graphs: bool = False,
        cuda_graph_max_rows: int = 256,
        cuda_graph_max_context: int = 4096,
        attention_pad_budget: int = 0,
        kv_reservation: str = "ondemand",
        kv_watermark: float = 0.01,
        swap_space_gb: float = 4.0,
        enable_prefix_caching: bool | None = None,
        preemption_mode: str = "recompute",
        preemption_time_slice: int = 0,
        scheduling_policy: str = "fcfs",
        logprobs_mode: str = "raw_logprobs",
        max_logprobs: int = 20,
        disaggregate: bool = False,
        prefill_device: str | None = None,
        kv_transfer_gb: float | None = None,
        in_process: bool = False,
        startup_timeout: float = 300.0,
        skip_tokenizer_init: bool = False,
        tokenizer: str | None = None,
        trust_remote_code: bool = False,
        tensor_parallel_size: int = 1,
        enforce_eager: bool = False,
        gpu_memory_utilization: float | None = None,
        revision: str | None = None,
        download_dir: str | os.PathLike | None = None,
        generation_config: str = "auto",
        override_generation_config: Mapping[str, Any] | None = None,
        swap_space: float | None = None,
        **vllm_options: Any,
    ) -> None:
        """``kv_cache_gb``: the KV pool's size when ``num_blocks`` is not given (default 1,
        or on CUDA what ``gpu_memory_utilization`` leaves). ``seed``: the engine's seed for
        requests without one (None: a fresh random one). ``tokenizer``,
        ``trust_remote_code``, ``tensor_parallel_size``, ``enforce_eager``,
        ``gpu_memory_utilization``, ``revision``, ``download_dir``, ``swap_space`` (GiB:
        ``swap_space_gb``),
        ``generation_config`` and ``override_generation_config``
        (``get_default_sampling_params``) and the ``vllm_options`` RL frameworks pass
        (``enable_sleep_mode``, ``model_impl``, ...) are vLLM's (``vllm_args``)."""
        del trust_remote_code  # (rltserve never runs a checkpoint's code)
        startup_timeout = seconds("startup_timeout", startup_timeout)
        check_inert(vllm_options)
        if swap_space is not None:
            swap_space_gb = swap_space
        if seed is None:
            seed = secrets.randbits(63)
        check_parallel(tensor_parallel_size)
        if gpu_memory_utilization is not None:
            check_utilization(gpu_memory_utilization)
        from rltserve.models.demo import model_or_demo

        if download_dir is not None and not isinstance(download_dir, (str, os.PathLike)):
            raise ValueError(f"download_dir={download_dir!r}: must be None or a path")
        given = str(model_or_demo(model))
        # vLLM's model_config.model is the argument as given: a repo id stays one.
        self._model_name = given
        self._download_dir = download_dir
        model = resolve_model(given, revision, download_dir)
        if tokenizer is not None:
            # (vLLM's tokenizer_revision defaults to the model's revision: same repo only here)
            at = revision if str(tokenizer) == given else None
            tokenizer = resolve_tokenizer(str(tokenizer), at, download_dir)
        dtype = resolve_dtype(dtype, model)
        self._generation_config = generation_config_folder(generation_config, model)
        self._generation_overrides = generation_overrides(override_generation_config)
        self.config = EngineConfig.from_flat(
            model=model,
            tokenizer=tokenizer,
            dtype=dtype,
            device=device,
            kv_policy=kv_policy,
            scheduling=scheduling,
            exit_mode=exit_mode,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            prefill_chunk_size=min(prefill_chunk_size, max_num_batched_tokens),
            carry_decode=carry_decode,
            async_scheduling=async_scheduling,
            wavefront_prefill=wavefront_prefill,
            speculative_tokens=speculative_tokens,
            draft_loops=draft_loops,
            num_blocks=num_blocks,
            block_size=block_size,
            seed=seed,
            max_model_len=max_model_len,
            kv_cache_gb=1.0 if kv_cache_gb is None else kv_cache_gb,
            gpu_memory_utilization=gpu_memory_utilization,
            cuda_graphs=cuda_graphs and not enforce_eager,
            cuda_graph_max_rows=cuda_graph_max_rows,
            cuda_graph_max_context=cuda_graph_max_context,
            attention_pad_budget=attention_pad_budget,
            kv_reservation=kv_reservation,
            kv_watermark=kv_watermark,
            swap_space_gb=swap_space_gb,
            enable_prefix_caching=enable_prefix_caching,
            preemption_mode=preemption_mode,
            preemption_time_slice=preemption_time_slice,
            scheduling_policy=scheduling_policy,
            logprobs_mode=logprobs_mode,
            max_logprobs=max_logprobs,
            disaggregate=disaggregate,
            prefill_device=prefill_device,
            kv_transfer_gb=kv_transfer_gb,
        )
        # Usage errors as ValueErrors here, not as a stage that failed to start.
        check_checkpoint_dir(model, "model=")
        check_device(self.config.model.device, "device=")
        if prefill_device is not None:
            check_device(prefill_device, "prefill_device=")
        gb = pool_kv_cache_gb(self.config, kv_cache_gb)
        if gb != self.config.cache.kv_cache_gb:  # (CUDA's gpu_memory_utilization)
            cache = dataclasses.replace(self.config.cache, kv_cache_gb=gb)
            self.config = dataclasses.replace(self.config, cache=cache)
        client_cls = InProcessStageClient if in_process else StageClient
        # The stage starts first: its imports and model load overlap the tokenizer's load here.
        self._client = stage_client(self.config, client_cls)
        try:
            self.tokenizer = None if skip_tokenizer_init else load_tokenizer(tokenizer or model)
            self._guides = GuideCompiler(self.tokenizer)  # (structured outputs' constraints)
            self.info = self._client.wait_ready(startup_timeout)
        except BaseException:  # Ctrl-C while loading too: the worker must not outlive this
            self._client.close(timeout=2.0)
            raise
        self._ids = itertools.count()
        self._request_counts = RequestCounts(self.info.max_loops)  # (get_metrics' series)
        self._running = threading.Condition()  # guards _paused and _active
        self._paused = False
        self._active = 0  # generate calls in progress

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, timeout: float = 10.0) -> None:
        """Stops the stage; requests still open in other threads end as aborted. A worker that
        does not stop within ``timeout`` seconds is killed. An LLM that is never closed stops its
        stage when it is garbage-collected or when the interpreter exits."""
        timeout = seconds("timeout", timeout)
        self._closed = True
        self._client.close(timeout)

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request: None = None,
        priority: Sequence[int] | None = None,
        *,
        prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt; returns one ``RequestOutput`` per prompt, in input order,
        each with ``params.n`` samples. A prompt is a string (needs a tokenizer), a list of token
        ids, ``{"prompt": text}`` or ``{"prompt_token_ids": ids}`` (ids may be one prompt's
        tokenizer encoding, a mapping with ``input_ids``: ``check_ids``). Every prompt is
        checked before any is submitted; if a request fails or is rejected, or the call is
        interrupted, the requests still running are aborted before the error propagates. While
        generation is paused (``pause_generation``) the call waits for ``resume_generation``.
        ``use_tqdm`` (vLLM's): a bar of the prompts done, on stderr when it is a terminal or in
        a Jupyter notebook (True), never (False), or always, made by the tqdm class given (a
        callable, such as ``tqdm.auto.tqdm``). ``priority``: one per prompt (vLLM's; it
        replaces the params' ``priority``); ``lora_request`` must be None. ``prompt_token_ids``
        (older vLLM's keyword, which RL code still passes): the prompts as token ids (one list,
        or a list of them), with ``prompts`` their texts or None."""
        if lora_request is not None:
            raise ValueError("lora_request: LoRA adapters are not supported")
        if prompt_token_ids is not None:
            prompts = token_id_prompts(prompt_token_ids, prompts)
        if prompts is None:
            raise ValueError("prompts: required (or prompt_token_ids)")
        return self._generate(normalize_prompts(prompts), sampling_params, use_tqdm, priority)

    def _generate(
        self,
        batch: list,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool | Callable[..., tqdm],
        priority: Sequence[int] | None = None,
        thinking: Sequence[bool | None] | None = None,
    ) -> list[RequestOutput]:
        """``generate`` on normalized prompts. ``thinking``: per prompt, whether it leaves a
        thinking span open where its chat rendering decided it (``ChatPrompt.thinking``);
        None: judged from its ids (``bound_thinking``)."""
        encoded, plist = self._prepare(batch, sampling_params, priority, thinking)
        if not (isinstance(use_tqdm, bool) or callable(use_tqdm)):
            raise ValueError(f"use_tqdm={use_tqdm!r}: must be a bool or a tqdm class")
        with self._running:
            self._running.wait_for(lambda: not self._paused)
            self._active += 1
        try:
            with self._stage():
                return self._run(batch, encoded, plist, use_tqdm)
        finally:
            with self._running:
                self._active -= 1
                self._running.notify_all()

    def _prepare(
        self,
        batch: list,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        priority: Sequence[int] | None = None,
        thinking: Sequence[bool | None] | None = None,
    ) -> tuple[list[list[int]], list[SamplingParams]]:
        """Checks normalized prompts and their params as the engine would, before anything is
        submitted; returns each prompt's token ids and its validated copy of the params
        (``generate``'s and ``AsyncLLM.generate``'s shared front half; ``_generate`` says
        what ``thinking`` is)."""
        params = sampling_params
        if params is None:
            params = self.get_default_sampling_params()
        if not isinstance(params, (SamplingParams, Sequence)):
            raise ValueError("sampling_params: must be SamplingParams or a list of them")
        plist = [params] * len(batch) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(batch):
            raise ValueError(f"sampling_params: {len(plist)} given for {len(batch)} prompts")
        if not all(isinstance(p, SamplingParams) for p in plist):
            raise ValueError("sampling_params: must be SamplingParams or a list of them")
        # Validated copies, one per object given: the caller may change its params later.
        # Structured outputs are compiled for the tokenizer here, once per object given.
        unique = {id(p): p for p in plist}.values()
        clones = {id(p): self._guides.bind(p.clone()) for p in unique}
        plist = [clones[id(p)] for p in plist]
        if priority is not None:
            if isinstance(priority, (str, bytes)) or len(priority) != len(batch):
                raise ValueError(f"priority: must be a list of one int per prompt ({len(batch)})")
            plist = [p.replace(priority=plain_number(pr)) for p, pr in zip(plist, priority)]
        for p in plist:  # (before any prompt runs, as vLLM refuses it)
            check_priority(p.priority, self.config.scheduler.scheduling_policy)
        salts = [prompt_cache_salt(prompt) for prompt in batch]  # (vLLM's key of a prompt dict)
        plist = [p if s is None else p.replace(cache_salt=s) for p, s in zip(plist, salts)]
        vocab = self.info.vocab_size
        context = self.info.max_model_len
        encoded = []
        for index, (prompt, p) in enumerate(zip(batch, plist)):
            try:
                ids = encode_prompt(prompt, self.tokenizer, vocab)
                encoded.append(truncated_prompt(ids, p.truncate_prompt_tokens, context))
            except ValueError as exc:
                raise ValueError(f"{exc}{at_prompt(index, len(batch))}") from None
        spans = [None] * len(batch) if thinking is None else thinking
        think_end = think_tag_ids(self.tokenizer)[1]
        plist = [
            after_open_span(
                bound_thinking(self._resolve_thinking(p), ids, self.tokenizer, span),
                span,
                think_end,
            )
            for p, ids, span in zip(plist, encoded, spans)
        ]
        return encoded, plist

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the ``SamplingParams`` ``generate`` and ``chat`` use when given none: the
        sampling defaults of the checkpoint's ``generation_config.json`` (temperature, top_p,
        top_k, min_p, repetition_penalty, max_new_tokens as max_tokens) over vLLM's; plain
        ``SamplingParams()`` with ``generation_config="vllm"`` or without the file; either
        with ``override_generation_config`` laid over it (as vLLM's). A new object on every
        call (the caller may change it)."""
        found = generation_config_defaults(self._generation_config)
        found.update(self._generation_overrides)
        return SamplingParams(**{k: v for k, v in found.items() if v is not None})

    def get_tokenizer(self):
        """The checkpoint's tokenizer as vLLM's ``LLM.get_tokenizer`` gives it: a Hugging Face
        tokenizer (``__call__``, ``batch_decode``, ``apply_chat_template`` with its defaults),
        loaded on the first call; None without one. The engine encodes with ``self.tokenizer``
        (rltserve's reading of the same files: the same ids, without importing
        transformers)."""
        return None if self.tokenizer is None else self.tokenizer.hf()

    def _run(self, batch, encoded, plist, use_tqdm) -> list[RequestOutput]:
        bar = None
        if use_tqdm is not False and (use_tqdm is not True or progress_enabled() or in_notebook()):
            make = tqdm if use_tqdm is True else use_tqdm
            bar = make(total=len(batch), desc="Processed prompts", dynamic_ncols=True)
        pending = PendingBatch(bar)
        groups: list[list[OutputAssembler]] = []
        prompt_ids: list[str] = []
        try:
            for index, (ids, p) in enumerate(zip(encoded, plist)):
                group = []
                prompt_id = str(next(self._ids))  # (vLLM's: a number)
                rids, key = sample_ids(prompt_id, p.n)
                prompt_ids.append(prompt_id)
                for rid, sample in zip(rids, expand_samples(p)):
                    asm = self._assembler(rid, ids, p)
                    group.append(asm)
                    pending.add(asm, index)
                    sink = pending.sink(asm, self._client.abort)
                    self._client.add_request(rid, ids, sample, sink, key)
                groups.append(group)
            pending.wait()
        finally:
            for rid in pending.unfinished():
                self._client.abort(rid)
            if bar is not None:
                bar.close()
        for asm in pending.assemblers:
            if asm.rejected:
                index, error = pending.prompt_index(asm), asm.output.error
                # (An error of the request's settings names no prompt: at index 0 only the
                # engine's prompt checks, "prompt: ...", are known to be the prompt's; not
                # "prompt_logprobs=...", a setting.)
                named = index > 0 or error.startswith("prompt:")
                raise ValueError(f"{error}{at_prompt(index, len(batch)) if named else ''}")
            if asm.output.finish_reason == "error":
                raise RuntimeError(f"request {asm.output.request_id} failed: {asm.output.error}")
        # detokenize=False: no text work at all, decoded logprob tokens included (vLLM's).
        return [
            request_output(
                group, prompt_text(prompt), self.tokenizer if p.detokenize else None, rid
            )
            for prompt, group, rid, p in zip(batch, groups, prompt_ids, plist)
        ]

    # ---------------------------------------------------------------- internals

    def _assembler(self, request_id: str, ids: list[int], p: SamplingParams) -> OutputAssembler:
        """The assembler of one sample of a prompt with token ids ``ids`` and params ``p``."""
        tokenizer = self.tokenizer if p.detokenize else None
        return OutputAssembler(
            request_id,
            ids,
            tokenizer,
            p.stop if tokenizer is not None else None,
            p.logprobs is not None,
            reported_stop_ids(
                p, self.info.stop_reason_ids, getattr(tokenizer, "eos_token_id", None)
            ),
            skip_special_tokens=p.skip_special_tokens,
            include_stop_str_in_output=p.include_stop_str_in_output,
            min_tokens=p.min_tokens,
            observer=self._request_counts.request(len(ids)),
        )

    def _resolve_thinking(self, p: SamplingParams) -> SamplingParams:
        """Checks what needs text and the token ids the params name (the engine's own checks,
        made before anything is submitted), and puts bounded thinking in token ids, as the
        engine takes it (see ``SamplingParams``)."""
        if p.stop and (self.tokenizer is None or not p.detokenize):
            raise ValueError(
                f"stop={list(p.stop)!r}: stop strings need text (a tokenizer and "
                "detokenize=True); use stop_token_ids"
            )
        if p.max_thinking_tokens is not None:
            p = resolve_thinking(p, self.tokenizer)
        p = p.for_engine(self.info.vocab_size)
        for name, ids in p.vocab_token_ids():
            if message := outside_vocab(name, ids, self.info.vocab_size):
                raise ValueError(message)
        return p
