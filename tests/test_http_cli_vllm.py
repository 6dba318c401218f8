"""``vllm serve``'s server flags that deployments carry (systemd units, Kubernetes manifests,
docker entrypoints), as ``rltserve serve`` takes them: honoured (``--uds``, the client
certificate and h11 flags, ``--api-server-count 1``, ``--structured-outputs-config``), taken
and logged as changing nothing, or refused naming the flag and what to do instead; never
argparse's bare "unrecognized arguments"."""

from __future__ import annotations

import argparse
import logging

import pytest

from rltserve.http.cli import add_serve_parser, serve_configs


def _args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rltserve")
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *flags])


def test_vllms_listening_flags_reach_the_server_config(tmp_path):
    server, _ = serve_configs(
        _args("--uds", str(tmp_path / "s.sock"), "--api-server-count", "1",
              "--h11-max-incomplete-event-size", "65536", "--h11-max-header-count", "64")
    )  # fmt: skip
    assert (server.uds, server.api_server_count) == (str(tmp_path / "s.sock"), 1)
    # (aiohttp bounds each line of the head rather than the whole, and the count of fields)
    assert (server.max_header_bytes, server.max_header_count) == (65536, 64)
    assert serve_configs(_args())[0].max_header_count == 256  # (vLLM's default)


def test_client_certificate_flags_reach_the_server_config(tmp_path):
    cert, key, ca = (str(tmp_path / n) for n in ("c.pem", "k.pem", "ca.pem"))
    server, _ = serve_configs(
        _args("--ssl-certfile", cert, "--ssl-keyfile", key, "--ssl-ca-certs", ca,
              "--ssl-cert-reqs", "2")
    )  # fmt: skip
    assert (server.ssl_ca_certs, server.ssl_cert_reqs) == (ca, 2)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--api-server-count", "4"], "api_server_count=4: rltserve serves the API from one "
         "process (the engine runs in its own worker process, so the API process only parses, "
         "tokenizes and streams); drop the flag or give 1, and run more servers behind a load "
         "balancer, or --replicas N, for more"),
        (["--lora-modules", "sql=/adapters/sql"], "--lora-modules sql=/adapters/sql: not "
         "supported: LoRA adapters are not supported; merge the adapter into its base model (as "
         "peft's merge_and_unload does), and serve that checkpoint under the adapter's name with "
         "--served-model-name"),
        (["--lora-modules", "sql=/a/sql", "chat=/a/chat"], "--lora-modules sql=/a/sql "
         "chat=/a/chat: not supported: LoRA adapters are not supported; merge the adapter into "
         "its base model (as peft's merge_and_unload does), and serve that checkpoint under the "
         "adapter's name with --served-model-name"),
        (["--enable-ssl-refresh"], "--enable-ssl-refresh: not supported: the TLS certificate "
         "and key load once, at start; restart the server (roll the pods) to serve renewed ones"),
        (["--tool-parser-plugin", "p.py"], "--tool-parser-plugin p.py: not supported: no tool "
         "parser plugins; --tool-call-parser takes the built-in parsers"),
        (["--ssl-cert-reqs", "2"], "ssl_cert_reqs=2: only with TLS (ssl_certfile)"),
        (["--uds", "/no/such/folder/s.sock"],
         "--uds /no/such/folder/s.sock: no such folder '/no/such/folder'"),
        (["--structured-outputs-config", '{"backend": "xgramar"}'],
         '--structured-outputs-config {"backend": "xgramar"}: not supported (backend: one of '
         "auto, xgrammar, guidance, outlines, lm-format-enforcer)"),
        (["--structured-outputs-config", '{"disable_any_whitespace": true}'],
         '--structured-outputs-config {"disable_any_whitespace": true}: not supported '
         "(disable_any_whitespace: false only (a request's structured_outputs."
         "disable_any_whitespace asks for it))"),
        (["--structured-outputs-config", '{"enable_in_reasoning": true}'],
         '--structured-outputs-config {"enable_in_reasoning": true}: not supported '
         "(enable_in_reasoning: false only (the constraint binds where the reasoning ends))"),
        (["--structured-outputs-config", '{"bakend": "outlines"}'],
         '--structured-outputs-config {"bakend": "outlines"}: not supported (\'bakend\' is no '
         "StructuredOutputsConfig field rltserve knows)"),
    ],
)  # fmt: skip
def test_what_cannot_be_honoured_is_a_usage_error_saying_what_to_do(capsys, flags, message):
    """Exit 2 before any model loads, the message naming the flag (not "unrecognized")."""
    from rltserve.cli import main

    assert main(["serve", *flags]) == 2
    assert capsys.readouterr().err == f"rltserve: error: {message}\n"


