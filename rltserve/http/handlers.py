"""Route handlers: parse, plan, deliver. The work is in plans, frontend, delivery, responses."""

from __future__ import annotations

import functools
import gzip
import time

from aiohttp import web
from prometheus_client.exposition import gzip_accepted

from rltserve import __version__
from rltserve.http.admin import (
    UpdateWeightsRequest,
    is_sleeping,
    reset_prefix_cache,
    sleep,
    update_weights,
    wake_up,
)
from rltserve.http.body import read_body
from rltserve.http.delivery import deliver
from rltserve.http.errors import HTTPError, bad_request, json_response
from rltserve.http.limits import check_limits
from rltserve.http.middleware import expect_continue
from rltserve.http.openapi import Route, openapi_document
from rltserve.http.plans import chat_plan, completion_plan
from rltserve.http.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from rltserve.http.session import session_key
from rltserve.http.state import STATE, ServingState
from rltserve.http.tokenizer_info import tokenizer_info
from rltserve.http.tool_choice import check_auto_choice


def load_aware(handler):
    """``handler``, counted in ``state.server_load`` from its start until its response ended
    (a stream's handler returns once the stream has) when the server tracks load, as vLLM's
    ``load_aware_call`` counts its generating routes."""

    @functools.wraps(handler)
    async def counted(request: web.Request) -> web.StreamResponse:
        state = request.app[STATE]
        if not state.config.enable_server_load_tracking:
            return await handler(request)
        state.server_load += 1
        try:
            return await handler(request)
        finally:
            state.server_load -= 1

    return counted


