"""In-place weight updates: outputs after an update equal the oracle on the new weights (whole
checkpoints, (name, tensor) pairs, subsets that touch fused parameters), malformed updates are
rejected whole, and updates wait for, time out on, or abort running requests."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import threading
from pathlib import Path
from types import MappingProxyType

import pytest
import torch
from builders import random_tensors, write_checkpoint
from engine_util import make_core, oracle_run
from reference import Reference
from safetensors.torch import load_file, save_file

from rltserve import LLM, SamplingParams
from rltserve.core.engine_loop import run_engine_loop
from rltserve.core.request import FinishReason
from rltserve.core.stage import StageError
from rltserve.updates import UpdateTimeout

PROMPTS = [[3, 17, 42, 7], [99, 5]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, exit_threshold=0.5)


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


@pytest.fixture(scope="module")
def new_ckpt(ouro_rv1, tmp_path_factory) -> Path:
    """The rv1 model's layout with other random values."""
    cfg = _config(ouro_rv1)
    return write_checkpoint(tmp_path_factory.mktemp("new"), cfg, random_tensors(cfg, seed=3))


@pytest.fixture()
def llm(ouro_rv1):
    with LLM(str(ouro_rv1), in_process=True, num_blocks=128) as llm:
        yield llm


def _oracle(path: Path) -> list[tuple[list[int], list[int]]]:
    ref = Reference.load(path)
    runs = [oracle_run(ref, p, PARAMS, kv_policy="last_exited") for p in PROMPTS]
    return [(r.tokens, r.exit_depths) for r in runs]


def _generate(llm: LLM) -> list[tuple[list[int], list[int]]]:
    outs = llm.generate(PROMPTS, PARAMS)
    return [(o.outputs[0].token_ids, o.outputs[0].exit_depths) for o in outs]


def test_update_from_a_directory_and_from_pairs_equals_the_oracle(
    llm, ouro_rv1, new_ckpt, tmp_path
):
    old = _oracle(ouro_rv1)
    assert _generate(llm) == old
    assert llm.update_weights(str(new_ckpt)) == 1
    assert _generate(llm) == _oracle(new_ckpt) != old
    assert llm.generate(PROMPTS[:1], PARAMS)[0].weight_version == 1
    # A trainer's state_dict: (name, tensor) pairs in checkpoint names, here in bfloat16 (cast
    # to the engine's float32).
    bf16 = {k: v.to(torch.bfloat16) for k, v in load_file(ouro_rv1 / "model.safetensors").items()}
    assert llm.update_weights(bf16.items()) == 2
    widened = {k: v.float() for k, v in bf16.items()}
    assert _generate(llm) == _oracle(write_checkpoint(tmp_path / "w", _config(ouro_rv1), widened))
    assert llm.weight_version == 2


def test_a_subset_rebuilds_fused_rows(llm, ouro_rv1, new_ckpt, tmp_path):
    # k_proj is the middle rows of the fused qkv parameter; up_proj the second half of gate_up.
    names = ["model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight"]
    new = load_file(new_ckpt / "model.safetensors")
    llm.update_weights([(n, new[n]) for n in names])
    mixed = load_file(ouro_rv1 / "model.safetensors")
    mixed.update({n: new[n] for n in names})
    want = _oracle(write_checkpoint(tmp_path / "mixed", _config(ouro_rv1), mixed))
    assert _generate(llm) == want


def test_malformed_update_is_rejected_whole(llm, ouro_rv1, new_ckpt):
    before = _generate(llm)
    new = load_file(new_ckpt / "model.safetensors")
    bad = [
        ("model.norm.weight", new["model.norm.weight"]),  # valid, must not be applied
        ("model.layers.0.mlp.gate_proj.weight", new["model.layers.0.mlp.gate_proj.weight"][:3]),
        ("model.no_such.weight", torch.zeros(2)),
    ]
    with pytest.raises(ValueError) as err:
        llm.update_weights(bad)
    message = str(err.value)
    assert "nothing applied" in message
    assert "model.no_such.weight" in message and "gate_proj.weight [3, " in message
    assert llm.weight_version == 0 and _generate(llm) == before
    for arg, fragment in [
        ("/no/such/dir", "does not exist"),
        ([("x", 1)], "must be a torch.Tensor"),
        (42, "iterable of (name, tensor)"),
        ([("model.norm.weight", torch.empty(64, device="meta"))], "a meta tensor (no data)"),
        ([("model.norm.weight", torch.zeros(64).to_sparse())], "torch.sparse_coo (not dense)"),
        ([("model.norm.weight", torch.zeros(64, dtype=torch.int32))], "not in F64, F32"),
    ]:
        with pytest.raises(ValueError, match=re.escape(fragment)):
            llm.update_weights(arg)
    for timeout in (-1, math.nan, math.inf, "5", True):
        with pytest.raises(ValueError, match=re.escape(f"timeout={timeout!r}: must be a finite")):
            llm.update_weights(str(new_ckpt), timeout=timeout)
    with pytest.raises(ValueError, match="abort='yes': must be a bool"):
        llm.update_weights(str(new_ckpt), abort="yes")  # (truthy: it would abort requests)
    assert _generate(llm) == before and llm.weight_version == 0


