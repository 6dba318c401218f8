"""Checks made before a model loads: paths, dtype names, vLLM's engine arguments and the offline
API's prompt forms (``preflight``, ``vllm_args``, ``prompt_inputs``), without an engine."""

from __future__ import annotations

import json
import socket

import pytest

from rltserve.preflight import (
    check_checkpoint_dir,
    check_device,
    check_engine,
    check_listen_address,
    resolve_dtype,
    resolve_model,
)


def test_checkpoint_dir_errors_name_the_flag_and_what_is_wrong(tmp_path):
    check_checkpoint_dir(None)  # the demo model
    with pytest.raises(ValueError, match=r"^--model \S+/nope: no such checkpoint directory$"):
        check_checkpoint_dir(str(tmp_path / "nope"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"^model='\S+/file': is a file; pass the checkpoint"):
        check_checkpoint_dir(str(tmp_path / "file"), flag="model=")
    with pytest.raises(ValueError, match="has no config.json, so it is not a checkpoint"):
        check_checkpoint_dir(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    check_checkpoint_dir(str(tmp_path))


def test_a_config_json_directory_is_no_checkpoint(tmp_path):
    (tmp_path / "config.json").mkdir()
    with pytest.raises(ValueError, match="has no config.json, so it is not a checkpoint"):
        check_checkpoint_dir(str(tmp_path))


def test_a_relative_directory_named_like_a_repo_id_is_that_directory(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert resolve_model("org/name") == "org/name"
    with pytest.raises(ValueError, match="revision='main': only for a Hugging Face repo id"):
        resolve_model("org/name", revision="main")


@pytest.fixture
def no_accelerators(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.delattr(torch, "xpu", raising=False)


def test_absent_backends_are_usage_errors(no_accelerators):
    check_device("cpu")
    with pytest.raises(ValueError, match=r"^device='cuda:0': CUDA is not available \("):
        check_device("cuda:0", "device=")
    with pytest.raises(ValueError, match=r"^--device mps: MPS is not available$"):
        check_device("mps")
    with pytest.raises(ValueError, match=r"^--device xpu: XPU is not available$"):
        check_device("xpu")


def test_engine_flags_on_an_absent_device_fail_before_the_model_loads(no_accelerators):
    with pytest.raises(ValueError, match=r"^--device cuda: CUDA is not available"):
        check_engine({"device": "cuda"})


def test_an_absent_prefill_device_fails_before_the_model_loads(no_accelerators):
    with pytest.raises(ValueError, match=r"^--prefill-device cuda:1: CUDA is not available \("):
        check_engine({"disaggregate": True, "prefill_device": "cuda:1"})


def test_a_cuda_index_must_name_a_present_device(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_device("cuda")
    check_device("cuda:1")
    with pytest.raises(ValueError, match=r"^--device cuda:2: there are 2 CUDA device\(s\)$"):
        check_device("cuda:2")


@pytest.mark.parametrize(
    ("config", "want"),
    [
        ({"dtype": "bfloat16"}, "bfloat16"),  # (newer transformers write "dtype")
        ({"torch_dtype": "float16", "dtype": "bfloat16"}, "float16"),
        ({"torch_dtype": "half"}, "float16"),
        ({"torch_dtype": "bf16"}, "bfloat16"),
        ({"torch_dtype": None, "dtype": "float16"}, "float16"),
        ({}, "float32"),
        ([1], "float32"),
        ({"torch_dtype": ["bfloat16"]}, "float32"),
    ],
)
def test_auto_dtype_reads_either_config_key_and_vllm_names(tmp_path, config, want):
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert resolve_dtype("auto", str(tmp_path)) == want


def test_output_dir_may_exist_empty(tmp_path):
    from rltserve.preflight import check_output_dir

    empty = tmp_path / "empty"
    empty.mkdir()
    check_output_dir(empty, force=False)
    (empty / "x").write_text("x")
    with pytest.raises(ValueError, match="is not empty"):
        check_output_dir(empty, force=False)
    check_output_dir(empty, force=True)
    check_output_dir(tmp_path / "new" / "dir", force=False)
    assert (tmp_path / "new" / "dir").is_dir()


def test_output_dir_must_be_writable(tmp_path, monkeypatch):
    import os

    from rltserve.preflight import check_output_dir

    # (a permission bit cannot show it: root may write anywhere)
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(ValueError, match=r"^--out \S+out: is not writable$"):
        check_output_dir(tmp_path / "out", force=False)


def test_tls_files_are_checked_only_as_a_pair(tmp_path):
    from rltserve.preflight import check_tls_files

    # (one without the other is ServerConfig's error)
    check_tls_files(str(tmp_path / "cert.pem"), None)
    check_tls_files(None, str(tmp_path / "key.pem"))
    with pytest.raises(ValueError, match=r"--ssl-certfile \S+cert.pem: no such file"):
        check_tls_files(str(tmp_path / "cert.pem"), str(tmp_path / "key.pem"))


def test_tls_files_that_cannot_be_read_are_usage_errors(tmp_path, monkeypatch):
    import ssl

    from rltserve.preflight import check_tls_files

    for name in ("cert.pem", "key.pem"):
        (tmp_path / name).write_text("x")

    def unreadable(self, certfile, keyfile=None, password=None):
        raise PermissionError(13, "Permission denied")  # (root reads any file)

    monkeypatch.setattr(ssl.SSLContext, "load_cert_chain", unreadable)
    with pytest.raises(ValueError, match=r"cannot load them \(\[Errno 13\] Permission denied\)"):
        check_tls_files(str(tmp_path / "cert.pem"), str(tmp_path / "key.pem"))


def test_a_port_left_in_time_wait_by_a_server_can_be_listened_on():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = server.accept()
        conn.close()  # the server's side closes first: its end of the port waits in TIME_WAIT
        client.close()
    check_listen_address("127.0.0.1", port)


# --------------------------------------------------------------------------- vLLM arguments


def test_inert_arguments_take_values_of_the_right_type_only():
    from rltserve.vllm_args import check_inert

    check_inert({"cpu_offload_gb": 0.0, "limit_mm_per_prompt": {"image": 0}, "enable_lora": False})
    for name, value in (("enable_lora", 0), ("pipeline_parallel_size", True), ("task", b"auto")):
        with pytest.raises(ValueError, match=rf"^{name}={value!r}: not supported \("):
            check_inert({name: value})
    with pytest.raises(
        ValueError, match=r"^enable_sleep_mode='yes': not supported \(wrong type\)$"
    ):
        check_inert({"enable_sleep_mode": "yes"})


def test_inert_arguments_take_the_unset_values_frameworks_pass():
    from rltserve.vllm_args import check_inert

    unset = {
        "limit_mm_per_prompt": None,
        "enable_chunked_prefill": None,
        "worker_extension_cls": "",
        "distributed_executor_backend": None,
    }
    for name, value in unset.items():
        check_inert({name: value})
    with pytest.raises(ValueError, match=r"^worker_extension_cls='x.Ext': not supported \(no"):
        check_inert({"worker_extension_cls": "x.Ext"})


def test_inert_arguments_of_verl_and_vllms_performance_switches():
    from rltserve.vllm_args import check_inert

    check_inert(
        {
            "compilation_config": {"cudagraph_capture_sizes": [1, 2]},
            "disable_cascade_attn": False,
            "num_scheduler_steps": 8,
            "disable_async_output_proc": True,
            "hf_overrides": None,
        }
    )
    check_inert({"compilation_config": 3, "hf_overrides": {}})
    for name, value, why in (
        ("num_scheduler_steps", 0, "an int >= 1"),
        ("hf_overrides", {"rope_theta": 1.0}, "rltserve loads the checkpoint's config as it is"),
    ):
        with pytest.raises(ValueError, match=rf"^{name}=.*: not supported \({why}\)$"):
            check_inert({name: value})


def test_generation_overrides_are_sampling_keywords():
    from rltserve.vllm_args import generation_overrides

    assert generation_overrides(None) == generation_overrides({}) == {}
    got = generation_overrides({"temperature": 0.2, "max_new_tokens": 9, "top_k": None})
    assert got == {"temperature": 0.2, "max_tokens": 9, "top_k": None}  # (None drops a default)
    for bad, message in (
        ({"do_sample": True}, r"'do_sample' is not a sampling default \(accepted: repetition"),
        ({"top_p": 0}, "top_p=0: must be in"),
        ("temperature=0", "must be a dict"),
    ):
        with pytest.raises(ValueError, match=f"^override_generation_config.*{message}"):
            generation_overrides(bad)


def test_parallel_size_and_utilization_bounds():
    from rltserve.vllm_args import check_parallel, check_utilization, kv_budget_bytes

    check_parallel(1)
    for size in (0, 2):
        with pytest.raises(ValueError, match=f"tensor_parallel_size={size}: rltserve runs"):
            check_parallel(size)
    check_utilization(1)
    check_utilization(1.0)
    for bad in (0, 1.01, True, float("nan")):
        with pytest.raises(ValueError, match=r"gpu_memory_utilization=.*: must be in \(0, 1\]"):
            check_utilization(bad)
    gib = 2**30
    assert kv_budget_bytes(1.0, 10 * gib, 8 * gib) == gib  # the whole device
    with pytest.raises(ValueError, match="leave no room for the KV cache"):
        kv_budget_bytes(1.0, 9 * gib, 8 * gib)  # exactly nothing left


def test_kv_cache_gb_on_cuda_counts_the_weights_in_the_served_dtype(tmp_path, monkeypatch):
    import torch

    from rltserve.vllm_args import ACTIVATION_RESERVE_BYTES, kv_cache_gb_for

    gib = 2**30

    class Props:
        total_memory = 80 * gib

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.truncate(4 * gib)  # (sparse) 4 GiB of bfloat16 weights: 8 GiB served as float32
    want = (40 * gib - 8 * gib - ACTIVATION_RESERVE_BYTES) / gib
    assert kv_cache_gb_for(0.5, "cuda:0", str(tmp_path), "float32") == want
    half = (40 * gib - 4 * gib - ACTIVATION_RESERVE_BYTES) / gib
    assert kv_cache_gb_for(0.5, "cuda", str(tmp_path), "bfloat16") == half


def test_generation_config_folder(tmp_path):
    from rltserve.vllm_args import generation_config_folder

    assert generation_config_folder("auto", "/ckpt") == "/ckpt"
    assert generation_config_folder("vllm", "/ckpt") is None
    assert generation_config_folder(tmp_path, "/ckpt") == str(tmp_path)
    (tmp_path / "generation_config.json").write_text("{}")
    file = str(tmp_path / "generation_config.json")  # (the folder holding it is the value)
    for bad in (str(tmp_path / "missing"), file, None, 3):
        with pytest.raises(ValueError, match=r"generation_config=.*: must be 'auto', 'vllm' or"):
            generation_config_folder(bad, "/ckpt")


# --------------------------------------------------------------------------- prompt forms


def test_prompt_lists_dicts_and_salts():
    from rltserve.prompt_inputs import normalize_prompts, prompt_cache_salt

    assert normalize_prompts("a") == ["a"]
    assert normalize_prompts({"prompt": "a"}) == [{"prompt": "a"}]
    assert normalize_prompts([[1, 2], "b"]) == [[1, 2], "b"]
    assert normalize_prompts([]) == []
    with pytest.raises(ValueError, match="pass a list of token-id lists, not one flat list"):
        normalize_prompts([1, 2, 3])
    assert prompt_cache_salt({"prompt": "a", "cache_salt": "t1"}) == "t1"
    assert prompt_cache_salt({"prompt": "a", "cache_salt": None}) is None
    for bad in ("", 5):
        with pytest.raises(ValueError, match=r"cache_salt=.*: must be a non-empty string"):
            prompt_cache_salt({"prompt": "a", "cache_salt": bad})


def test_token_id_prompts_pair_texts_with_ids():
    from rltserve.prompt_inputs import token_id_prompts

    assert token_id_prompts([]) == []
    assert token_id_prompts([1, 2]) == [{"prompt_token_ids": [1, 2]}]
    assert token_id_prompts([[1], [2]], ["a", "b"]) == [
        {"prompt": "a", "prompt_token_ids": [1]},
        {"prompt": "b", "prompt_token_ids": [2]},
    ]
    with pytest.raises(ValueError, match="must be as many"):
        token_id_prompts([[1], [2]], ["a"])
    with pytest.raises(ValueError, match="must be the prompts' texts"):
        token_id_prompts([[1]], [5])
    encoding = {"input_ids": [1, 2], "attention_mask": [1, 1]}  # (one prompt's, as a mapping)
    assert token_id_prompts(encoding) == [{"prompt_token_ids": encoding}]


def test_a_tokenizers_encoding_of_one_sequence_is_token_ids():
    import numpy as np

    from rltserve.prompt_inputs import check_ids, encode_prompt

    assert check_ids({"input_ids": [3, 4], "attention_mask": [1, 1]}, 10) == [3, 4]
    assert check_ids({"input_ids": np.array([3, 4])}, 10) == [3, 4]
    assert encode_prompt({"prompt_token_ids": {"input_ids": [5]}}, None, 10) == [5]
    for batch in ([[3, 4], [5]], np.array([[3, 4]])):
        with pytest.raises(ValueError, match=r"input_ids holds a batch of \d sequences; pass one"):
            check_ids({"input_ids": batch}, 10)


def test_empty_mm_processor_kwargs_and_numpy_texts_are_prompts():
    import numpy as np

    from rltserve.prompt_inputs import encode_prompt, normalize_prompts

    assert normalize_prompts(np.array(["a", "b"])) == ["a", "b"]
    with pytest.raises(ValueError, match="must be a string, token ids or a list"):
        normalize_prompts(np.array([1, 2]))  # (one prompt's ids: a list of them is wanted)
    assert encode_prompt({"prompt_token_ids": [3], "mm_processor_kwargs": {}}, None, 10) == [3]
    with pytest.raises(ValueError, match="unknown key 'mm_processor_kwargs'"):
        encode_prompt({"prompt_token_ids": [3], "mm_processor_kwargs": {"n": 1}}, None, 10)


def test_encode_prompt_forms_and_id_checks():
    from rltserve.prompt_inputs import check_ids, encode_prompt

    class Tok:  # appends an end token to every text, as Huginn's does
        def encode(self, text, add_special_tokens=True):
            return [1, 2, 9]

        def encode_prompt(self, text):
            return [1, 2]

    assert encode_prompt("hi", Tok(), 10) == [1, 2]
    assert encode_prompt({"prompt": "hi", "multi_modal_data": None}, Tok(), 10) == [1, 2]
    assert encode_prompt({"prompt_token_ids": [3]}, None, 10) == [3]
    with pytest.raises(ValueError, match="a dict needs 'prompt' or 'prompt_token_ids'"):
        encode_prompt({"cache_salt": "s"}, None, 10)
    with pytest.raises(ValueError, match="unknown key 'multi_modal_data'"):
        encode_prompt({"prompt": "hi", "multi_modal_data": {}}, Tok(), 10)
    with pytest.raises(ValueError, match="token ids must be ints"):
        check_ids([1, True], 10)
    with pytest.raises(ValueError, match=r"prompt=b'ab': must be a string or a list of token"):
        check_ids(b"ab", 300)
    with pytest.raises(
        ValueError, match=r"prompt: token id 10 is outside the vocabulary \[0, 10\)"
    ):
        check_ids([1, 10], 10)


def test_text_in_a_prompt_key_and_byte_arrays_are_not_token_ids():
    from rltserve.prompt_inputs import check_ids, encode_prompt

    with pytest.raises(ValueError, match="the 'prompt' key must hold a string"):
        encode_prompt({"prompt": [1, 2]}, None, 10)
    with pytest.raises(ValueError, match=r"prompt=bytearray\(b'ab'\): must be a string or"):
        check_ids(bytearray(b"ab"), 300)


def test_template_message_joins_text_parts_and_renames_developer():
    from rltserve.prompt_inputs import template_message

    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert template_message({"role": "developer", "content": parts}, "messages[0]") == {
        "role": "system",
        "content": "a\nb",
    }
    plain = {"role": "user", "content": "x"}
    assert template_message(plain, "messages[0]") is plain
    with pytest.raises(ValueError, match=r"^messages\[0\]\[0\]: must be a message, a dict"):
        template_message("x", "messages[0][0]")


def test_template_message_gives_a_turn_without_content_empty_text():
    """OpenAI's assistant turn that only calls tools has ``"content": None``; templates read
    ``message.content``, and the template's normalisation drops None values: "" (vLLM's)."""
    from rltserve.prompt_inputs import template_message

    call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    turn = {"role": "assistant", "content": None, "tool_calls": [call]}
    parsed = [{"type": "function", "function": {"name": "f", "arguments": {}}}]
    # (and its calls' JSON arguments as dicts, as the server gives them to templates)
    assert template_message(turn, "m") == {**turn, "content": "", "tool_calls": parsed}
    assert template_message({"role": "assistant"}, "m") == {"role": "assistant", "content": ""}
