"""What RL frameworks (TRL, OpenRLHF, verl, open-instruct) do with vLLM's offline API, done to
rltserve: SamplingParams as they build and change them, the LLM arguments they pass on every
construction, hub ids, per-prompt priorities, chat options, and the prefix-cache reset after a
weight sync."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rltserve import LLM, SamplingParams
from rltserve.cli import build_parser
from rltserve.http.cli import serve_configs
from rltserve.models.tokenizer import load_tokenizer
from rltserve.preflight import resolve_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
COMMIT = "0123456789abcdef0123456789abcdef01234567"  # a snapshot's name: its commit hash


@pytest.fixture(scope="module")
def llm(tiny):
    # (priority scheduling: the per-prompt priorities below are refused under fcfs)
    kw = {"num_blocks": 128, "max_model_len": 256, "scheduling_policy": "priority"}
    with LLM(str(tiny), in_process=True, **kw) as llm:
        yield llm


# ---------------------------------------------------------------- SamplingParams


def test_defaults_are_vllms():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.max_tokens, p.n) == (1.0, -1, 16, 1)
    assert not p.greedy
    # TRL's GRPOConfig passes top_k=0; OpenRLHF stop_token_ids=None; older TRL the
    # constrained-decoding keys as None.
    q = SamplingParams(top_k=0, stop_token_ids=None, guided_decoding=None, structured_outputs=None)
    assert q.top_k == 0 and q.stop_token_ids == [] and q.stop == []
    # vLLM >= 0.10 moves guided_decoding to structured_outputs (a dict of its fields too).
    r = SamplingParams(guided_decoding={"regex": "a+"})
    assert r.structured_outputs.regex == "a+" and r.guided_decoding is None
    assert SamplingParams(extra_args={"k": 1}).extra_args == {"k": 1}
    with pytest.raises(ValueError, match="top_k=-2"):
        SamplingParams(top_k=-2)


def test_top_k_zero_samples_as_disabled(llm):
    prompt = [[3, 5, 7]]
    seeded = dict(temperature=1.0, max_tokens=6, ignore_eos=True, seed=4)
    (a,) = llm.generate(prompt, SamplingParams(top_k=0, **seeded))
    (b,) = llm.generate(prompt, SamplingParams(top_k=-1, **seeded))
    assert a.token_ids == b.token_ids


def test_params_can_be_changed_and_each_call_takes_a_copy(llm):
    """OpenRLHF sets ``max_tokens`` on the object; verl ``setattr``s fields; open-instruct
    clones then sets. A call uses the values at the time of the call."""
    p = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    p.max_tokens = 3
    (out,) = llm.generate([[1, 2, 3]], p)
    assert len(out.token_ids) == 3
    q = p.clone()
    q.max_tokens = 2
    assert (p.max_tokens, len(llm.generate([[1, 2, 3]], q)[0].token_ids)) == (3, 2)
    p.stop = ["x"]  # a list set later is stored as the constructor stores it
    assert p.clone().stop == ["x"]
    p.max_tokens = 0  # checked when submitted
    with pytest.raises(ValueError, match="max_tokens=0"):
        llm.generate([[1, 2, 3]], p)


# ---------------------------------------------------------------- LLM arguments


def test_the_arguments_trl_and_verl_pass_are_accepted(tiny):
    with LLM(
        str(tiny),
        in_process=True,
        num_blocks=64,
        enable_sleep_mode=True,
        model_impl="vllm",
        distributed_executor_backend="external_launcher",
        quantization=None,
        kv_cache_dtype="auto",
        load_format="auto",
        enable_chunked_prefill=True,
        disable_log_stats=True,
        disable_custom_all_reduce=True,
        max_logprobs=20,
        limit_mm_per_prompt={"image": 0},
        enable_lora=False,
        max_lora_rank=16,
        worker_extension_cls=None,
        speculative_config=None,
        revision=None,
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4], "level": 3},  # (verl's)
        download_dir=None,
        disable_cascade_attn=True,
        num_scheduler_steps=1,
        disable_async_output_proc=True,
        hf_overrides={},
    ) as llm:
        assert llm.generate([[1, 2]], GREEDY)[0].finish_reason == "length"


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"quantization": "fp8"}, "quantization='fp8': not supported"),
        ({"kv_cache_dtype": "fp8"}, "the KV cache has the model's dtype"),
        ({"enable_lora": True}, "LoRA"),
        ({"load_format": "pt"}, "load_format='pt'"),
        ({"distributed_executor_backend": "ray"}, "one device"),
        ({"revision": "main"}, "revision='main': only for a Hugging Face repo id"),
        ({"hf_overrides": {"rope_theta": 1e6}}, "loads the checkpoint's config as it is"),
        # (vLLM's False runs each prompt whole; rltserve has no such mode)
        (
            {"enable_chunked_prefill": False},
            "enable_chunked_prefill=False: not supported (rltserve "
            "always prefills prompts in chunks of at most prefill_chunk_size tokens",
        ),
    ],
)
def test_arguments_asking_for_what_is_not_built_are_refused(tiny, kw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LLM(str(tiny), in_process=True, **kw)


def test_an_unknown_argument_is_a_type_error(tiny):
    with pytest.raises(TypeError, match="unexpected keyword argument 'swap_spaec'"):
        LLM(str(tiny), in_process=True, swap_spaec=4)


def test_a_hub_id_resolves_from_the_local_cache_only(tiny, tmp_path, monkeypatch):
    """TRL passes ``model.name_or_path``, usually a hub id: found in the Hugging Face cache
    (a snapshot and the ref naming it), never downloaded."""
    cache = tmp_path / "hub"
    snapshot = cache / "models--someorg--ouro-tiny" / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for f in tiny.iterdir():
        (snapshot / f.name).symlink_to(f)
    (cache / "models--someorg--ouro-tiny" / "refs").mkdir()
    (cache / "models--someorg--ouro-tiny" / "refs" / "main").write_text(COMMIT)
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    assert Path(resolve_model("someorg/ouro-tiny")) == snapshot
    assert Path(resolve_model("someorg/ouro-tiny", revision=COMMIT)) == snapshot
    with LLM("someorg/ouro-tiny", in_process=True, num_blocks=64) as llm:
        assert len(llm.generate([[1, 2]], GREEDY)[0].token_ids) == 5
    # The commands take repo ids as LLM does; serve names the model by its id.
    args = build_parser().parse_args(["serve", "--model", "someorg/ouro-tiny"])
    server_config, engine_config = serve_configs(args)
    assert Path(engine_config.model.model) == snapshot
    assert server_config.served_model_name == "someorg/ouro-tiny"
    args = build_parser().parse_args(
        ["serve", "--model", "someorg/ouro-tiny", "--served-model-name", "mine"]
    )
    assert serve_configs(args)[0].served_model_name == ("mine",)  # (a given name is kept)
    args = build_parser().parse_args(["serve", "--model", str(tiny)])
    assert serve_configs(args)[0].served_model_name is None  # a directory: its name
    with pytest.raises(ValueError) as err:
        resolve_model("someorg/missing")
    assert str(err.value) == (
        "model='someorg/missing': no such directory, nor a Hugging Face repo id in the local "
        "cache; rltserve never downloads (`hf download someorg/missing`; huggingface-cli "
        "download on huggingface_hub < 0.34)"
    )
    with pytest.raises(ValueError, match="at revision 'v2'"):
        resolve_model("someorg/ouro-tiny", revision="v2")
    # What a tokenizer's download leaves (config and tokenizer files): no weights to load.
    partial = cache / "models--someorg--tok-only" / "snapshots" / COMMIT
    partial.mkdir(parents=True)
    (partial / "config.json").symlink_to(tiny / "config.json")
    (cache / "models--someorg--tok-only" / "refs").mkdir()
    (cache / "models--someorg--tok-only" / "refs" / "main").write_text(COMMIT)
    with pytest.raises(ValueError, match="the local cache holds no weights of it"):
        resolve_model("someorg/tok-only")


def cached(cache: Path, repo: str, files) -> Path:
    """A Hugging Face cache entry of ``repo`` in ``cache`` (a hub folder): ``files`` linked
    from its snapshot, and the ref naming it."""
    entry = cache / ("models--" + repo.replace("/", "--"))
    snapshot = entry / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for f in files:
        (snapshot / f.name).symlink_to(f)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(COMMIT)
    return snapshot


def test_tokenizer_download_dir_and_updates_take_repo_ids_as_the_model_does(tiny, tmp_path):
    """vLLM's ``tokenizer`` may be a repo id, ``download_dir`` is the cache to look in; the
    model config keeps the id as given, and weight updates resolve ids too."""
    cache = tmp_path / "hub"  # (not the default cache: found through download_dir alone)
    snapshot = cached(cache, "someorg/ouro-tiny", tiny.iterdir())
    no_weights = [f for f in tiny.iterdir() if not f.name.endswith(".safetensors")]
    tok = cached(cache, "someorg/tok", no_weights)
    kw = {"download_dir": cache, "in_process": True, "num_blocks": 64}
    with LLM("someorg/ouro-tiny", tokenizer="someorg/tok", **kw) as llm:
        assert llm.llm_engine.model_config.model == "someorg/ouro-tiny"
        assert (llm.config.model.model, llm.config.model.tokenizer) == (str(snapshot), str(tok))
        (out,) = llm.generate(["hello"], GREEDY)
        assert out.prompt_token_ids == load_tokenizer(tiny).encode_prompt("hello")
        assert llm.update_weights("someorg/ouro-tiny") == 1
        with pytest.raises(ValueError, match=r"^weights='someorg/tok': the local cache holds no"):
            llm.update_weights("someorg/tok")
    with pytest.raises(ValueError) as err:
        LLM(str(tiny), tokenizer="someorg/missing", **kw)
    assert str(err.value) == (
        f"tokenizer='someorg/missing': no such directory, nor a Hugging Face repo id in the "
        f"local cache ({cache}); rltserve never downloads (`hf download someorg/missing "
        f"--cache-dir {cache}`; huggingface-cli download on huggingface_hub < 0.34)"
    )
    empty = cached(cache, "someorg/config-only", [tiny / "config.json"])
    with pytest.raises(ValueError) as err:
        LLM(str(tiny), tokenizer="someorg/config-only", **kw)
    assert str(err.value) == (
        f"tokenizer='someorg/config-only': no tokenizer files in its cached snapshot {empty}"
    )
    with pytest.raises(ValueError, match=r"^download_dir=3: must be None or a path$"):
        LLM(str(tiny), download_dir=3, in_process=True)


def test_the_commands_take_revision_tokenizer_and_download_dir(tiny, tmp_path):
    cache = tmp_path / "hub"
    snapshot = cached(cache, "someorg/ouro-tiny", tiny.iterdir())
    for command in (["generate"], ["bench", "offline"], ["serve"]):
        args = build_parser().parse_args(
            [*command, "--model", "someorg/ouro-tiny", "--revision", COMMIT]
            + ["--tokenizer", "someorg/ouro-tiny", "--download-dir", str(cache)]
        )
        assert (args.model, args.revision, args.tokenizer, args.download_dir) == (
            "someorg/ouro-tiny",
            COMMIT,
            "someorg/ouro-tiny",
            str(cache),
        ), command
    server_config, engine_config = serve_configs(args)
    assert (engine_config.model.model, engine_config.model.tokenizer) == (str(snapshot),) * 2
    # (the revision is spent on finding the ids; download_dir stays, for weight updates)
    assert (engine_config.model.revision, engine_config.model.download_dir) == (None, str(cache))
    assert server_config.served_model_name == "someorg/ouro-tiny"
    args = build_parser().parse_args(["serve", "--model", str(tiny), "--revision", "v2"])
    with pytest.raises(ValueError, match=r"^revision='v2': only for a Hugging Face repo id$"):
        serve_configs(args)


# ---------------------------------------------------------------- generate and chat options


def test_per_prompt_priorities_and_lora_request_none(llm):
    outs = llm.generate([[1, 2], [3, 4]], GREEDY, priority=[1, np.int64(0)], lora_request=None)
    assert [len(o.token_ids) for o in outs] == [5, 5]
    for bad in ([1], [1, 2, 3], "ab"):
        with pytest.raises(ValueError, match=r"priority: must be a list of one int per prompt \(2"):
            llm.generate([[1, 2], [3, 4]], GREEDY, priority=bad)
    with pytest.raises(ValueError, match="lora_request: LoRA adapters are not supported"):
        llm.generate([[1, 2]], GREEDY, lora_request=object())


def test_fcfs_refuses_priorities_before_any_prompt_runs(tiny, monkeypatch):
    with LLM(str(tiny), in_process=True, num_blocks=64, max_model_len=128) as fcfs:
        added = []
        add = fcfs._client.add_request
        monkeypatch.setattr(fcfs._client, "add_request", lambda *a: added.append(a) or add(*a))
        for kw in ({"priority": [0, 1]}, {}):
            params = GREEDY if kw else GREEDY.replace(priority=-1)
            with pytest.raises(ValueError) as err:
                fcfs.generate([[1, 2], [3, 4]], params, **kw)
            assert str(err.value).startswith("priority=")
            assert "scheduling_policy='fcfs'; start it with scheduling_policy='priority'" in str(
                err.value
            )
        assert added == []
        assert len(fcfs.generate([[1, 2]], GREEDY, priority=[0])[0].token_ids) == 5


def test_per_prompt_priorities_reach_the_engine(llm, monkeypatch):
    submitted = []
    add = llm._client.add_request

    def recording(request_id, ids, params, *args):
        submitted.append((ids, params.priority))
        return add(request_id, ids, params, *args)

    monkeypatch.setattr(llm._client, "add_request", recording)
    params = GREEDY.replace(priority=5)
    llm.generate([[1, 2], [3, 4]], params, priority=[2, -1])
    assert submitted == [([1, 2], 2), ([3, 4], -1)] and params.priority == 5
    llm.generate([[1, 2]], params)
    assert submitted[-1] == ([1, 2], 5)  # without the argument: the params' own


def test_chat_takes_a_template_and_continues_the_final_message(llm):
    conversation = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello, I am"},
    ]
    (out,) = llm.chat(
        conversation, GREEDY, add_generation_prompt=False, continue_final_message=True
    )
    assert out.prompt.endswith("Hello, I am")  # left open: no end-of-turn after it
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    (out,) = llm.chat(conversation[:1], GREEDY, chat_template=template, tools=None)
    assert llm.chat(conversation[:1], GREEDY, chat_template=template, tools=[])[0].token_ids == (
        out.token_ids
    )
    assert out.prompt == "[user] Hi\n"
    with pytest.raises(ValueError, match="continue_final_message: not with add_generation_prompt"):
        llm.chat(conversation, GREEDY, continue_final_message=True)
    with pytest.raises(ValueError, match="tools: must be a list of tool definitions"):
        llm.chat(conversation[:1], GREEDY, tools="get_weather")
    with pytest.raises(ValueError, match="mm_processor_kwargs: not supported"):
        llm.chat(conversation[:1], GREEDY, mm_processor_kwargs={"num_crops": 4})


def test_cached_tokens_are_reported_and_reset_prefix_cache_forgets_them(llm):
    prompt = [list(range(1, 40))]
    llm.reset_prefix_cache()
    assert llm.generate(prompt, GREEDY)[0].num_cached_tokens == 0
    cached = llm.generate(prompt, GREEDY)[0].num_cached_tokens
    assert cached and cached % 16 == 0
    assert llm.reset_prefix_cache() is True
    assert llm.generate(prompt, GREEDY)[0].num_cached_tokens == 0


def test_weight_pairs_may_be_lists(llm, tiny):
    from safetensors.torch import load_file

    weights = load_file(str(tiny / "model.safetensors"))
    before = llm.weight_version
    assert llm.update_weights([[name, t] for name, t in weights.items()]) == before + 1


# ---------------------------------------------------------------- logprobs as TRL reads them


def test_every_sampled_token_has_a_rank_so_trl_can_sort_by_it(llm):
    """TRL's ``extract_logprobs`` sorts each position's entries by ``rank``: the sampled token
    outside the top k has its rank too (vLLM's count of logprobs >= its own)."""
    p = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, logprobs=1)
    (out,) = llm.generate([[1, 2, 3]], p)
    entries = out.outputs[0].logprobs
    for token, entry in zip(out.token_ids, entries):
        ranked = sorted(entry.items(), key=lambda x: x[1].rank)  # TRL's line
        assert isinstance(entry[token].rank, int) and entry[token].rank >= 1
        assert ranked[0][1].rank == 1
    assert any(entry[t].rank > 1 for t, entry in zip(out.token_ids, entries))