def test_an_update_of_no_tensors_or_of_a_fifo_is_refused(llm, tmp_path):
    """A file of no tensors would move weight_version on with nothing changed; a FIFO named
    like a weight file would block the engine's read until the watchdog killed it."""
    empty = tmp_path / "empty"
    empty.mkdir()
    save_file({}, str(empty / "model.safetensors"))
    with pytest.raises(ValueError, match="the update holds no weight tensors"):
        llm.update_weights(str(empty))
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "model.safetensors")
    with pytest.raises(ValueError, match="not regular files: model.safetensors"):
        llm.update_weights(str(fifo))
    assert llm.weight_version == 0


def test_a_name_in_two_shards_is_rejected_and_rope_inv_freq_is_ignored(llm, new_ckpt, tmp_path):
    before = _generate(llm)
    new = load_file(new_ckpt / "model.safetensors")
    norm = {"model.norm.weight": new["model.norm.weight"]}
    for shard in ("a", "b"):  # a sharded checkpoint directory holding one tensor twice
        save_file(norm, tmp_path / f"{shard}.safetensors")
    with pytest.raises(ValueError, match="'model.norm.weight' is given twice"):
        llm.update_weights(str(tmp_path))
    assert llm.weight_version == 0 and _generate(llm) == before
    # An older checkpoint's RoPE inverse frequencies are dropped, as loading drops them.
    inv_freq = ("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(8))
    assert llm.update_weights([*new.items(), inv_freq]) == 1
    assert _generate(llm) == _oracle(new_ckpt)


def _start_long_request(llm: LLM) -> tuple[list, threading.Event]:
    got: list = []
    done = threading.Event()

    def sink(update):
        got.append(update)
        if update.finish_reason is not None:
            done.set()

    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    llm._client.add_request("long", [1, 2, 3], params, sink)
    return got, done


def test_update_while_running_times_out_or_aborts(llm, ouro_rv1, new_ckpt):
    got, done = _start_long_request(llm)
    with pytest.raises(UpdateTimeout, match="still running after 0 s"):
        llm.update_weights(str(new_ckpt), timeout=0)
    assert llm.weight_version == 0 and not done.is_set()
    assert llm.update_weights(str(new_ckpt), abort=True) == 1
    assert done.wait(30) and got[-1].finish_reason is FinishReason.ABORT
    assert _generate(llm) == _oracle(new_ckpt)


def test_update_waits_for_running_requests(llm, new_ckpt):
    p = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    results = {}
    first = threading.Thread(target=lambda: results.setdefault("a", llm.generate([[4, 5]], p)))
    first.start()
    while llm._client.stats is None or not llm._client.stats.num_running:
        first.join(0.01)  # wait until the request runs
    assert llm.update_weights(str(new_ckpt), timeout=60) == 1
    first.join(60)
    assert results["a"][0].weight_version == 0  # it finished on the old weights
    assert len(results["a"][0].outputs[0].token_ids) == 40


def test_pause_and_resume_generation(llm):
    llm.pause_generation()
    results = []
    t = threading.Thread(target=lambda: results.append(llm.generate([[4, 5]], PARAMS)))
    t.start()
    t.join(0.3)
    assert t.is_alive() and not results  # waits while paused
    llm.resume_generation()
    t.join(60)
    assert len(results) == 1


def test_huginn_tied_copy_follows_its_source(huginn_rv1, huginn_ref, tmp_path):
    cfg = _config(huginn_rv1)
    new = random_tensors(cfg, seed=9)  # lm_head.weight equals transformer.wte.weight
    new["freqs_cis"] = load_file(huginn_rv1 / "model.safetensors")["freqs_cis"]
    p = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, init_state="zero")
    with LLM(str(huginn_rv1), in_process=True, num_blocks=128) as llm:
        with pytest.raises(ValueError, match="tied copies without their source"):
            llm.update_weights([("lm_head.weight", new["lm_head.weight"])])
        untied = {**new, "lm_head.weight": new["lm_head.weight"] + 0.5}  # as loading refuses
        with pytest.raises(ValueError, match="lm_head.weight differs from transformer.wte"):
            llm.update_weights(untied.items())
        assert llm.weight_version == 0
        llm.update_weights(new.items())
        got = llm.generate(PROMPTS, p)
    ref = Reference.load(write_checkpoint(tmp_path / "h", cfg, new))
    for prompt, out in zip(PROMPTS, got):
        want = oracle_run(ref, prompt, p, kv_policy="last_exited")
        assert out.outputs[0].token_ids == want.tokens


