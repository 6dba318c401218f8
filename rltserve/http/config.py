"""Frozen configuration of the HTTP server, validated on construction.

As with the engine configs, every field's ``metadata["help"]`` is the one description of the
setting: ``rltserve serve`` derives its flags (``--max-concurrent`` from ``max_concurrent``) and
help texts from this dataclass.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from functools import cached_property

from rltserve.http.api_keys import API_KEY_ENVS, api_key_env
from rltserve.http.config_checks import check_server_config
from rltserve.http.cors_policy import CorsPolicy
from rltserve.http.request_defaults import generation_overrides, template_defaults
from rltserve.http.tool_choice import TOOL_CALL_PARSERS
from rltserve.sampling import MAX_LOGPROBS

# The hard ceiling on n (a request's sequences); ServerConfig.max_n may lower it.
MAX_N = 128


def _help(text: str, **more: object) -> dict:
    return {"help": text, **more}


@dataclass(frozen=True)
class ServerConfig:
    host: str = field(default="127.0.0.1", metadata=_help("interface to listen on"))
    port: int = field(default=8000, metadata=_help("TCP port (0 picks a free one)"))
    uds: str | None = field(
        default=None,
        metadata=_help(
            "listen on this Unix domain socket instead of --host/--port (vLLM's; the socket is "
            "made 0666, as uvicorn makes it, and removed on exit)"
        ),
    )
    api_server_count: int = field(
        default=1, metadata=_help("vLLM's API server processes: 1 (one process serves the API)")
    )
    root_path: str | None = field(
        default=None,
        metadata=_help(
            "the path prefix a path-based proxy passes requests on with (as '/llm' for an "
            "nginx 'location /llm/' or an ingress path without a rewrite): a request under it "
            "is served as the same path without it, and paths outside it as they are (vLLM's)"
        ),
    )
    served_model_name: str | tuple[str, ...] | None = field(
        default=None,
        metadata={
            **_help(
                "model name(s) clients use, as vLLM's: requests may name any of them, /v1/models "
                "lists them all, and the first names the model in /metrics and in responses to "
                "requests that name none (default: the checkpoint directory's name, a Hugging "
                "Face repo id for a repo id or a cache snapshot; requests may also name the "
                "--model path as given)"
            ),
            "nargs": "+",
        },
    )
    api_key: str | tuple[str, ...] | None = field(
        default=None,
        metadata={
            **_help(
                "require 'Authorization: Bearer KEY', one of the keys given (as vLLM's: "
                "'--api-key K1 K2'), on every route but the probes /health, /ping, /version, "
                "/openapi.json, /load (and /metrics unless --metrics-auth); default: env "
                f"{API_KEY_ENVS[0]}, else {API_KEY_ENVS[1]}"
            ),
            "nargs": "+",
        },
    )
    ssl_certfile: str | None = field(default=None, metadata=_help("TLS certificate (PEM)"))
    ssl_keyfile: str | None = field(default=None, metadata=_help("TLS private key (PEM)"))
    ssl_ca_certs: str | None = field(
        default=None,
        metadata=_help("CA certificates (PEM) that client certificates are verified against"),
    )
    ssl_cert_reqs: int = field(
        default=0,
        metadata=_help(
            "client certificates (vLLM's, the ssl module's values): 0 not asked for, 1 verified "
            "when sent, 2 required; 1 and 2 need --ssl-ca-certs"
        ),
    )
    max_concurrent: int = field(
        default=256,
        metadata=_help("sequences in the engine at once (n=4 counts 4); queued: by priority"),
    )
    max_queued: int = field(
        default=1024,
        metadata=_help(
            "requests waiting for one of --max-concurrent's slots; beyond it requests get 503 + "
            "Retry-After (the worst waiter does, for a better priority; a request with a slot "
            "but no engine seat or KV waits in the engine, not counted: to shed load early, set "
            "--max-concurrent near --max-num-seqs, though a better priority then waits for a "
            "slot to free, as it cannot preempt a request out of one)"
        ),
    )
    max_body_bytes: int = field(
        default=8 * 2**20, metadata=_help("largest request body accepted (else 413)")
    )
    retry_after_s: int = field(
        default=1, metadata=_help("Retry-After seconds sent with 503 responses")
    )
    startup_timeout_s: float = field(
        default=600.0, metadata=_help("seconds the engine may take to load")
    )
    strict_fields: bool = field(
        default=False,
        metadata=_help(
            "reject request fields the server does not know (400); by default they are ignored "
            "with one logged warning per field name"
        ),
    )
    generation_config: str = field(
        default="auto",
        metadata=_help(
            "sampling defaults for the fields a request leaves out (temperature, top_p, top_k, "
            "min_p, repetition_penalty, chat's max_tokens): 'auto' the checkpoint's "
            "generation_config.json, 'vllm' vLLM's own, or a folder holding one"
        ),
    )
    override_generation_config: str | None = field(
        default=None,
        metadata=_help(
            "sampling defaults over --generation-config's, a JSON object (as "
            '\'{"temperature": 0.5, "max_loops": 16}\'; vLLM\'s): temperature, top_p, top_k, '
            "min_p, repetition_penalty, max_new_tokens, and the looped-model fields max_loops "
            "(num_steps), exit_criterion, exit_threshold, init_state; a request's own values win"
        ),
    )
    allowed_origins: str = field(
        default="*",
        metadata=_help(
            "origins whose web pages may call the API (CORS), comma-separated or as vLLM's "
            "JSON list ('[\"https://a.example\"]'): '*' any (vLLM's default), '' or '[]' none"
        ),
    )
    allowed_methods: str = field(
        default="*",
        metadata=_help("methods those pages may use (CORS), as --allowed-origins: '*' any"),
    )
    allowed_headers: str = field(
        default="*",
        metadata=_help(
            "request headers those pages may send (CORS), as --allowed-origins: '*' any; "
            "Accept, Accept-Language, Content-Language and Content-Type always"
        ),
    )
    allow_credentials: bool = field(
        default=False,
        metadata=_help(
            "let those pages send cookies and HTTP authentication (CORS "
            "Access-Control-Allow-Credentials; an allowed origin is then named, not '*')"
        ),
    )
    response_role: str = field(
        default="assistant",
        metadata=_help(
            "the role of a chat answer's message (vLLM's; where add_generation_prompt is false "
            "the answer continues the last message and takes its role)"
        ),
    )
    chat_template: str | None = field(
        default=None,
        metadata=_help(
            "a chat template that replaces the checkpoint's: a Jinja file, or the template "
            "itself (vLLM's --chat-template)"
        ),
    )
    chat_template_content_format: str = field(
        default="auto",
        metadata=_help(
            "vLLM's: how message content lists reach the template, auto, string or openai; "
            "taken for its command lines, the same in each (a message's text parts are joined)"
        ),
    )
    default_chat_template_kwargs: str | None = field(
        default=None,
        metadata=_help(
            "template variables of every chat request, a JSON object (as "
            "'{\"enable_thinking\": true}'); a request's chat_template_kwargs win over them "
            "(vLLM's --default-chat-template-kwargs)"
        ),
    )
    enable_auto_tool_choice: bool = field(
        default=False,
        metadata=_help(
            "serve tool_choice 'auto' (the default of a chat request that gives tools): the "
            "model answers freely and the calls it writes are read with --tool-call-parser "
            "(vLLM's; without it 'auto' is a 400)"
        ),
    )
    tool_call_parser: str | None = field(
        default=None,
        metadata=_help(
            f"the call format --enable-auto-tool-choice reads (vLLM's names): "
            f'{", ".join(TOOL_CALL_PARSERS)}; hermes reads <tool_call>{{"name": ..., '
            '"arguments": {...}}</tool_call> blocks, as Hermes, Qwen and most open chat '
            "templates have models write them"
        ),
    )
    drain_timeout_s: float = field(
        default=10.0,
        metadata=_help(
            "on shutdown (SIGINT/SIGTERM), seconds in-flight requests may finish before being "
            "aborted; a second signal aborts them at once"
        ),
    )
    # Bounds on what one request may ask for (each beyond its bound is a 400 naming the field).
    max_n: int = field(default=MAX_N, metadata=_help(f"largest n (at most {MAX_N})"))
    max_tokens_limit: int | None = field(
        default=None,
        metadata=_help(
            "largest max_tokens a request may ask for, and the most one that asks none gets "
            "(chat: the rest of the context, completions: 16; default: the context length)"
        ),
    )
    max_loops_limit: int | None = field(
        default=None,
        metadata=_help(
            "largest max_loops (num_steps) or min_loops a request may ask for, and the most "
            "loops per token one that asks none gets (default: the model's depth, up to what "
            "it allows)"
        ),
    )
    max_stop: int = field(default=16, metadata=_help("most stop strings in one request"))
    max_stop_chars: int = field(default=256, metadata=_help("longest stop string (characters)"))
    max_logprobs: int = field(
        default=MAX_LOGPROBS,
        metadata=_help(f"largest logprobs / top_logprobs (at most {MAX_LOGPROBS})"),
    )
    max_header_bytes: int = field(
        default=8190,
        metadata=_help(
            "longest request line or header field (else 400); vLLM's "
            "--h11-max-incomplete-event-size, its bound on the whole head, sets it here",
            aliases=("--h11-max-incomplete-event-size",),
        ),
    )
    max_header_count: int = field(
        default=256,
        metadata=_help(
            "most header fields in a request (else 400)", aliases=("--h11-max-header-count",)
        ),
    )
    # Slow clients: a connection that sends no complete request, a body that trickles in, or a
    # stream nobody reads would otherwise hold its socket (and a stream its engine slot) forever.
    idle_timeout_s: float = field(
        default=60.0,
        metadata=_help("seconds a connection may wait for a complete request (headers) or idle"),
    )
    body_timeout_s: float = field(
        default=30.0, metadata=_help("seconds a request body may take to arrive (else 408)")
    )
    stream_stall_timeout_s: float = field(
        default=30.0,
        metadata=_help(
            "seconds a stream (or a response body) may wait for its client to read before the "
            "request is aborted (its connection dropped)"
        ),
    )
    # A dead or hung stage is restarted (see rltserve.http.supervisor); when restarts run out
    # the process exits non-zero for an outer supervisor to act.
    stage_watchdog_s: float = field(
        default=300.0,
        metadata=_help(
            "seconds a busy stage may go without finishing a step before it is killed and "
            "restarted (0: no watchdog; not with --replicas, whose replicas Ray Serve's health "
            "checks replace)"
        ),
    )
    stage_restarts: int = field(
        default=3,
        metadata=_help(
            "restarts of a failed stage in a row, each of which failed to start or gave a stage "
            "that failed (died or hung) within --stage-stable-s, before the server gives up and "
            "exits with code 1"
        ),
    )
    stage_stable_s: float = field(
        default=60.0,
        metadata=_help(
            "seconds a stage must run for its failure to start a fresh count of --stage-restarts"
        ),
    )
    stage_restart_backoff_s: float = field(
        default=1.0,
        metadata=_help("seconds before the first restart of a failed stage (doubles per retry)"),
    )
    metrics_auth: bool = field(default=False, metadata=_help("require the API key on /metrics too"))
    metrics_prefix: str = field(
        default="rltserve",
        metadata=_help(
            "the prefix of every /metrics series: 'rltserve' (rltserve:num_requests_waiting) "
            "or 'vllm' (vllm:num_requests_waiting, for dashboards and autoscalers built for "
            "vLLM; series vLLM lacks get it too)"
        ),
    )
    show_hidden_metrics_for_version: str | None = field(
        default=None,
        metadata=_help(
            "vLLM's: the vLLM version (e.g. 0.11) whose deprecated /metrics series, hidden now, "
            "are shown again (0.10: gpu_cache_usage_perc, gpu_prefix_cache_queries/_hits and "
            "time_per_output_token_seconds; 0.11: time_per_output_token_seconds)"
        ),
    )
    disable_log_stats: bool = field(
        default=False,
        metadata=_help(
            "no periodic stats line in the log (throughput, running and waiting requests, KV "
            "cache usage, prefix cache hit rate, preemptions; every VLLM_LOG_STATS_INTERVAL "
            "seconds, 10 by default, while serving; vLLM's --disable-log-stats)"
        ),
    )
    enable_per_request_metrics: bool = field(
        default=False,
        metadata=_help(
            "a 'metrics' object in each completion's body (time_to_first_token_ms, "
            "generation_time_ms, queue_time_ms, mean_itl_ms, tokens_per_second; in a stream's "
            "final usage chunk; only for one prompt with n=1; vLLM's)"
        ),
    )
    enable_force_include_usage: bool = field(
        default=False,
        metadata=_help(
            "every stream ends with a usage chunk, as if the request had sent "
            "stream_options.include_usage (vLLM's)"
        ),
    )
    enable_server_load_tracking: bool = field(
        default=False,
        metadata=_help(
            "count the completion and chat requests in flight (streams until their end) for "
            'GET /load\'s {"server_load": N}, as load-aware routers read it (without it: '
            "always 0; vLLM's)"
        ),
    )
    enable_tokenizer_info_endpoint: bool = field(
        default=False,
        metadata=_help(
            "serve GET /tokenizer_info: the tokenizer's configuration and chat template, from "
            "which clients such as lm-eval's remote tokenizer encode through /tokenize (vLLM's; "
            "off by default: it shows the chat template)"
        ),
    )
    return_tokens_as_token_ids: bool = field(
        default=False,
        metadata=_help(
            "logprobs name each token 'token_id:N' instead of its text (vLLM's; a request's "
            "own return_tokens_as_token_ids wins): ids survive where a token's text does not "
            "round-trip (a token that holds part of a character)"
        ),
    )
    disable_fastapi_docs: bool = field(
        default=False,
        metadata=_help(
            "no GET /openapi.json, the API's description (vLLM's flag, which also drops its "
            "/docs and /redoc pages: none here)"
        ),
    )
    expose_model_path: bool = field(
        default=False,
        metadata=_help("show the checkpoint's filesystem path as 'root' in /v1/models"),
    )
    # Request logs, as vLLM's flags name them (off by default: a prompt may be private).
    enable_log_requests: bool = field(
        default=False,
        metadata=_help(
            "log each generating request: 'Received request ID: params: ..., prompt_tokens: N' "
            "(its prompt and token ids at --log-level debug), then 'Finished request ID.', "
            "'Failed request ID: ERROR' or 'Aborted request ID.'"
        ),
    )
    enable_log_outputs: bool = field(
        default=False,
        metadata=_help(
            "with --enable-log-requests, log each choice's output text, token ids and finish "
            "reason when the request finishes ('Generated response ID: ...')"
        ),
    )
    max_log_len: int | None = field(
        default=None,
        metadata=_help(
            "most prompt or output characters and token ids a request log line shows (default: all)"
        ),
    )
    enable_request_id_headers: bool = field(
        default=False,
        metadata=_help(
            "answer every request with an X-Request-Id header: the client's, else a fresh id "
            "that also names the response (cmpl-ID) and its log lines"
        ),
    )
    disable_uvicorn_access_log: bool = field(
        default=False, metadata=_help("no access log lines (vLLM's name for it)")
    )
    disable_access_log_for_endpoints: str | None = field(
        default=None,
        metadata=_help(
            "paths whose requests get no access log line, comma-separated (as "
            "'/health,/metrics,/ping'; the query string is not part of the path)"
        ),
    )

    def __post_init__(self) -> None:
        check_server_config(self, MAX_N)  # (ValueError naming the field)

    @property
    def template_defaults(self) -> dict:
        """``default_chat_template_kwargs`` parsed (``request_defaults``)."""
        return template_defaults(self.default_chat_template_kwargs)

    @property
    def generation_overrides(self) -> dict[str, object]:
        """``override_generation_config`` as ``SamplingParams`` keywords (``request_defaults``)."""
        return generation_overrides(self.override_generation_config)

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """``served_model_name`` as a tuple (empty: none given)."""
        names = self.served_model_name
        if names is None:
            return ()
        return (names,) if isinstance(names, str) else names

    @property
    def quiet_paths(self) -> frozenset[str]:
        """``disable_access_log_for_endpoints`` as a set of paths."""
        text = self.disable_access_log_for_endpoints or ""
        return frozenset(p.strip() for p in text.split(",") if p.strip())

    @property
    def api_keys(self) -> tuple[str, ...]:
        """``api_key`` as a tuple (empty: no auth)."""
        keys = self.api_key
        return () if keys is None else (keys,) if isinstance(keys, str) else keys

    @cached_property  # (read by every response to a page; the fields are frozen)
    def cors(self) -> CorsPolicy:
        """The CORS flags as a policy (``cors_policy``; ValueError naming a malformed one)."""
        return CorsPolicy.parse(
            self.allowed_origins, self.allowed_methods, self.allowed_headers, self.allow_credentials
        )

    @property
    def origins(self) -> frozenset[str]:
        """``allowed_origins`` as a set (empty: no cross-origin page may call the API)."""
        return self.cors.origins

    def with_env(self) -> ServerConfig:
        """The config with ``api_key`` taken from the environment when not given (the first
        of ``API_KEY_ENVS`` set to a non-empty value); resolved after parsing so that a key
        never shows up as a flag default in ``--help``."""
        name = api_key_env()
        return replace(self, api_key=os.environ[name]) if self.api_key is None and name else self

    @property
    def uses_tls(self) -> bool:
        return self.ssl_certfile is not None
