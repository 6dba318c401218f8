"""The vLLM-compatible offline API: prompt forms, the RequestOutput / CompletionOutput shape, n
samples, text options, progress bars, prompt truncation and cache salts, and a script
written for vLLM run unchanged. Engine arguments and defaults: test_llm_engine_args; chat:
test_llm_chat; get_metrics, vLLM's other methods and names: test_llm_vllm_surface."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from engine_util import make_core, run_core

from rltserve import LLM, SamplingParams
from rltserve.outputs import CompletionOutput, RequestOutput
from rltserve.samples import expand_samples

ROOT = Path(__file__).resolve().parent.parent
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny):
    with LLM(str(tiny), in_process=True, num_blocks=128, max_model_len=256) as llm:
        yield llm


def test_prompt_forms_give_the_same_tokens_in_input_order(llm):
    text = "Hello there"
    ids = llm.tokenizer.encode(text)
    p = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([text, ids, {"prompt": text}, {"prompt_token_ids": ids}], p)
    assert [o.prompt_token_ids for o in outs] == [ids] * 4
    assert [o.prompt for o in outs] == [text, None, text, None]
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    single = llm.generate({"prompt_token_ids": ids}, p)  # one prompt, not in a list
    assert len(single) == 1 and single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_output_shape_is_vllms(llm):
    (out,) = llm.generate(["Hi"], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert isinstance(out, RequestOutput) and out.finished and out.weight_version == 0
    (c,) = out.outputs
    assert isinstance(c, CompletionOutput)
    assert c.index == 0 and c.finished() and c.finish_reason == "length"
    assert len(c.token_ids) == len(c.exit_depths) == 3
    assert c.text == llm.tokenizer.decode(c.token_ids)
    assert c.cumulative_logprob is None and c.logprobs is None and c.stop_reason is None
    # The n=1 conveniences read the first sample.
    assert (out.text, out.token_ids, out.exit_depths) == (c.text, c.token_ids, c.exit_depths)
    assert out.prompt_logprobs is None


def test_prompt_logprobs_are_vllms(llm):
    """Per prompt token a {token_id: Logprob} with the token first and the top k ranked, None
    for the first token; the same for every sample of the prompt."""
    prompt = [5, 9, 14, 3, 27]
    one = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    (out,) = llm.generate([prompt], one)
    first, *rest = out.prompt_logprobs
    assert first is None and len(rest) == len(prompt) - 1
    for token, entry in zip(prompt[1:], rest):
        assert next(iter(entry)) == token and entry[token].logprob <= 0
        ranked = sorted((lp.rank, t) for t, lp in entry.items())  # (each has a rank)
        assert [r for r, _ in ranked[:2]] == [1, 2]
        assert entry[ranked[0][1]].logprob >= entry[ranked[1][1]].logprob
        assert entry[token].decoded_token == llm.tokenizer.decode([token])
    (many,) = llm.generate([prompt], one.replace(n=3, temperature=1.0, seed=2))
    assert many.prompt_logprobs == out.prompt_logprobs


def test_n_samples_equal_separate_requests_with_derived_seeds(llm):
    p = SamplingParams(n=3, temperature=2.0, max_tokens=6, ignore_eos=True, seed=11)
    (out,) = llm.generate([[5, 6, 7]], p)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    singles = [
        llm.generate([[5, 6, 7]], p.replace(n=1, seed=11 + j))[0].outputs[0].token_ids
        for j in range(3)
    ]
    assert [c.token_ids for c in out.outputs] == singles
    assert len({tuple(s) for s in singles}) > 1  # the samples differ
    assert [q.seed for q in expand_samples(p.replace(seed=None))] == [None] * 3


def test_text_options(llm):
    base = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (plain,) = llm.generate(["Once"], base)
    text = plain.outputs[0].text
    assert text
    stop = text[2:4]
    (cut,) = llm.generate(["Once"], base.replace(stop=[stop]))
    (kept,) = llm.generate(["Once"], base.replace(stop=[stop], include_stop_str_in_output=True))
    assert cut.outputs[0].text == text[: text.index(stop)]
    assert kept.outputs[0].text == text[: text.index(stop) + len(stop)]
    assert cut.outputs[0].stop_reason == stop and cut.outputs[0].finish_reason == "stop"
    (raw,) = llm.generate(["Once"], base.replace(detokenize=False))
    assert raw.outputs[0].text == "" and raw.outputs[0].token_ids == plain.outputs[0].token_ids
    # No text work at all (vLLM's): logprob entries carry no decoded tokens either.
    (raw,) = llm.generate(["Once"], base.replace(detokenize=False, logprobs=1, prompt_logprobs=1))
    entries = [*raw.outputs[0].logprobs, *raw.prompt_logprobs[1:]]
    assert {lp.decoded_token for e in entries for lp in e.values()} == {None}
    (shown,) = llm.generate(["Once"], base.replace(logprobs=1))
    assert all(lp.decoded_token is not None for e in shown.outputs[0].logprobs for lp in e.values())
    (special,) = llm.generate(["Once"], base.replace(skip_special_tokens=False))
    ids = special.outputs[0].token_ids
    assert special.outputs[0].text == llm.tokenizer.decode(ids, skip_special_tokens=False)


def test_bad_prompts_and_params_name_the_field(llm):
    with pytest.raises(ValueError, match="unknown key 'multi_modal_data'"):
        llm.generate([{"prompt_token_ids": [1], "multi_modal_data": {}}])
    with pytest.raises(ValueError, match="'prompt' or 'prompt_token_ids'"):
        llm.generate([{}])
    with pytest.raises(ValueError, match="must be a string or a list of token ids"):
        llm.generate([b"hello"])  # (bytes: text, not token ids)
    with pytest.raises(ValueError, match="n=0"):
        SamplingParams(temperature=0.0, n=0)
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(temperature=0.0, detokenize="no")
    with pytest.raises(ValueError, match="stop strings need text"):
        llm.generate([[1]], SamplingParams(temperature=0.0, stop=["x"], detokenize=False))
    with pytest.raises(ValueError, match="sampling_params: 1 given for 2"):
        llm.generate([[1], [2]], [SamplingParams(temperature=0.0)])
    with pytest.raises(ValueError, match="sampling_params: must be SamplingParams or a list"):
        llm.generate([[1]], [{"max_tokens": 2}])
    vocab = llm.get_tokenizer().vocab_size
    with pytest.raises(ValueError, match=f"logit_bias: token id {vocab + 5} is outside"):
        llm.generate(
            [[1], [2]],
            [
                SamplingParams(temperature=0.0),
                SamplingParams(temperature=0.0, logit_bias={vocab + 5: 1}),
            ],
        )
    (out,) = llm.generate(
        [[1]], SamplingParams(temperature=0.0, max_tokens=4, allowed_token_ids=[3, 4])
    )
    assert set(out.outputs[0].token_ids) <= {3, 4}
    with pytest.raises(ValueError, match=f"^allowed_token_ids: token id {vocab} is outside"):
        llm.generate([[1]], SamplingParams(temperature=0.0, allowed_token_ids=[3, vocab]))


def test_stop_ids_outside_the_vocabulary_are_dropped(llm):
    """A stop id the model cannot produce is dropped, not refused (vLLM takes it unchecked);
    the caller's params are left as given."""
    (free,) = llm.generate([[1]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    first = free.outputs[0].token_ids[0]
    vocab = llm.get_tokenizer().vocab_size
    params = SamplingParams(
        temperature=0.0, max_tokens=4, ignore_eos=True, stop_token_ids=[vocab + 9, first, first]
    )
    (out,) = llm.generate([[1]], params)
    assert out.outputs[0].token_ids == [first]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", first)
    assert params.stop_token_ids == [vocab + 9, first, first]


def test_numpy_and_torch_ids_are_taken_as_ints(llm):
    """RL code holds ids in arrays: prompts, allowed ids and logit_bias from NumPy (or a torch
    tensor for the prompt) act as the same lists of ints."""
    import numpy as np
    import torch

    plain = SamplingParams(
        temperature=0.0, max_tokens=3, allowed_token_ids=[3, 4, 9], logit_bias={4: 1.5}
    )
    arrays = SamplingParams(
        temperature=0.0,
        max_tokens=3,
        allowed_token_ids=np.array([3, 4, 9]),
        logit_bias={np.int64(4): np.float32(1.5)},
    )
    assert arrays == plain
    want = llm.generate([[1, 5, 7]], plain)[0].outputs[0].token_ids
    for ids in (np.array([1, 5, 7]), torch.tensor([1, 5, 7]), [np.int64(1), 5, np.int32(7)]):
        (out,) = llm.generate([{"prompt_token_ids": ids}], arrays)
        assert out.prompt_token_ids == [1, 5, 7] and out.outputs[0].token_ids == want


def test_a_tokenizers_encoding_is_taken_as_its_input_ids(llm):
    """transformers 5's ``apply_chat_template(..., tokenize=True)`` returns a BatchEncoding, which
    vLLM scripts pass as a prompt's ids: its ``input_ids`` are taken; a batch is an error."""
    import numpy as np

    hf = llm.get_tokenizer()
    conv = [{"role": "user", "content": "Hi"}]
    enc = hf.apply_chat_template(conv, tokenize=True, add_generation_prompt=True)
    ids = llm.tokenizer.apply_chat_template(conv)
    want = llm.generate([ids], GREEDY)[0].token_ids
    for outs in (
        llm.generate({"prompt_token_ids": enc}, GREEDY),
        llm.generate({"prompt_token_ids": {"input_ids": np.array(ids)}}, GREEDY),
        llm.generate(prompt_token_ids=enc, sampling_params=GREEDY),
    ):
        assert (outs[0].prompt_token_ids, outs[0].token_ids) == (ids, want)
    with pytest.raises(ValueError, match=r"input_ids holds a batch of 2 sequences"):
        llm.generate({"prompt_token_ids": hf(["a b", "c"])}, GREEDY)


VLLM_SCRIPT = """
from rltserve import LLM, SamplingParams

llm = LLM(model={model!r}, dtype="float32", seed=0, max_model_len=256)
prompts = [[5, 6, 7, 8], [9, 10]]
params = SamplingParams(
    n=2, temperature=1.0, top_p=0.9, max_tokens=8, stop_token_ids=[2],
    skip_special_tokens=False, seed=1,
)
outputs = llm.generate([{{"prompt_token_ids": ids}} for ids in prompts], params)
print([[list(c.token_ids) for c in out.outputs] for out in outputs])
"""


def test_a_vllm_script_runs_unchanged(tiny, tmp_path, llm):
    script = tmp_path / "rollout.py"
    script.write_text(textwrap.dedent(VLLM_SCRIPT.format(model=str(tiny))))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    p = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, stop_token_ids=[2])
    want = [
        [llm.generate([ids], p.replace(seed=1 + j))[0].outputs[0].token_ids for j in range(2)]
        for ids in ([5, 6, 7, 8], [9, 10])
    ]
    assert got == want


def test_n_samples_compute_their_prompt_once(llm):
    prompt = list(range(100, 140))  # 40 tokens: two full blocks and a partial one
    before = llm._client.stats.prefix_cache_hits
    (out,) = llm.generate(
        [prompt], SamplingParams(temperature=0.0, n=4, max_tokens=2, ignore_eos=True)
    )
    assert len(out.outputs) == 4
    # Each of the 3 followers reuses all but the last prompt token of the leader's prefill.
    assert llm._client.stats.prefix_cache_hits - before == 3 * 39
    # Blocks shared within the group are cached for later requests of the prompt too.
    (again,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2))
    assert again.num_cached_tokens == 32