def test_processed_logprobs_follow_the_temperature(tiny):
    """TRL and OpenRLHF ask for ``logprobs_mode="processed_logprobs"``: the logprobs of the
    distribution sampled from (here: temperature), which raw logprobs are not."""
    p = SamplingParams(seed=9, max_tokens=6, ignore_eos=True, logprobs=0)
    got = {}
    for mode in ("raw_logprobs", "processed_logprobs"):
        with LLM(str(tiny), in_process=True, num_blocks=64, logprobs_mode=mode) as llm:
            for t in (0.5, 1.0):
                (out,) = llm.generate([[4, 5, 6]], p.replace(temperature=t))
                got[mode, t] = (
                    out.token_ids,
                    [e[x].logprob for x, e in zip(out.token_ids, out.outputs[0].logprobs)],
                )
    raw_half, raw_one = got["raw_logprobs", 0.5], got["raw_logprobs", 1.0]
    proc_half, proc_one = got["processed_logprobs", 0.5], got["processed_logprobs", 1.0]
    assert proc_one == raw_one  # temperature 1, no filters: the same distribution
    assert proc_half[0] == raw_half[0] and proc_half[1] != raw_half[1]
    with pytest.raises(ValueError, match="logprobs_mode='raw_logits'"):
        LLM(str(tiny), in_process=True, logprobs_mode="raw_logits")


