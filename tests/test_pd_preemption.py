"""A PD decode stage that preempts by swapping: a transfer file is read into the pool at
admission, on the step thread ahead of the plan being built, so it must not be read into the
blocks of a victim that plan swaps out (they hold the victim's KV until the plan copies them
out; found by scripts/fuzz_oracle.py: the victim's later logprobs were off by up to 1.0)."""

from __future__ import annotations

import threading

import torch
from engine_util import oracle_run, tight_blocks, wait_pd_idle
from test_pd import _client

from rltserve.sampling import SamplingParams

HEAD = [239, 277, 236, 345, 191]  # (one full block every prompt shares, and a token more)


def _prompt(tail: list[int]) -> list[int]:
    return (HEAD + tail) * 3


def test_a_transfer_read_in_the_plan_that_swaps_a_victim_out_leaves_its_kv(ckpts, ouro_ref):
    prompts = [
        _prompt([198, 183, 243, 17, 115, 289, 88, 151]),
        _prompt([12, 373, 74, 14, 140]),
        _prompt([120, 158, 172, 336, 297, 38]),
    ]
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, min_loops=2, max_loops=3)
    params = [
        greedy.replace(max_tokens=3, priority=0),
        # (prompt_logprobs: straight to the decode stage, where it runs first; the worst
        # priority: the victim of the others, which come through transfer files)
        greedy.replace(max_tokens=8, priority=2, prompt_logprobs=0, logprobs=0),
        greedy.replace(max_tokens=5, priority=-2),
    ]
    engine = {"kv_policy": "last_exited", "async_scheduling": True, "exit_mode": "delayed",
              "preemption_mode": "swap", "scheduling_policy": "priority"}  # fmt: skip
    engine["kv_watermark"] = 0.0
    engine["num_blocks"] = tight_blocks(ckpts["ouro"], prompts, params, kv_policy="last_exited")
    client = _client(ckpts["ouro"], **engine)
    updates: dict[str, list] = {f"r{i}": [] for i in range(3)}
    done = threading.Condition()

    def sink(update):
        with done:
            updates[update.request_id].append(update)
            done.notify_all()

    def finished() -> bool:
        return all(u and u[-1].finish_reason is not None for u in updates.values())

    try:
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            client.add_request(f"r{i}", prompt, p, sink)
        with done:
            assert done.wait_for(finished, timeout=120)
        wait_pd_idle(client)
        assert client.decode.stats.num_preemptions >= 1
    finally:
        client.close()
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        got = [t for u in updates[f"r{i}"] for t in u.new_token_ids]
        want = oracle_run(ouro_ref, prompt, p.replace(priority=0), kv_policy="last_exited")
        assert got == want.tokens, f"request {i}"
    # The victim's scores after its swap-in are the model's on its own context.
    got = [lp for u in updates["r1"] for lp in u.new_logprobs]
    want = oracle_run(ouro_ref, prompts[1], params[1].replace(priority=0), kv_policy="last_exited")
    for k, (token, logits) in enumerate(zip(want.tokens, want.logits)):
        expected = float(torch.log_softmax(logits.float(), -1)[token])
        assert abs(got[k] - expected) < 1e-4, f"token {k}: {got[k]} != {expected}"
