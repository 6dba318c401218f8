"""The vLLM-compatible offline API's engine arguments and defaults: vLLM's ``LLM`` keywords
(taken, overriding others, refused), skip_tokenizer_init, a tokenizer directory, the KV budget of
a device share and dtype names, the chat template's special tokens, SamplingParams' vLLM field
conventions and the checkpoint's generation config (sampling defaults, overrides, end ids)."""

from __future__ import annotations

import json

import pytest

from rltserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def test_skip_tokenizer_init_runs_on_token_ids_only(tiny):
    with LLM(str(tiny), in_process=True, num_blocks=64, skip_tokenizer_init=True) as llm:
        assert llm.tokenizer is None
        with pytest.raises(ValueError, match="no tokenizer"):
            llm.generate(["text"])
        (out,) = llm.generate(
            [{"prompt_token_ids": [3, 4, 5]}], SamplingParams(temperature=0.0, max_tokens=3)
        )
        assert out.outputs[0].text == "" and len(out.outputs[0].token_ids) == 3


def test_chat_adds_no_special_tokens_besides_the_templates(tmp_path):
    """Huginn's tokenizer wraps a text in begin and end tokens; its chat template already
    begins with one, and a prompt ended by an end token would tell the model the text ended."""
    from rltserve.models.presets import make_model

    huginn = make_model("huginn-tiny", tmp_path / "huginn")
    with LLM(str(huginn), in_process=True, num_blocks=64, max_model_len=128) as llm:
        (out,) = llm.chat([{"role": "user", "content": "Hi"}], GREEDY)
        tok = llm.tokenizer
        assert out.prompt_token_ids == tok.encode(out.prompt, add_special_tokens=False)
        assert tok.encode(out.prompt) != out.prompt_token_ids  # (the wrapping it leaves out)


def test_engine_arguments_that_override_others(tiny):
    """enforce_eager turns cuda_graphs off (vLLM's: nothing is captured, so a CPU engine
    starts); a max_num_batched_tokens below prefill_chunk_size bounds the chunks; seed=None
    draws a fresh engine seed for each LLM."""
    kw = {"in_process": True, "num_blocks": 64, "max_model_len": 128, "seed": None}
    with (
        LLM(
            str(tiny), cuda_graphs=True, enforce_eager=True, max_num_batched_tokens=256, **kw
        ) as eager,
        LLM(str(tiny), **kw) as other,
    ):
        assert not eager.config.execution.cuda_graphs
        assert eager.config.scheduler.prefill_chunk_size == 256
        assert eager.config.model.seed != other.config.model.seed
        assert len(eager.generate([list(range(3, 40))], GREEDY)[0].token_ids) == 4


def test_a_tokenizer_directory_serves_a_checkpoint_without_one(tiny, tmp_path):
    from rltserve.models.presets import make_model

    bare = make_model("ouro-tiny", tmp_path / "bare", tokenizer=False)
    kw = {"in_process": True, "num_blocks": 64, "max_model_len": 128}
    with LLM(str(bare), tokenizer=str(tiny), **kw) as llm:
        (out,) = llm.generate(["Hello there"], GREEDY)
        assert out.prompt_token_ids == llm.tokenizer.encode("Hello there")
        assert out.outputs[0].text == llm.tokenizer.decode(out.token_ids)


def test_a_device_share_is_split_between_the_stages_on_one_device(tiny, monkeypatch):
    """gpu_memory_utilization with disaggregate=True and both stages on the model's device:
    each stage's KV budget is half of what the share leaves."""
    import rltserve.vllm_args as vllm_args

    asked = []

    class Sized(Exception):
        pass

    def kv_cache_gb_for(utilization, device, model, dtype, stages=1):
        asked.append((utilization, stages))
        raise Sized  # (no stage needs to start)

    monkeypatch.setattr(vllm_args, "kv_cache_gb_for", kv_cache_gb_for)
    for kw in ({}, {"disaggregate": True}, {"disaggregate": True, "prefill_device": "cpu"}):
        with pytest.raises(Sized):
            LLM(str(tiny), gpu_memory_utilization=0.5, **kw)
    assert asked == [(0.5, 1), (0.5, 2), (0.5, 2)]