def test_max_logprobs_bounds_what_a_request_may_ask(tiny, llm):
    p = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=25)
    with pytest.raises(ValueError, match=r"logprobs=25: more than this engine's max_logprobs \(20"):
        llm.generate([[1, 2]], p)
    vocab = llm.info.vocab_size
    with LLM(str(tiny), in_process=True, num_blocks=64, max_logprobs=-1) as wide:
        (out,) = wide.generate([[1, 2]], p)
        assert all(len(e) == 25 for e in out.outputs[0].logprobs)
        (out,) = wide.generate([[1, 2]], p.replace(logprobs=-1, prompt_logprobs=-1))
        assert all(len(e) == vocab for e in out.outputs[0].logprobs)  # every token
        assert len(out.prompt_logprobs[1]) == vocab
        with pytest.raises(ValueError, match=f"more than the vocabulary's {vocab} tokens"):
            wide.generate([[1, 2]], p.replace(logprobs=vocab + 1))


def test_multimodal_keys_set_to_none_are_text_prompts(llm):
    (out,) = llm.generate([{"prompt_token_ids": [1, 2], "multi_modal_data": None}], GREEDY)
    assert len(out.token_ids) == 5
    with pytest.raises(ValueError, match="prompt: unknown key 'multi_modal_data'"):
        llm.generate([{"prompt_token_ids": [1, 2], "multi_modal_data": {"image": 1}}], GREEDY)


