"""LLM: the offline Python API over a stage worker.

from rltserve import LLM, SamplingParams
with LLM("path/to/checkpoint") as llm:
    out = llm.generate(["Hello"], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence

from rltserve.config import EngineConfig
from rltserve.core.stage import InProcessStageClient, StageClient
from rltserve.models.tokenizer import load_tokenizer
from rltserve.outputs import OutputAssembler, RequestOutput
from rltserve.sampling import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    """Offline generation. The model runs in a spawned stage process (``in_process=True`` runs it
    on a thread of this process instead). Close it with ``close()`` or use it as a context
    manager."""

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
        async_scheduling: bool = False,
        wavefront_prefill: bool = False,
        speculative_tokens: int = 0,
        draft_loops: int = 2,
        num_blocks: int | None = None,
        block_size: int = 16,
        seed: int = 0,
        max_model_len: int | None = None,
        kv_cache_gb: float = 1.0,
        cuda_graphs: bool = False,
        cuda_graph_max_rows: int = 256,
        cuda_graph_max_context: int = 4096,
        kv_reservation: str = "ondemand",
        kv_watermark: float = 0.01,
        swap_space_gb: float = 4.0,
        preemption_mode: str = "recompute",
        scheduling_policy: str = "fcfs",
        in_process: bool = False,
        startup_timeout: float = 300.0,
    ) -> None:
        if model is None:
            from rltserve.models.demo import demo_model_path

            model = str(demo_model_path())
        self.config = EngineConfig.from_flat(
            model=str(model),
            dtype=dtype,
            device=device,
            kv_policy=kv_policy,
            scheduling=scheduling,
            exit_mode=exit_mode,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            prefill_chunk_size=min(prefill_chunk_size, max_num_batched_tokens),
            async_scheduling=async_scheduling,
            wavefront_prefill=wavefront_prefill,
            speculative_tokens=speculative_tokens,
            draft_loops=draft_loops,
            num_blocks=num_blocks,
            block_size=block_size,
            seed=seed,
            max_model_len=max_model_len,
            kv_cache_gb=kv_cache_gb,
            cuda_graphs=cuda_graphs,
            cuda_graph_max_rows=cuda_graph_max_rows,
            cuda_graph_max_context=cuda_graph_max_context,
            kv_reservation=kv_reservation,
            kv_watermark=kv_watermark,
            swap_space_gb=swap_space_gb,
            preemption_mode=preemption_mode,
            scheduling_policy=scheduling_policy,
        )
        self.tokenizer = load_tokenizer(model)
        client_cls = InProcessStageClient if in_process else StageClient
        self._client = client_cls(self.config)
        try:
            self.info = self._client.wait_ready(startup_timeout)
        except Exception:
            self._client.close()
            raise
        self._ids = itertools.count()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._client.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt; returns outputs in input order. Prompts are strings (needs
        a tokenizer) or token-id lists."""
        batch = self._normalize_prompts(prompts)
        if params is None:
            params = SamplingParams()
        plist = [params] * len(batch) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(batch):
            raise ValueError(f"params: {len(plist)} given for {len(batch)} prompts")
        done = threading.Condition()
        remaining = [len(batch)]
        assemblers: list[OutputAssembler] = []
        for prompt, p in zip(batch, plist):
            ids = self._encode(prompt)
            rid = f"gen-{next(self._ids)}"
            asm = OutputAssembler(
                rid, ids, self.tokenizer, p.stop, p.logprobs is not None, p.stop_token_ids
            )
            assemblers.append(asm)
            self._client.add_request(rid, ids, p, self._sink(asm, done, remaining))
        with done:
            done.wait_for(lambda: remaining[0] == 0)
        for asm in assemblers:
            if asm.rejected:
                raise ValueError(asm.output.error)
            if asm.output.finish_reason == "error":
                raise RuntimeError(f"request {asm.output.request_id} failed: {asm.output.error}")
        return [a.output for a in assemblers]

    def _sink(self, asm: OutputAssembler, done: threading.Condition, remaining: list[int]):
        finished = [False]

        def sink(update) -> None:
            if finished[0]:
                return
            delta = asm.add(update)
            if delta.finish_reason is not None:
                if update.finish_reason is None:  # a stop string: stop the stage's work too
                    self._client.abort(asm.output.request_id)
                finished[0] = True
                with done:
                    remaining[0] -= 1
                    done.notify_all()

        return sink

    def _normalize_prompts(self, prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) for t in prompts):
            raise ValueError("prompts: pass a list of token-id lists, not one flat list of ids")
        return prompts

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this checkpoint has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt: token ids must be ints")
        return ids