def test_requests_arriving_during_an_update_wait_for_it(ouro_rv1, new_ckpt):
    """Engine loop order: r1 runs, the update waits for it, r2 (and r3, aborted while held)
    arrive meanwhile; r2 runs after the update, on the new weights."""
    core = make_core(ouro_rv1)
    p = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, exit_threshold=0.5)
    final: dict[str, object] = {}
    tokens: dict[str, list[int]] = {"r1": [], "r2": []}
    replies: list = []

    async def main() -> None:
        inbox: asyncio.Queue = asyncio.Queue()

        def emit(updates, _stats) -> None:
            for u in updates:
                tokens.setdefault(u.request_id, []).extend(u.new_token_ids)
                if u.finish_reason is not None:
                    final[u.request_id] = u
            if "r2" in final:
                inbox.put_nowait(("shutdown",))

        for command in [
            ("add", "r1", PROMPTS[0], p.replace(max_tokens=12)),
            ("update_weights", 7, [str(new_ckpt)], False, 60.0),
            ("add", "r2", PROMPTS[0], p),
            ("add", "r3", PROMPTS[1], p),
            ("abort", "r3"),
        ]:
            inbox.put_nowait(command)
        await asyncio.wait_for(
            run_engine_loop(core, inbox, emit, lambda *r: replies.append(r)), 120
        )

    asyncio.run(main())
    assert replies == [(7, None, 1)]
    assert final["r1"].weight_version == 0 and len(tokens["r1"]) == 12
    assert final["r3"].finish_reason is FinishReason.ABORT and not tokens.get("r3")
    assert final["r2"].weight_version == 1
    assert tokens["r2"] == _oracle(new_ckpt)[0][0]
    core.shutdown()


def test_a_long_list_of_problems_names_ten_and_counts_the_rest(ouro_rv1, tmp_path):
    from rltserve.core.weight_update import read_update

    model = torch.nn.Linear(1, 1)  # (nothing is read into it: the update is rejected)
    file = tmp_path / "update.safetensors"
    save_file({f"model.no_such_{i:02d}.weight": torch.zeros(1) for i in range(12)}, str(file))
    with pytest.raises(ValueError) as err:
        read_update(model, ouro_rv1, [file])
    names = ", ".join(f"model.no_such_{i:02d}.weight" for i in range(10))
    assert str(err.value) == (
        "weights: update rejected, nothing applied; "
        f"unknown tensor names (12): {names}, ... and 2 more"
    )
    with pytest.raises(ValueError, match="^weights: the update holds no files$"):
        read_update(model, ouro_rv1, [])


def test_update_weights_returns_the_tensors_applied(ouro_rv1, new_ckpt, tmp_path):
    from rltserve.core.weight_update import update_weights

    core = make_core(ouro_rv1)
    new = load_file(new_ckpt / "model.safetensors")
    names = ("model.norm.weight", "model.layers.0.mlp.gate_proj.weight")
    file = tmp_path / "update.safetensors"
    save_file({name: new[name] for name in names}, str(file))
    assert update_weights(core.model, ouro_rv1, [file]) == 2  # (one file)


class _GateCore:
    """What ``WeightGate`` reads of an engine: one request running, two waiting."""

    weight_version = 3
    sleeping: set = set()

    def __init__(self) -> None:
        from types import SimpleNamespace

        self.scheduler = SimpleNamespace(num_running=1, num_waiting=2, requests={})
        self.busy = True

    def has_work(self) -> bool:
        return self.busy

    def sleep(self, level: int) -> None:
        raise RuntimeError("device lost")


def test_the_gate_names_every_request_it_timed_out_on_and_the_type_of_a_failure():
    from rltserve.core.weight_gate import WeightGate

    replies = []
    core = _GateCore()
    gate = WeightGate(core, lambda *reply: replies.append(reply))
    gate.request(("update_weights", 7, ["x"], False, 0.0))
    assert gate.poll(busy=False) == []
    assert replies == [
        (7, "timeout: 3 sequence(s) still running after 0 s; nothing applied (abort=True aborts "
            "them instead of waiting)", 3)
    ]  # fmt: skip
    core.busy = False
    gate.request(("sleep", 8, 1, 5.0))
    assert gate.poll(busy=False) == []
    assert replies[1] == (8, "RuntimeError: device lost", 3)