def test_empty_mm_processor_kwargs_and_a_numpy_array_of_texts(llm):
    ids = [1, 2, 3]
    (out,) = llm.generate([{"prompt_token_ids": ids, "mm_processor_kwargs": {}}], GREEDY)
    assert out.token_ids == llm.generate([ids], GREEDY)[0].token_ids
    with pytest.raises(ValueError, match="prompt: unknown key 'mm_processor_kwargs'"):
        llm.generate([{"prompt_token_ids": ids, "mm_processor_kwargs": {"num_crops": 4}}])
    texts = ["Hello there", "Once"]
    got = llm.generate(np.array(texts), GREEDY)
    assert [o.prompt for o in got] == texts
    assert [o.token_ids for o in got] == [o.token_ids for o in llm.generate(texts, GREEDY)]


def test_llm_engine_has_what_openrlhf_and_lm_eval_read(llm):
    engine = llm.llm_engine
    config = engine.model_config
    assert config.max_model_len == llm.info.max_model_len == 256  # (lm-eval's read)
    assert (config.model, str(config.dtype)) == (llm.config.model.model, "torch.float32")
    assert engine.get_model_config() == config and config.get_vocab_size() == llm.info.vocab_size
    with pytest.raises(AttributeError, match=r"model_config\.hf_config: not here.*llm\.info"):
        config.hf_config  # noqa: B018
    assert engine.get_tokenizer() is engine.tokenizer is llm.get_tokenizer()
    prompt = [list(range(1, 40))]
    llm.generate(prompt, GREEDY)  # (its blocks cached)
    assert llm.generate(prompt, GREEDY)[0].num_cached_tokens > 0
    assert engine.reset_prefix_cache() is True  # (OpenRLHF's, after a weight sync)
    assert llm.generate(prompt, GREEDY)[0].num_cached_tokens == 0
    assert engine.is_sleeping() is False
    with pytest.raises(AttributeError, match=r"llm_engine\.scheduler: .*llm\.get_tokenizer\(\)"):
        engine.scheduler  # noqa: B018