def test_vllm_engine_arguments_are_taken_as_vllm_means_them(tiny, tmp_path, llm):
    # trust_remote_code (no effect: no checkpoint code runs), tensor_parallel_size=1,
    # enforce_eager, gpu_memory_utilization (no effect on the CPU), dtype="auto" (the
    # checkpoint's) and a tokenizer directory: the same outputs as a plain LLM.
    want = (
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=6))[0]
        .outputs[0]
        .token_ids
    )
    with LLM(
        model=str(tiny),
        tokenizer=str(tiny),
        trust_remote_code=True,
        tensor_parallel_size=1,
        enforce_eager=True,
        gpu_memory_utilization=0.9,
        dtype="auto",
        in_process=True,
        num_blocks=128,
        max_model_len=256,
    ) as vl:
        assert vl.config.model.dtype == "float32" and not vl.config.execution.cuda_graphs
        assert vl.config.cache.kv_cache_gb == 1.0  # (the CPU's default)
        got = (
            vl.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=6))[0]
            .outputs[0]
            .token_ids
        )
        assert got == want and vl.get_tokenizer() is not None
    for kwargs, message in [
        ({"tensor_parallel_size": 2}, "tensor_parallel_size=2: rltserve runs an engine on one"),
        ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization=1.5: must be in \(0, 1\]"),
        ({"tokenizer": str(tmp_path)}, "tokenizer=.*: no tokenizer files there"),
        ({"dtype": "int8"}, "dtype=.int8.: must be one of float32, bfloat16, float16, auto, half"),
        ({"startup_timeout": float("nan")}, "startup_timeout=nan: must be a finite number"),
    ]:
        with pytest.raises(ValueError, match=message):
            LLM(str(tiny), in_process=True, num_blocks=64, **kwargs)


