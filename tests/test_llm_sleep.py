"""Sleep mode (vLLM's ``sleep`` / ``wake_up``, as TRL and OpenRLHF call them around training):
the KV pool's memory is freed and restored, outputs after waking equal those before, requests
are refused while asleep, and the level-2 cycle with a weight load in between works."""

from __future__ import annotations

import math
import threading
import time

import pytest
from engine_util import make_core, run_core

from rltserve import LLM, SamplingParams
from rltserve.models.presets import make_model
from rltserve.updates import UpdateTimeout

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4], list(range(5, 40))]


def test_the_engine_frees_its_kv_pool_asleep_and_computes_the_same_awake(tiny):
    core = make_core(tiny, num_blocks=64)
    before = run_core(core, PROMPTS, [GREEDY] * 2).tokens
    kv = core.runner.kv.untyped_storage()
    full = kv.nbytes()
    core.sleep(1)
    assert kv.nbytes() == 0 and core.sleeping == {"weights", "kv_cache"}
    with pytest.raises(ValueError, match="asleep"):
        core.add_request("r", [1, 2], GREEDY)
    core.wake_up(["kv_cache", "weights"])
    assert kv.nbytes() == full and not core.sleeping
    assert run_core(core, PROMPTS, [GREEDY] * 2).tokens == before
    core.shutdown()


def test_sleep_and_wake_up_through_the_llm(tiny):
    with LLM(str(tiny), in_process=True, num_blocks=64) as llm:
        before = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        llm.sleep(level=1)
        assert llm.is_sleeping()
        with pytest.raises(ValueError, match="asleep.*wake_up"):
            llm.generate(PROMPTS, GREEDY)
        llm.wake_up(tags=["weights"])  # OpenRLHF wakes one tag at a time
        with pytest.raises(ValueError, match=r"asleep \(kv_cache put to sleep\)"):
            llm.generate(PROMPTS, GREEDY)
        llm.wake_up(tags=["kv_cache"])
        assert not llm.is_sleeping()
        after = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in after] == before
        assert after[1].num_cached_tokens == 0  # the prefix cache went with the KV


def test_trl_cycle_level_two_then_new_weights(tiny, tmp_path):
    """TRL colocate: sleep(level=2) after construction; per step wake the weights, load them,
    wake the KV cache, generate, sleep again."""
    other = make_model("ouro-tiny", tmp_path / "other", seed=5)
    with LLM(str(other), in_process=True, num_blocks=64) as ref:
        expected = [o.token_ids for o in ref.generate(PROMPTS, GREEDY)]
    with LLM(str(tiny), num_blocks=64, enable_sleep_mode=True) as llm:  # a worker process
        llm.sleep(level=2)
        with pytest.raises(ValueError, match="weights: asleep"):
            llm.update_weights(other)
        llm.wake_up(tags=["weights"])
        llm.update_weights(other)
        llm.wake_up(tags=["kv_cache"])
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
        llm.sleep(level=2)
        llm.wake_up()  # both, and no load: on CUDA the weights would be uninitialised memory
        with pytest.raises(ValueError, match=r"dropped by sleep\(level=2\).*update_weights"):
            llm.generate(PROMPTS, GREEDY)
        llm.sleep(level=1)  # (still not loaded: a level-1 copy of dropped weights is no load)
        llm.wake_up()
        with pytest.raises(ValueError, match="dropped by sleep"):
            llm.generate(PROMPTS, GREEDY)
        llm.update_weights(other)
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected


def test_a_level_two_sleep_over_sleeping_weights_drops_nothing(tiny):
    """Weights asleep at level 1 keep their host copy through a level-2 sleep (the first sleep
    decides, ``core/sleep``): waking them needs no load."""
    core = make_core(tiny, num_blocks=64)
    before = run_core(core, PROMPTS, [GREEDY] * 2).tokens
    core.sleep(1)
    core.sleep(2)
    core.wake_up(["weights", "kv_cache"])
    assert not core.weights_dropped
    assert run_core(core, PROMPTS, [GREEDY] * 2).tokens == before
    core.shutdown()


def test_sleep_waits_for_running_requests_or_times_out(tiny):
    slow = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    with LLM(str(tiny), in_process=True, num_blocks=64) as llm:
        done = []
        thread = threading.Thread(target=lambda: done.append(llm.generate([[1, 2]], slow)))
        thread.start()
        while not (llm._client.stats and llm._client.stats.num_running):
            time.sleep(0.005)
        with pytest.raises(UpdateTimeout, match="still running after 0 s; nothing applied$"):
            llm.sleep(timeout=0)
        with pytest.raises(ValueError, match="^level=3: must be 1 or 2$"):
            llm.sleep(level=3, timeout=0)  # refused at once, not after waiting for the request
        assert not llm.is_sleeping()
        llm.sleep()  # waits for the request
        thread.join()
        assert len(done[0][0].token_ids) == 200 and llm.is_sleeping()
        llm.wake_up()
        assert len(llm.generate([[1, 2]], GREEDY)[0].token_ids) == 6