def test_worker_calls_name_what_to_use_instead(llm):
    for call in (
        lambda: llm.collective_rpc("update_weight", args=("w",)),
        lambda: llm.apply_model(len),
    ):
        with pytest.raises(
            ValueError, match=r"not supported: rltserve runs the model .*update_weights"
        ):
            call()


def test_older_vllms_prompt_token_ids_keyword(llm):
    """OpenRLHF's and older vLLM-era code: ``generate(sampling_params=..., prompt_token_ids=...)``
    with a list of id lists (NumPy rows too) or one prompt's ids, optionally beside their
    texts; the same outputs as the prompt forms of today."""
    ids = [[3, 5, 7], [11, 13]]
    want = [o.token_ids for o in llm.generate(ids, GREEDY)]
    outs = llm.generate(sampling_params=GREEDY, prompt_token_ids=ids, use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    assert [o.prompt_token_ids for o in outs] == ids and outs[0].prompt is None
    rows = np.array([[3, 5, 7], [3, 5, 7]], dtype=np.int64)
    assert [o.token_ids for o in llm.generate(prompt_token_ids=rows, sampling_params=GREEDY)] == [
        want[0]
    ] * 2
    (one,) = llm.generate(prompt_token_ids=list(np.array([11, 13])), sampling_params=GREEDY)
    assert one.prompt_token_ids == [11, 13] and one.token_ids == want[1]
    (texted,) = llm.generate("the text", GREEDY, prompt_token_ids=[3, 5, 7])
    assert (texted.prompt, texted.prompt_token_ids, texted.token_ids) == (
        "the text",
        [3, 5, 7],
        want[0],
    )
    with pytest.raises(ValueError, match="prompts and prompt_token_ids: must be as many"):
        llm.generate(["a", "b"], GREEDY, prompt_token_ids=[3, 5, 7])
    with pytest.raises(ValueError, match="prompts: required"):
        llm.generate(sampling_params=GREEDY)
    with pytest.raises(ValueError, match="prompt_token_ids='abc'"):
        llm.generate(prompt_token_ids="abc")