def test_dtype_names_and_the_kv_budget_of_a_device_share(tmp_path):
    from rltserve.preflight import resolve_dtype
    from rltserve.vllm_args import ACTIVATION_RESERVE_BYTES, kv_budget_bytes, kv_cache_gb_for

    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert resolve_dtype("auto", str(tmp_path)) == "bfloat16"
    assert resolve_dtype("half", str(tmp_path)) == "float16"
    assert resolve_dtype("float", None) == "float32"
    assert resolve_dtype("auto", None) == "float32"  # the demo model
    assert resolve_dtype("bfloat16", str(tmp_path)) == "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float64"}))
    assert resolve_dtype("auto", str(tmp_path)) == "float32"  # one the engine does not run
    gib = 2**30
    assert kv_budget_bytes(0.5, 80 * gib, 3 * gib) == 40 * gib - 3 * gib - ACTIVATION_RESERVE_BYTES
    two = kv_budget_bytes(0.5, 80 * gib, 3 * gib, stages=2)  # prefill and decode stages
    assert two == (40 * gib - 2 * (3 * gib + ACTIVATION_RESERVE_BYTES)) // 2
    with pytest.raises(ValueError, match="leave no room for the KV cache"):
        kv_budget_bytes(0.1, 16 * gib, 3 * gib)
    assert kv_cache_gb_for(0.9, "cpu", str(tmp_path), "float32") is None  # kv_cache_gb's job
    with pytest.raises(ValueError, match="gpu_memory_utilization=0: must be in"):
        kv_cache_gb_for(0, "cpu", str(tmp_path), "float32")


def test_vllm_field_conventions_of_sampling_params():
    """vLLM's: seed -1 means unset; stop and stop_token_ids are lists (empty when not given)
    that the caller may extend; a clone copies them."""
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-2).seed == -2
    with pytest.raises(ValueError, match="seed=-1.0: must be an int"):
        SamplingParams(seed=-1.0)
    p = SamplingParams(stop="x", stop_token_ids=(1,), allowed_token_ids=(4, 2))
    assert (p.stop, p.stop_token_ids, p.allowed_token_ids) == (["x"], [1], [4, 2])
    assert (SamplingParams().stop, SamplingParams().stop_token_ids) == ([], [])
    q = p.clone()
    q.stop.append("y")
    assert p.stop == ["x"] and q.clone().stop == ["x", "y"]
    given = ["a"]
    r = SamplingParams(stop=given)
    given.append("b")
    assert r.stop == ["a"]  # a copy: the caller's list may change
    with pytest.raises(ValueError, match="stop=.*must be non-empty strings"):
        SamplingParams(stop=[""])
    # (no effect with the fast tokenizers checkpoints load here, as in vLLM)
    assert not SamplingParams(spaces_between_special_tokens=False).spaces_between_special_tokens
    with pytest.raises(ValueError, match="spaces_between_special_tokens=1: must be a bool"):
        SamplingParams(spaces_between_special_tokens=1)