def test_seed_minus_one_samples_afresh_on_every_call(llm):
    p = SamplingParams(n=2, seed=-1, temperature=2.0, max_tokens=8, ignore_eos=True)
    runs = [[c.token_ids for c in llm.generate([[5, 6, 7]], p)[0].outputs] for _ in range(2)]
    assert runs[0] != runs[1]  # (a fixed seed gives the same samples on every call)
    fixed = p.replace(seed=3)
    assert llm.generate([[5, 6, 7]], fixed)[0].outputs[1].token_ids == (
        llm.generate([[5, 6, 7]], fixed.replace(n=1, seed=4))[0].token_ids
    )


def test_request_ids_and_attributes_are_vllms(llm):
    """Request ids are numbers in submission order (vLLM's; RL code sorts by ``int(id)``);
    the attributes vLLM's outputs always have are there, None."""
    p = SamplingParams(temperature=0.0, max_tokens=1)
    outs = llm.generate([[1, 2], [3, 4], [5, 6]], p)
    ids = [int(o.request_id) for o in outs]
    assert ids == list(range(ids[0], ids[0] + 3))
    (two,) = llm.generate([[1, 2]], p.replace(n=2))
    assert int(two.request_id) == ids[-1] + 1 and len(two.outputs) == 2
    out = outs[0]
    assert (out.metrics, out.lora_request, out.encoder_prompt) == (None, None, None)
    assert (out.encoder_prompt_token_ids, out.kv_transfer_params) == (None, None)
    assert out.multi_modal_placeholders == {} and out.outputs[0].lora_request is None