def test_a_socket_path_that_is_a_file_is_refused(tmp_path, capsys):
    from rltserve.cli import main

    (tmp_path / "s.sock").write_text("")
    assert main(["serve", "--uds", str(tmp_path / "s.sock")]) == 2
    assert capsys.readouterr().err.endswith(
        f"--uds {tmp_path}/s.sock: exists and is not a socket\n"
    )


def test_a_missing_ca_file_is_refused_before_the_model_loads(tmp_path, capsys):
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl binary")
    cert, key = str(tmp_path / "c.pem"), str(tmp_path / "k.pem")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-days", "1", "-subj", "/CN=x", "-keyout", key, "-out", cert],
        check=True, capture_output=True,
    )  # fmt: skip
    from rltserve.cli import main

    flags = ["--ssl-certfile", cert, "--ssl-keyfile", key, "--ssl-cert-reqs", "2"]
    assert main(["serve", *flags, "--ssl-ca-certs", str(tmp_path / "ca.pem")]) == 2
    assert capsys.readouterr().err.endswith(f"--ssl-ca-certs {tmp_path}/ca.pem: no such file\n")
    (tmp_path / "ca.pem").write_text("not a certificate\n")
    assert main(["serve", *flags, "--ssl-ca-certs", str(tmp_path / "ca.pem")]) == 2
    assert f"--ssl-ca-certs {tmp_path}/ca.pem: cannot load it" in capsys.readouterr().err


@pytest.mark.parametrize("backend", ["auto", "outlines", "xgrammar", "guidance"])
def test_a_structured_outputs_backend_of_vllms_is_taken(backend):
    """Any of vLLM's backends constrains to the same languages; here outlines-core does it."""
    args = _args("--structured-outputs-config", f'{{"backend": "{backend}", "disable_fallback": '
                 'true, "reasoning_parser": "qwen3", "enable_in_reasoning": false}')  # fmt: skip
    serve_configs(args)
    assert args.structured_outputs_config["backend"] == backend


def test_flags_that_change_nothing_are_taken_and_logged(monkeypatch, caplog):
    """A manifest's --disable-frontend-multiprocessing or tracing flags do not stop the server:
    the start-up log says they change nothing; a client CA without --ssl-cert-reqs warns that
    clients are not asked for certificates; --hf-token is hidden as --api-key is."""
    from rltserve.http import cli

    monkeypatch.setattr(cli, "configure_logging", lambda args: None)
    monkeypatch.setattr("rltserve.http.server.run_server", lambda *a: 0)
    monkeypatch.setattr("rltserve.preflight.check_listen_address", lambda *a: None)
    monkeypatch.setattr("rltserve.http.listener.check_tls_files", lambda *a: None)
    monkeypatch.setattr("rltserve.http.listener.ssl_context", lambda config: None)
    args = _args(
        "--disable-frontend-multiprocessing", "--otlp-traces-endpoint", "http://otel:4317",
        "--hf-token", "hf_secret", "--structured-outputs-config", '{"backend": "xgrammar"}',
        "--ssl-certfile", "c.pem", "--ssl-keyfile", "k.pem", "--ssl-ca-certs", __file__,
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="rltserve.http"):
        assert cli.cmd_serve(args) == 0
    lines = [r.getMessage() for r in caplog.records]
    assert "--disable-frontend-multiprocessing: has no effect: the engine always runs in its " \
        "own worker process, apart from the API server's" in lines  # fmt: skip
    assert any(line.startswith("--otlp-traces-endpoint: has no effect: no OpenTelemetry") for
               line in lines)  # fmt: skip
    assert "--structured-outputs-config: backend 'xgrammar': structured outputs run on " \
        "outlines-core (the same constraints)" in lines  # fmt: skip
    assert any(line.startswith("--ssl-ca-certs: clients are not asked for") for line in lines)
    assert "hf_secret" not in caplog.text and "'hf_token': '***'" in caplog.text


def test_only_the_flags_given_are_logged_with_their_values():
    from rltserve.http.vllm_frontend import ignored_vllm_frontend_args

    args = _args("ckpt", "--collect-detailed-traces", "model,worker")  # (a value: a flag's)
    assert ignored_vllm_frontend_args(args) == [
        "--collect-detailed-traces: has no effect: no OpenTelemetry traces are exported"
    ]


def test_help_says_why_each_of_vllms_flags_changes_nothing_or_is_refused(capsys):
    from rltserve.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "vLLM's; refused: LoRA adapters are not supported" in shown
    assert "vLLM's; accepted, no effect: no OpenTelemetry traces are exported" in shown