def test_default_sampling_params_come_from_the_generation_config(tiny, tmp_path):
    """vLLM's ``generation_config="auto"``: the checkpoint's sampling defaults are what
    ``generate`` uses without params; ``"vllm"`` ignores them; a folder supplies them."""
    import shutil

    model = tmp_path / "m"
    shutil.copytree(tiny, model)
    config = {"temperature": 0.0, "top_k": 7, "max_new_tokens": 5, "do_sample": True}
    (model / "generation_config.json").write_text(json.dumps(config))
    kw = {"in_process": True, "num_blocks": 64, "max_model_len": 128}
    with LLM(str(model), **kw) as llm:
        d = llm.get_default_sampling_params()
        assert (d.temperature, d.top_k, d.max_tokens, d.top_p) == (0.0, 7, 5, 1.0)
        assert d is not llm.get_default_sampling_params()
        (out,) = llm.generate([[5, 6, 7]])
        want = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=5))
        assert out.token_ids == want[0].token_ids and len(out.token_ids) <= 5
    with LLM(str(model), generation_config="vllm", **kw) as llm:
        assert llm.get_default_sampling_params() == SamplingParams()
    with LLM(str(tiny), generation_config=str(model), **kw) as llm:
        assert llm.get_default_sampling_params().max_tokens == 5
        (model / "generation_config.json").write_text(json.dumps({"temperature": -1}))
        with pytest.raises(ValueError, match="generation_config.json: temperature=-1"):
            llm.get_default_sampling_params()
    with pytest.raises(ValueError, match="generation_config='nowhere': must be 'auto', 'vllm'"):
        LLM(str(tiny), generation_config="nowhere", **kw)


def test_override_generation_config_is_laid_over_the_defaults(tiny, tmp_path):
    """vLLM's ``override_generation_config``: its keys replace the generation config's (None
    drops one) under ``generation_config="auto"`` and ``"vllm"`` alike; a key that is no
    sampling default is refused (``vllm_args.generation_overrides``)."""
    import shutil

    model = tmp_path / "m"
    shutil.copytree(tiny, model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": 7}))
    kw = {"in_process": True, "num_blocks": 64, "max_model_len": 128}
    over = {"temperature": 0.0, "max_new_tokens": 5, "top_k": None}
    with LLM(str(model), override_generation_config=over, **kw) as llm:
        d = llm.get_default_sampling_params()
        assert (d.temperature, d.top_k, d.max_tokens) == (0.0, -1, 5)
    with LLM(
        str(model), generation_config="vllm", override_generation_config={"top_p": 0.5}, **kw
    ) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(top_p=0.5)
    with pytest.raises(ValueError, match="'max_tokens' is not a sampling default"):
        LLM(str(model), override_generation_config={"max_tokens": 5}, **kw)


def test_generation_config_eos_ids_end_generation(tiny, tmp_path):
    """As in vLLM, ``generation_config.json``'s ``eos_token_id`` ends generation like the
    model's own (whatever ``generation_config`` says of sampling defaults), and a stop on one
    that is not the model's own reports it as ``stop_reason`` (vLLM adds such ids to
    ``stop_token_ids``); ``ignore_eos`` goes past it."""
    import shutil

    model = tmp_path / "m"
    shutil.copytree(tiny, model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [7]}))
    kw = {"in_process": True, "num_blocks": 64, "max_model_len": 128}
    forced = SamplingParams(temperature=0.0, max_tokens=4, logit_bias={7: 100.0})
    for config in ("auto", "vllm"):
        with LLM(str(model), generation_config=config, **kw) as llm:
            (out,) = llm.generate([[5, 6]], forced)
            assert (out.token_ids, out.outputs[0].finish_reason) == ([7], "stop")
            assert out.outputs[0].stop_reason == 7 and llm.info.stop_reason_ids == (7,)
            (past,) = llm.generate([[5, 6]], forced.replace(ignore_eos=True))
            assert past.token_ids == [7] * 4
    with LLM(str(tiny), **kw) as llm:
        assert llm.generate([[5, 6]], forced)[0].token_ids == [7] * 4