class _Bar:
    """A tqdm stand-in that records what the bar was told."""

    made: list[_Bar] = []

    def __init__(self, total: int, desc: str, **kw) -> None:
        self.total, self.desc, self.n, self.closed = total, desc, 0, False
        _Bar.made.append(self)

    def update(self, k: int) -> None:
        self.n += k

    def close(self) -> None:
        self.closed = True


def test_use_tqdm_counts_prompts_whose_samples_all_finished(llm, monkeypatch):
    """vLLM's ``use_tqdm``: a class is used as given; True draws tqdm's bar only where a
    person watches (stderr a terminal, or a notebook); False none."""
    _Bar.made.clear()
    p = SamplingParams(n=2, temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate([[1, 2], [3, 4], [5]], p, use_tqdm=_Bar)
    (bar,) = _Bar.made
    assert (bar.total, bar.n, bar.closed, bar.desc) == (3, 3, True, "Processed prompts")
    import rltserve.llm as llm_module

    monkeypatch.setattr(llm_module, "tqdm", _Bar)
    llm.generate([[1, 2]], p, use_tqdm=False)
    monkeypatch.setattr(llm_module, "progress_enabled", lambda: False)
    llm.generate([[1, 2]], p)
    assert len(_Bar.made) == 1
    monkeypatch.setattr(llm_module, "progress_enabled", lambda: True)
    llm.chat([{"role": "user", "content": "hi"}], p)
    assert len(_Bar.made) == 2 and _Bar.made[1].n == 1 and _Bar.made[1].closed
    llm.chat([{"role": "user", "content": "hi"}], p, use_tqdm=False)
    assert len(_Bar.made) == 2
    # A Jupyter kernel: stderr is no terminal, yet the cell shows the bar.
    monkeypatch.setattr(llm_module, "progress_enabled", lambda: False)
    kernel = type("ZMQInteractiveShell", (), {})()
    fake_ipython = type(sys)("IPython")
    fake_ipython.get_ipython = lambda: kernel
    monkeypatch.setitem(sys.modules, "IPython", fake_ipython)
    llm.generate([[1, 2]], p)
    assert len(_Bar.made) == 3
    fake_ipython.get_ipython = lambda: None  # (IPython imported, no kernel: a script)
    llm.generate([[1, 2]], p)
    assert len(_Bar.made) == 3
    with pytest.raises(ValueError, match="use_tqdm='yes': must be a bool or a tqdm class"):
        llm.generate([[1, 2]], p, use_tqdm="yes")


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm, tiny):
    """vLLM's left truncation: k keeps the last k prompt tokens (the output is the truncated
    prompt's, ``prompt_token_ids`` what ran, ``prompt`` the text given), -1 as many as leave
    room for a token (a prompt longer than the context runs); the engine truncates a direct
    caller's prompt too; bad values name the field."""
    ids = [(7 * i) % 500 + 3 for i in range(300)]  # beyond the context of 256
    plain = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    cut = plain.replace(truncate_prompt_tokens=10)
    (want,) = llm.generate([ids[-10:]], plain)
    (out,) = llm.generate([ids], cut)
    assert out.prompt_token_ids == ids[-10:]
    assert out.outputs[0].token_ids == want.outputs[0].token_ids
    (out,) = llm.generate([ids], plain.replace(truncate_prompt_tokens=-1))
    assert out.prompt_token_ids == ids[-255:] and len(out.outputs[0].token_ids) == 1
    text = "one two three four five six seven"
    (out,) = llm.generate([text], cut.replace(truncate_prompt_tokens=3))
    assert out.prompt == text and out.prompt_token_ids == llm.tokenizer.encode(text)[-3:]
    (short,) = llm.generate([[5, 6]], cut)
    assert short.prompt_token_ids == [5, 6]
    with pytest.raises(ValueError, match="truncate_prompt_tokens=257: greater than"):
        llm.generate([ids], plain.replace(truncate_prompt_tokens=257))
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match=f"truncate_prompt_tokens={bad}"):
            SamplingParams(truncate_prompt_tokens=bad)
    core = make_core(tiny, max_model_len=256)
    try:
        run = run_core(core, [ids], [cut])
        assert run.tokens["r0"] == want.outputs[0].token_ids
    finally:
        core.shutdown()


