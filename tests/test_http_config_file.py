"""``rltserve serve --config FILE`` (``rltserve/http/config_file.py``): vLLM's YAML file of serve's
flags, keys spelled with dashes or underscores; the command line wins over the file; the file's
``model`` is MODEL's; an unknown key or a bad value is a usage error naming the key and the
file, as is a value refused later that the file set."""

from __future__ import annotations

import argparse

import pytest

from rltserve.cli import _command_parser, build_parser, main
from rltserve.http.cli import non_default_args, serve_configs
from rltserve.http.config_file import apply_config_file

CONFIG = """\
# a vLLM deployment's config.yaml
host: 0.0.0.0
port: 8001
max-model-len: 1k
max_num_seqs: 8
max-num-batched-tokens: 2048
enable-prefix-caching: false
enable-chunked-prefill: true
disable-log-requests: true
served-model-name: [a, b]
allowed-origins: ["https://app.example", "https://b.example"]
uvicorn-log-level: WARNING
tensor-parallel-size: 1
trust-remote-code: true
swap-space: 2
override-generation-config: {temperature: 0.5}
api-key:
"""


def _args(*argv: str) -> argparse.Namespace:
    """``argv`` parsed as ``rltserve`` parses it (``cli.main``): the ``--config`` file's values
    under the command line's flags."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.config is not None:
        apply_config_file(_command_parser(parser, args), args.config)
        args = parser.parse_args(argv)
    return args


def test_the_files_values_are_serves_flags_under_the_command_lines(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(CONFIG)
    args = _args("serve", "--config", str(path), "--max-num-seqs", "4", "--port=8002")
    server, engine = serve_configs(args)
    assert (server.host, server.port) == ("0.0.0.0", 8002)  # (the flag wins, in either spelling)
    assert server.served_model_names == ("a", "b") and server.api_key is None
    assert server.origins == {"https://app.example", "https://b.example"}
    assert server.generation_overrides == {"temperature": 0.5}
    assert args.uvicorn_log_level == "warning" and args.disable_log_requests
    assert engine.scheduler.max_num_seqs == 4 and engine.scheduler.max_num_batched_tokens == 2048
    assert engine.model.max_model_len == 1000 and engine.cache.enable_prefix_caching is False
    assert engine.cache.swap_space_gb == 2.0  # (vLLM's --swap-space, GiB)
    assert non_default_args(args)["max_model_len"] == 1000  # (logged as the flags are)
    again = _args("serve", "--config", str(path), "--enable-prefix-caching")
    assert serve_configs(again)[1].cache.enable_prefix_caching is True
    path.write_text("no-enable-prefix-caching: true\nserved-model-name: one\n")
    args = _args("serve", "--config", str(path))
    assert args.enable_prefix_caching is False and args.served_model_name == ["one"]
    path.write_text("")  # (an empty file sets nothing)
    assert _args("serve", "--config", str(path)).port is None


def test_the_files_model_is_models_unless_the_command_line_names_one(tmp_path):
    from rltserve.models.presets import make_model

    ckpt = make_model("ouro-tiny", tmp_path / "ouro", tokenizer=False)
    other = make_model("ouro-tiny", tmp_path / "other", tokenizer=False)
    path = tmp_path / "config.yaml"
    path.write_text(f"model: {ckpt}\n")
    assert serve_configs(_args("serve", "--config", str(path)))[1].model.model == str(ckpt)
    for argv in (["serve", str(other), "--config", str(path)],
                 ["serve", "--config", str(path), str(other)],
                 ["serve", "--config", str(path), "--model", str(other)]):  # fmt: skip
        assert serve_configs(_args(*argv))[1].model.model == str(other)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max-num-seq: 8\n", "unknown key 'max-num-seq' (serve has no --max-num-seq flag; did "
         "you mean 'max-num-seqs'?)"),
        ("config: other.yaml\n", "unknown key 'config'"),
        ("max-num-seqs: many\n", "max-num-seqs: invalid int value: 'many'"),
        ("max-num-seqs: [1, 2]\n", "max-num-seqs: [1, 2]: takes one value, not a list"),
        ("max-model-len: 1.5K\n", "max-model-len: '1.5K': a binary suffix takes a whole number"),
        ("enable-prefix-caching: 'yes please'\n", "enable-prefix-caching: 'yes please' is not "
         "true or false"),
        ("log-level: verbose\n", "log-level: 'verbose' is not one of debug, info"),
        ("port: [1, 2\n", "not valid YAML"),
        ("- port\n", "must map flag names to values (as 'port: 8000'), not a list"),
    ],
)  # fmt: skip
def test_a_bad_key_or_value_names_it_and_the_file(tmp_path, capsys, text, message):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rltserve: error: --config {path}: ") and message in err, err
    assert main(["serve", "--config", str(tmp_path / "none.yaml")]) == 2
    assert f"--config {tmp_path / 'none.yaml'}: no such file" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max-num-seqs: 0\n", "max_num_seqs=0: must be an int >= 1 (set by 'max-num-seqs' in "),
        ("tensor_parallel_size: 2\n", "--tensor-parallel-size 2: not supported"),
        ("model: /nowhere\n", "--model /nowhere: no such checkpoint directory (set by 'model' in"),
    ],
)
def test_a_value_refused_later_names_the_file_that_set_it(tmp_path, capsys, text, message):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.endswith(f"in --config {path})\n"), err
    assert err.count("(set by ") == 1, err  # (named once, not once by serve and once by main)


def test_a_refused_flag_that_replaced_the_files_value_is_the_command_lines(tmp_path, capsys):
    path = tmp_path / "config.yaml"
    path.write_text("max-num-seqs: 8\n")
    assert main(["serve", "--config", str(path), "--max-num-seqs", "0"]) == 2
    assert capsys.readouterr().err == "rltserve: error: max_num_seqs=0: must be an int >= 1\n"


@pytest.mark.parametrize(
    "command", [["generate", "hi"], ["bench", "offline"], ["bench", "rollout"]]
)
def test_the_other_engine_commands_take_a_config_file_too(tmp_path, capsys, command):
    """``generate``, ``bench offline`` and ``bench rollout`` take their engine flags from a
    file as ``serve`` does (the flag was refused), under the command line's; a key that is
    none of the command's flags names the command, and a value refused later the file."""
    path = tmp_path / "config.yaml"
    path.write_text("max-num-seqs: 8\nmax_model_len: 1k\nenable-prefix-caching: false\n")
    args = _args(*command, "--config", str(path), "--max-num-seqs", "4")
    assert (args.max_num_seqs, args.max_model_len, args.enable_prefix_caching) == (4, 1000, False)
    path.write_text("max-num-seq: 4\n")
    assert main([*command, "--config", str(path)]) == 2
    name = " ".join(c for c in command if c != "hi")
    assert f"({name} has no --max-num-seq flag; did you mean 'max-num-seqs'?)" in (
        capsys.readouterr().err
    )
    path.write_text("max-num-seqs: 0\n")
    assert main([*command, "--config", str(path)]) == 2
    err = capsys.readouterr().err  # (bench offline refuses the flag itself: its own words)
    assert err.startswith("rltserve: error: ") and "max-num-seqs" in err.replace("_", "-")
    assert err.endswith(f" (set by 'max-num-seqs' in --config {path})\n"), err