def test_more_vllm_engine_arguments(tiny):
    import torch

    kw = {"in_process": True, "num_blocks": 64, "max_model_len": 128}
    with LLM(
        str(tiny),
        seed=None,
        dtype=torch.float32,
        swap_space=2,
        tokenizer_mode="auto",
        task="generate",
        cpu_offload_gb=0,
        pipeline_parallel_size=1,
        data_parallel_size=1,
        max_seq_len_to_capture=8192,
        reasoning_parser="deepseek_r1",  # (rltserve splits <think>...</think> itself)
        load_format="dummy",  # (verl's: the checkpoint's weights, until update_weights)
        **kw,
    ) as llm:
        assert llm.config.model.dtype == "float32" and llm.config.cache.swap_space_gb == 2
        assert isinstance(llm.config.model.seed, int)
    for name, value in [
        ("pipeline_parallel_size", 2),
        ("cpu_offload_gb", 4),
        ("task", "embed"),
        ("reasoning_parser", "granite"),
    ]:
        with pytest.raises(ValueError, match=f"{name}={value!r}: not supported"):
            LLM(str(tiny), **{name: value}, **kw)


def test_vllms_engine_arguments_at_harmless_values_are_accepted():
    """vLLM's LLM(...) arguments at their defaults (or values asking for nothing rltserve
    lacks) pass; a value asking for more is a ValueError saying why."""
    from rltserve.vllm_args import check_inert

    check_inert(
        {
            "runner": "generate",
            "tokenizer_revision": None,
            "code_revision": None,
            "served_model_name": ["ouro"],
            "disable_sliding_window": False,
            "disable_log_requests": True,
            "enable_prompt_embeds": False,
            "kv_transfer_config": None,
            "structured_outputs_config": None,
            "guided_decoding_backend": "auto",
            "hf_token": None,
            "max_num_partial_prefills": 1,
            "logits_processors": None,
            "prefix_caching_hash_algo": "sha256",
        }
    )
    check_inert({"structured_outputs_config": {"backend": "xgrammar"}})  # (outlines-core's)
    for name, value, why in [
        ("runner", "pooling", "rltserve generates"),
        ("tokenizer_revision", "v2", "the tokenizer loads at the model's revision"),
        ("enable_prompt_embeds", True, "not embeddings"),
        ("kv_transfer_config", {"kv_connector": "x"}, "disaggregate=True"),
        ("structured_outputs_config", "xgrammar", "StructuredOutputsConfig"),
        ("max_num_partial_prefills", 0, "an int >= 1"),
        ("logits_processors", [print], "no custom logits processors"),
    ]:
        with pytest.raises(ValueError, match=f"{name}=.*: not supported \\(.*{why}"):
            check_inert({name: value})


def test_reasoning_parsers_of_think_tags_are_what_rltserve_does(capsys):
    """vLLM's ``reasoning_parser`` (LLM's argument, the commands' ``--reasoning-parser``, one
    table): a parser of <think>...</think> spans, or none, asks for the split rltserve makes
    itself; a parser of another format is refused, saying so."""
    from rltserve.cli import main
    from rltserve.vllm_args import check_inert

    for value in (None, "", "deepseek_r1", "qwen3", "glm45", "minimax_m2"):
        check_inert({"reasoning_parser": value})
    why = (
        "not supported (rltserve splits reasoning at <think> and </think> itself; the parsers "
        "of that format: deepseek_r1, qwen3, glm45, minimax_m2)"
    )
    with pytest.raises(ValueError) as err:
        check_inert({"reasoning_parser": "granite"})
    assert str(err.value) == f"reasoning_parser='granite': {why}"
    assert main(["serve", "--reasoning-parser", "mistral"]) == 2
    assert capsys.readouterr().err == f"rltserve: error: --reasoning-parser mistral: {why}\n"


def test_the_engine_commands_vllm_flags_are_llms_arguments():
    """Each vLLM flag of generate, serve and bench (``vllm_args.FLAGS``) is an argument LLM
    takes, checked by the same table: the commands and LLM(...) accept the same values."""
    import inspect

    from rltserve.vllm_args import FLAGS, INERT, NAMED

    named = set(inspect.signature(LLM).parameters)
    assert set(NAMED) <= named and not set(INERT) & named
    assert set(FLAGS) <= set(INERT) | set(NAMED)