def test_cache_salt_of_a_prompt_dict_separates_prefix_cache_tenants(llm):
    """vLLM's ``{"prompt_token_ids": ids, "cache_salt": s}``: blocks cached under one salt are
    reused under the same salt only; the outputs do not depend on it."""
    ids = [(11 * i) % 500 + 3 for i in range(40)]
    p = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    def run(**salt):
        (out,) = llm.generate([{"prompt_token_ids": ids, **salt}], p)
        return out.num_cached_tokens, out.outputs[0].token_ids

    cached, want = run(cache_salt="a")
    assert cached == 0
    assert run(cache_salt="b") == (0, want) and run() == (0, want)
    assert run(cache_salt="a")[0] > 0 and run(cache_salt=None)[0] > 0  # (None: no salt)
    (text,) = llm.generate([{"prompt": "salted text", "cache_salt": "c"}], p)
    assert text.prompt == "salted text"
    for bad in ("", 5):
        with pytest.raises(ValueError, match="cache_salt=.*must be a non-empty string"):
            llm.generate([{"prompt_token_ids": ids, "cache_salt": bad}], p)
    with pytest.raises(ValueError, match="cache_salt=''"):
        SamplingParams(cache_salt="")


def test_a_stop_on_the_models_end_id_reports_no_stop_reason(llm):
    """vLLM checks the tokenizer's EOS before stop_token_ids: that id listed in stop_token_ids
    reports stop_reason None, unless ignore_eos (then it stops as a stop token and reports its
    id). Ouro's <|im_end|> (2), an end id the engine adds, reports itself when listed."""
    eos = llm.tokenizer.eos_token_id
    assert (eos, 2) == llm.info.eos_token_ids[:2] == (0, 2)
    for token, params, reason in [
        (eos, SamplingParams(stop_token_ids=[eos]), None),
        (eos, SamplingParams(stop_token_ids=[eos], ignore_eos=True), eos),
        (2, SamplingParams(stop_token_ids=[2]), 2),
        (2, SamplingParams(), None),
    ]:
        params = params.replace(temperature=0.0, max_tokens=3, logit_bias={token: 100.0})
        out = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0]
        assert (out.token_ids, out.finish_reason, out.stop_reason) == ([token], "stop", reason)