@load_aware
async def completions(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    state = request.app[STATE]
    rid = _response_id(request, state, "cmpl")
    req: CompletionRequest = await read_body(request, CompletionRequest, request_id=rid)
    state.check_model(req.model)
    check_limits(req, state.config)
    session = session_key(request.headers, req.user)
    plan = await completion_plan(state, req, arrival, session, rid)
    return await deliver(request, state, plan)


@load_aware
async def chat_completions(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    state = request.app[STATE]
    rid = _response_id(request, state, "chatcmpl")
    req: ChatCompletionRequest = await read_body(request, ChatCompletionRequest, request_id=rid)
    state.check_model(req.model)
    check_limits(req, state.config)
    check_auto_choice(req.tools, req.tool_choice, state.config.enable_auto_tool_choice)
    session = session_key(request.headers, req.user)
    plan = await chat_plan(state, req, arrival, session, rid)
    return await deliver(request, state, plan)


def _response_id(request: web.Request, state: ServingState, prefix: str) -> str:
    """The response's id, which also names the request in log lines: ``PREFIX-<X-Request-Id>``
    as vLLM names it (the client's, or with ``enable_request_id_headers`` a fresh one), else
    a fresh id. The header is a 400 unless it is UTF-8 text (aiohttp keeps other bytes as
    surrogates, which no JSON body can carry)."""
    rid = state.request_id(request)
    if rid is not None and not _utf8(rid):
        raise bad_request("X-Request-Id header: must be UTF-8 text", None)
    return f"{prefix}-{rid}" if rid else state.ids(prefix)


def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    cards = [model_card(state, name) for name in state.served_names]
    return json_response({"object": "list", "data": cards})


async def model(request: web.Request) -> web.Response:
    """``GET /v1/models/{id}`` (the SDK's ``models.retrieve``): the card, or OpenAI's 404."""
    state = request.app[STATE]
    name = request.match_info["model"]
    state.check_model(name)  # (never empty: the route matches .+)
    # (the --model path as given, which requests may name too, is the first name's card)
    return json_response(model_card(state, name if name in state.served_names else None))


def model_card(state: ServingState, name: str | None = None) -> dict:
    """The card of served name ``name`` (None: the first)."""
    frontend = state.require_frontend()
    info = frontend.info
    return {
        "id": name or state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "rltserve",
        # A filesystem path tells clients about the host; shown only when configured.
        "root": info.model_path if state.config.expose_model_path else state.model_name,
        "parent": None,  # (vLLM's: a LoRA adapter's base model; rltserve serves none)
        "max_model_len": info.max_model_len,
        "permission": [model_permission(state)],
        "vocab_size": info.vocab_size,
        # (a string, as every response's metadata.weight_version and /v1/update_weights')
        "weight_version": str(getattr(frontend.client, "weight_version", 0)),
    }


def model_permission(state: ServingState) -> dict:
    """vLLM's ``ModelPermission`` with its defaults (a fresh id and the time of the call, as
    vLLM makes one per card and call), for clients that read the OpenAI model object's
    legacy ``permission`` list."""
    return {
        "id": state.ids("modelperm"),
        "object": "model_permission",
        "created": int(state.clock()),
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.require_frontend()
    return json_response(state.health())


async def metrics(request: web.Request) -> web.Response:
    body, content_type = request.app[STATE].metrics.render(request.headers.get("Accept"))
    headers = {"Content-Type": content_type, "Vary": "Accept-Encoding"}
    # (as prometheus_client's own handlers: a scrape is tens of KB of text, gzip a tenth)
    if gzip_accepted(request.headers.get("Accept-Encoding", "")):
        body, headers["Content-Encoding"] = gzip.compress(body), "gzip"
    return web.Response(body=body, headers=headers)


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    req: TokenizeRequest = await read_body(request, TokenizeRequest)
    state.check_model(req.model)
    check_auto_choice(req.tools, req.tool_choice, state.config.enable_auto_tool_choice)
    frontend = state.require_frontend()
    if req.messages is not None:
        messages = [m.as_template_input(f"messages[{i}]") for i, m in enumerate(req.messages)]
        ids = await frontend.render_chat(
            messages,
            req.add_generation_prompt,
            req.template_kwargs,
            continue_final_message=req.continue_final_message,
            add_special_tokens=bool(req.add_special_tokens),
        )
    else:
        codec = frontend.require_codec("prompt")
        special = req.add_special_tokens is not False
        # (the completions' character bound: a text that cannot fit the context is refused
        # unencoded, as its tokens and their list would take many times its bytes)
        ids = await codec.encode(req.prompt or "", "prompt", add_special_tokens=special)
    body = {"count": len(ids), "max_model_len": frontend.info.max_model_len, "tokens": ids}
    if req.return_token_strs:
        body["token_strs"] = frontend.require_codec("prompt").tokenizer.token_strings(ids)
    return json_response(body)


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    req: DetokenizeRequest = await read_body(request, DetokenizeRequest)
    state.check_model(req.model)
    frontend = state.require_frontend()
    codec = frontend.require_codec("tokens")
    vocab = frontend.info.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(
            f"tokens: token id {bad} is outside the vocabulary [0, {vocab})", "tokens"
        )
    text = await codec.decode(req.tokens, skip_special_tokens=req.skip_special_tokens)
    return json_response({"prompt": text})


async def get_tokenizer_info(request: web.Request) -> web.Response:
    """vLLM's ``GET /tokenizer_info`` (``tokenizer_info``); a 404 unless the server was started
    with it, as vLLM's, so that clients probing for it (lm-eval's) take a tokenizer of their
    own instead."""
    state = request.app[STATE]
    if not state.config.enable_tokenizer_info_endpoint:
        message = "/tokenizer_info: off (start the server with --enable-tokenizer-info-endpoint)"
        raise HTTPError(404, message)
    tokenizer = state.require_frontend().tokenizer
    if tokenizer is None:
        raise HTTPError(404, "/tokenizer_info: this model has no tokenizer; send token ids")
    return json_response(tokenizer_info(tokenizer))


async def load(request: web.Request) -> web.Response:
    """vLLM's ``GET /load``: the requests in flight (always 0 without
    ``enable_server_load_tracking``, as vLLM's)."""
    return json_response({"server_load": request.app[STATE].server_load})


async def version(request: web.Request) -> web.Response:
    return json_response({"version": __version__})


async def openapi(request: web.Request) -> web.Response:
    if request.app[STATE].config.disable_fastapi_docs:  # (as vLLM's: no such route)
        raise HTTPError(
            404, "/openapi.json: off (the server was started with --disable-fastapi-docs)"
        )
    root = request.app[STATE].config.root_path
    return json_response(openapi_document(ROUTES, __version__, root))


# (method, path, handler, request body schema): the table /openapi.json is generated from.
ROUTES: tuple[Route, ...] = (
    Route("POST", "/v1/completions", completions, CompletionRequest),
    Route("POST", "/v1/chat/completions", chat_completions, ChatCompletionRequest),
    Route("GET", "/v1/models", models),
    # (a served name may be a repo id with a slash)
    Route("GET", "/v1/models/{model:.+}", model),
    Route("GET", "/health", health),
    # SageMaker's probe, which vLLM serves as /health (GET and POST)
    Route("GET", "/ping", health),
    Route("POST", "/ping", health),
    Route("GET", "/metrics", metrics),
    # (vLLM mounts its metrics app there, answering with the slash too: scrape configs name both)
    Route("GET", "/metrics/", metrics),
    Route("POST", "/tokenize", tokenize, TokenizeRequest),
    Route("POST", "/detokenize", detokenize, DetokenizeRequest),
    Route("GET", "/tokenizer_info", get_tokenizer_info),
    Route("GET", "/load", load),
    Route("GET", "/version", version),
    Route("GET", "/openapi.json", openapi),
    Route("POST", "/v1/update_weights", update_weights, UpdateWeightsRequest),
    # vLLM's sleep mode and cache reset (query parameters, no body)
    Route("POST", "/sleep", sleep),
    Route("POST", "/wake_up", wake_up),
    Route("GET", "/is_sleeping", is_sleeping),
    Route("POST", "/reset_prefix_cache", reset_prefix_cache),
)


def add_routes(app: web.Application) -> None:
    """The routes of ``ROUTES``; every GET route answers HEAD too, as Starlette's (vLLM's) and
    aiohttp's own ``add_get`` do: load balancers' health checks (HAProxy's ``option httpchk
    HEAD /health``) and uptime monitors send it. aiohttp sends a HEAD response's status and
    headers (Content-Length included) without its body."""
    for route in ROUTES:
        methods = ("HEAD", "GET") if route.method == "GET" else (route.method,)
        for method in methods:
            app.router.add_route(method, route.path, route.handler, expect_handler=expect_continue)