def test_held_requests_wait_until_no_command_is_pending():
    """One of two waiting commands timing out does not release the requests held behind the
    other; they go once it, too, is done."""
    from rltserve.core.weight_gate import WeightGate

    replies = []
    gate = WeightGate(_GateCore(), lambda *reply: replies.append(reply))
    gate.request(("update_weights", 1, ["x"], False, 0.0))  # expires at the first poll
    gate.request(("update_weights", 2, ["y"], False, 60.0))
    gate.held.append(("add", "r", [1], None))
    assert gate.poll(busy=True) == [] and [r[0] for r in replies] == [1]
    assert gate.waiting and gate.held == [("add", "r", [1], None)]
    gate._pending[0].deadline = 0.0  # (the second times out as well)
    assert gate.poll(busy=True) == [("add", "r", [1], None)]
    assert [r[0] for r in replies] == [1, 2] and not gate.waiting and gate.held == []


def test_every_token_update_after_an_update_carries_the_new_version(ouro_rv1):
    core = make_core(ouro_rv1)
    core.on_weights_updated()
    core.add_request("r", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    versions = []
    while core.has_work():
        versions += [u.weight_version for u in core.step()]
    assert len(versions) >= 4 and set(versions) == {1}


def test_vllm_scripts_load_weights_through_the_engine_path(llm, new_ckpt):
    """TRL's colocate mode loads one parameter at a time through vLLM's objects: the path is
    here, equals update_weights, and returns the names loaded."""
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    new = load_file(new_ckpt / "model.safetensors")
    for name, tensor in new.items():
        assert model.load_weights([(name, tensor)]) == {name}
    assert llm.weight_version == len(new)
    assert _generate(llm) == _oracle(new_ckpt)
    wrapped = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model  # (vLLM V1)
    assert wrapped.load_weights(iter(())) == set() and llm.weight_version == len(new)
    with pytest.raises(ValueError, match="unknown tensor names"):
        model.load_weights({"model.nope.weight": torch.zeros(2)}.items())
    assert llm.weight_version == len(new)
    assert model.load_weights(new) == set(new) and llm.weight_version == len(new) + 1  # (a dict)


def test_update_weights_takes_any_mapping_of_names_to_tensors(llm, new_ckpt):
    """A state_dict passed whole is taken as its items, whatever kind of mapping holds it (a
    read-only view here; a plain dict and the load_weights path already were): iterating a
    mapping gives its names alone, which read as malformed pairs."""
    new = load_file(new_ckpt / "model.safetensors")
    assert llm.update_weights(MappingProxyType(new)) == 1
    assert _generate(llm) == _oracle(new_ckpt)


def test_load_weights_copies_pairs_in_order_as_vllms_does(llm, ouro_rv1, new_ckpt, tmp_path):
    """Streaming parameters in buckets through vLLM's path: a tensor sent again ends with its
    last value, in one update, and an empty bucket changes nothing. update_weights itself
    refuses a name given twice (nothing applied) and takes no pairs as no update."""
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    old, new = (load_file(path / "model.safetensors") for path in (ouro_rv1, new_ckpt))
    norm = "model.norm.weight"
    assert model.load_weights([*new.items(), (norm, old[norm])]) == set(new)
    assert llm.weight_version == 1
    mixed = {**new, norm: old[norm]}
    want = _oracle(write_checkpoint(tmp_path / "mixed", _config(ouro_rv1), mixed))
    assert _generate(llm) == want != _oracle(new_ckpt)
    assert model.load_weights([]) == set() and llm.weight_version == 1
    assert llm.update_weights([]) == 1 and llm.update_weights(iter(())) == 1
    with pytest.raises(ValueError, match=f"weights: tensor '{norm}' is given twice"):
        llm.update_weights([(norm, new[norm]), (norm, old[norm])])
    assert llm.weight_version == 1 and _generate(llm) == want
    llm.close()  # a closed LLM takes no update, not even of nothing
    for call in (lambda: llm.update_weights([]), lambda: model.load_weights([])):
        with pytest.raises(StageError, match=r"^this LLM is closed \(close\(\) was called\)$"):
            call()


def test_the_engine_path_names_what_it_does_not_have(llm):
    engine = llm.llm_engine
    with pytest.raises(AttributeError, match=r"llm_engine\.scheduler: rltserve runs the model"):
        engine.scheduler  # noqa: B018
    runner = engine.model_executor.driver_worker.model_runner
    with pytest.raises(AttributeError, match=r"model_runner\.model\.named_parameters: .*"):
        runner.model.named_parameters  # noqa: B018
    with pytest.raises(AttributeError, match=r"model_runner\.load_weights: the model's"):
        runner.load_weights([])
    # Only the model has load_weights (scripts probe for it with hasattr).
    assert hasattr(runner.model, "load_weights")
    assert not any(hasattr(hop, "load_weights") for hop in (engine, engine.model_executor, runner))
    with pytest.raises(AttributeError, match=r"model_executor\.worker: "):
        engine.model_executor.worker  # noqa: B018
    assert not hasattr(engine, "__array__")  # (probes of special names find nothing)
