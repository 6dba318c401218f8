"""The session key (``X-Session-Id``, else the body's ``user``) travels from the handler to the
stage client's ``add_request`` as an argument: a client that routes by session gets it with
every choice of the request, one that does not is called without it and keeps serving."""

from __future__ import annotations

import pytest
from test_http_harness import Script, ScriptedStage, running, scripted_factory, scripted_info

from rltserve.http.session import SESSION_HEADER, session_key


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from test_http_harness import tiny_checkpoint

    return tiny_checkpoint(tmp_path_factory)


class RoutingStage(ScriptedStage):
    """A scripted stage that takes session keys, as ``ReplicaSetClient`` does."""

    def __init__(self, *args, routes_by_session: bool = True) -> None:
        super().__init__(*args)
        self.routes_by_session = routes_by_session
        self.sessions: list[str | None] = []

    def add_request(self, request_id, prompt_token_ids, params, sink, group=None, session=None):
        self.sessions.append(session)
        super().add_request(request_id, prompt_token_ids, params, sink, group)


def test_session_key_is_the_header_else_the_user():
    assert session_key({SESSION_HEADER: "s1"}, "alice") == "s1"
    assert session_key({}, "alice") == "alice"
    assert session_key({SESSION_HEADER: ""}, "alice") == "alice"
    assert session_key({}, None) is None
    assert session_key({}, 7) is None  # not a string: no key
    assert session_key({SESSION_HEADER: "k" * 1000}, None) == "k" * 256


async def test_session_reaches_a_routing_client_with_every_choice(ckpt):
    stage = RoutingStage(scripted_info(ckpt), Script([44]))
    async with running(ckpt, client_factory=scripted_factory(stage)) as live:
        assert live.state.client.routes_by_session
        completion = {"prompt": [5], "max_tokens": 1}
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        sent = [
            ("/v1/completions", {**completion, "n": 2}, {SESSION_HEADER: "chat-1"}),
            ("/v1/completions", {**completion, "user": "alice"}, {}),
            ("/v1/chat/completions", {**chat, "user": "bob"}, {SESSION_HEADER: "chat-2"}),
            ("/v1/chat/completions", {**chat, "user": "bob"}, {}),
            ("/v1/completions", {**completion, "stream": True}, {}),
        ]
        for path, body, headers in sent:
            status, _, raw = await live.post(path, body, headers=headers)
            assert status == 200, raw
    assert stage.sessions == ["chat-1", "chat-1", "alice", "chat-2", "bob", None]


async def test_clients_that_do_not_route_by_session_never_get_it(ckpt):
    quiet = RoutingStage(scripted_info(ckpt), Script([44]), routes_by_session=False)
    plain = ScriptedStage(scripted_info(ckpt), Script([44]))  # add_request has no session
    for stage in (quiet, plain):
        async with running(ckpt, client_factory=scripted_factory(stage)) as live:
            assert not live.state.client.routes_by_session
            body = {"prompt": [5], "max_tokens": 1, "user": "alice"}
            status, _, raw = await live.post("/v1/completions", body, headers={SESSION_HEADER: "s"})
            assert status == 200, raw
        assert len(stage.added) == 1
    assert quiet.sessions == [None]


def test_an_empty_session_key_is_no_key():
    assert session_key({SESSION_HEADER: ""}, "") is None