def test_waking_an_awake_engine_waits_for_nothing(tiny):
    """(A wake_up that went through the update gate waited for running requests and held new
    ones: vLLM's returns at once.)"""
    slow = SamplingParams(temperature=0.0, max_tokens=240, ignore_eos=True)
    with LLM(str(tiny), in_process=True, num_blocks=128) as llm:
        thread = threading.Thread(target=lambda: llm.generate([[1, 2]], slow))
        thread.start()
        while not (llm._client.stats and llm._client.stats.num_running):
            time.sleep(0.005)
        llm.wake_up()
        assert thread.is_alive()  # returned while the request still runs
        thread.join()


def test_a_wake_up_after_a_waiting_sleep_applies_after_it(tiny):
    """sleep() waits for a running request, then wake_up() arrives: it is answered after the
    sleep, and the engine ends awake (the last command wins)."""
    import asyncio

    from rltserve.core.engine_loop import run_engine_loop

    core = make_core(tiny, num_blocks=64)
    replies = []

    async def main():
        inbox = asyncio.Queue()

        def emit(updates, _stats):
            if any(u.request_id == "r" and u.finish_reason is not None for u in updates):
                inbox.put_nowait(("shutdown",))

        slow = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
        for command in [
            ("add", "r", [1, 2], slow),
            ("sleep", 1, 1, 60.0),
            ("wake_up", 2, ["weights", "kv_cache"]),
        ]:
            inbox.put_nowait(command)
        loop = run_engine_loop(core, inbox, emit, lambda *r: replies.append(r))
        await asyncio.wait_for(loop, 120)

    asyncio.run(main())
    assert [token for token, error, _ in replies] == [1, 2]
    assert all(error is None for _, error, _ in replies) and not core.sleeping
    core.shutdown()


def test_bad_levels_and_tags_are_refused(tiny):
    with LLM(str(tiny), in_process=True, num_blocks=64) as llm:
        with pytest.raises(ValueError, match="level=3: must be 1 or 2"):
            llm.sleep(level=3)
        for timeout in (-3, math.nan):  # NaN would wait forever; nothing may sleep
            with pytest.raises(ValueError, match=f"timeout={timeout!r}: must be a finite"):
                llm.sleep(timeout=timeout)
        assert not llm.is_sleeping()
        with pytest.raises(ValueError, match="timeout=nan: must be a finite"):
            llm.close(timeout=math.nan)
        for tags in ("weights", ""):  # (a string is not a list of tags, an empty one neither)
            with pytest.raises(ValueError, match=f"tags={tags!r}"):
                llm.wake_up(tags=tags)
        with pytest.raises(ValueError, match="tags=\\['gpu'\\]"):
            llm.wake_up(tags=["gpu"])
        llm.wake_up()  # awake already: nothing to do
        assert not llm.is_sleeping()


@pytest.mark.gpu
def test_sleep_hands_device_memory_back_on_cuda(tiny):
    """On CUDA the weights go too (level 1: to the host and back; level 2: dropped, then
    loaded); CUDA graphs are captured again on the new addresses; outputs are unchanged."""
    import torch

    from rltserve.core.weight_update import update_weights
    from rltserve.weights import update_files

    core = make_core(tiny, num_blocks=64, device="cuda", cuda_graphs=True)
    before = run_core(core, PROMPTS, [GREEDY] * 2).tokens
    torch.cuda.synchronize()
    awake = torch.cuda.memory_allocated()
    weights = sum(p.numel() * p.element_size() for p in core.model.parameters())
    core.sleep(1)
    assert torch.cuda.memory_allocated() <= awake - weights
    core.wake_up(["weights", "kv_cache"])
    assert run_core(core, PROMPTS, [GREEDY] * 2).tokens == before
    assert core.runner.graphs is not None and core.runner.graphs.num_captured > 0
    core.sleep(2)
    core.wake_up(["weights"])
    update_weights(core.model, str(tiny), update_files(str(tiny)))
    core.on_weights_updated()
    core.wake_up(["kv_cache"])
    assert run_core(core, PROMPTS, [GREEDY] * 2).tokens == before
    core.shutdown()
