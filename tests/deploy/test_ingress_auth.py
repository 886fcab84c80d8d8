"""The Ray application's API key and the ingress's bounded parsing, without a Ray cluster: the ingress is
called as the plain ASGI app `ladder serve --ray` serves (Serve's proxy calls the same `__call__`), over a
stand-in for the replicas' handle, with a request body that fails the test if it is read."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'ladder[ray]')")

from deploy import prefix_key
from deploy.ingress import LadderIngress, ingress_asgi_app
from deploy.prefix_key import MAX_PARSE_BYTES, MAX_TEXT_CHARS, block_hashes, request_prefix
from deploy.ray_app import RayAppConfig, build_app, with_api_key_from_env

KEY = "s3cret-key"
BODY = json.dumps({"prompt": "You are a careful assistant. " * 10, "max_tokens": 2}).encode()
ANSWER = [{"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]},
          {"type": "http.response.body", "body": b'{"ok": true}', "more_body": False}]


class FakeStream:
    """A DeploymentResponseGenerator's part the ingress uses: batches of ASGI messages, and cancel."""

    def __init__(self, batches: list[list[dict]]) -> None:
        self.batches = list(batches)

    async def __anext__(self) -> list[dict]:
        if not self.batches:
            raise StopAsyncIteration
        return self.batches.pop(0)

    def cancel(self) -> None:
        pass


class FakeReplicas:
    """The replicas' DeploymentHandle: records what the ingress forwards and answers 200."""

    def __init__(self) -> None:
        self.forwarded = []

    def options(self, **_: object) -> FakeReplicas:
        return self

    def remote(self, request):
        self.forwarded.append(request)
        return FakeStream([ANSWER])


def call(ingress: LadderIngress, method: str, path: str, headers: dict[str, str], body: bytes | None = BODY):
    """(status, JSON body) of one request through the ingress's ASGI app. `body=None`: the request has a
    4 MiB body (declared) whose reading fails the test."""
    declared = len(body) if body is not None else 4 << 20
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "headers": [(k.lower().encode(), v.encode()) for k, v in
                         {"content-type": "application/json", "content-length": str(declared), **headers}.items()],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    chunks = [body] if body is not None else []

    async def receive() -> dict:
        if body is None:
            raise AssertionError("the ingress read the body of a request it should have refused")
        return {"type": "http.request", "body": chunks.pop() if chunks else b"", "more_body": False}

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(ingress_asgi_app(ingress)(scope, receive, send))
    payload = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(payload)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
                                     {"Authorization": KEY}, {"Authorization": f"Bearer {KEY}x"},
                                     {"Authorization": "Bearer "}],
                         ids=["none", "wrong", "basic", "no-scheme", "longer", "empty"])
@pytest.mark.parametrize("route", [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                   ("GET", "/v1/models"), ("POST", "/not/a/route"), ("POST", "/ready")])
def test_a_request_without_the_key_is_refused_before_its_body_is_read(route, headers):
    replicas = FakeReplicas()
    status, error = call(LadderIngress(replicas, api_key=KEY), *route, headers, body=None)
    # The server's own answer (server/app.py), OpenAI's shape; nothing went to a replica.
    assert status == 401
    assert error == {"error": {"message": "missing or invalid API key", "type": "authentication_error",
                               "param": None, "code": "invalid_api_key"}}
    assert replicas.forwarded == []


def test_a_request_with_the_key_is_forwarded_with_it():
    replicas = FakeReplicas()
    ingress = LadderIngress(replicas, api_key=KEY)
    for scheme in ("Bearer", "bearer"):
        assert call(ingress, "POST", "/v1/completions", {"Authorization": f"{scheme} {KEY}"}) == (200, {"ok": True})
    forwarded = replicas.forwarded[-1]
    assert forwarded.body == BODY and forwarded.prefix_hashes == request_prefix("/v1/completions", BODY)
    # The replica's server checks the key again: the header goes on with the request.
    assert (b"authorization", f"bearer {KEY}".encode()) in forwarded.headers


def test_public_pages_and_probes_need_no_key_and_no_key_means_no_check():
    replicas = FakeReplicas()
    ingress = LadderIngress(replicas, api_key=KEY)
    assert call(ingress, "GET", "/health", {}) == (200, {"status": "ok"})  # answered by the ingress itself
    for path in ("/ready", "/", "/static/dashboard.js", "/openapi.json"):
        assert call(ingress, "GET", path, {})[0] == 200, path
    assert len(replicas.forwarded) == 4
    for path in ("/stats", "/metrics"):  # exact prefix-hit counts: behind the key, as `ladder serve` has them
        assert call(ingress, "GET", path, {})[0] == 401, path
    open_ingress = LadderIngress(replicas)  # no key: everything goes on, as `ladder serve` without --api-key
    assert call(open_ingress, "POST", "/v1/completions", {}) == (200, {"ok": True})


def test_the_server_asks_for_the_key_exactly_where_the_shared_list_says():
    """Every route of `ladder serve`'s app, with a key and no token: 401 where server/access.py says the key
    is needed (the list the ingress uses too), an answer other than 401 everywhere else."""
    from fastapi.testclient import TestClient

    from server.access import PUBLIC_PATHS, is_public
    from server.app import ServerSettings, ServerState, create_app

    for protect in (True, False):
        app = create_app(ServerState(ServerSettings(api_key=KEY, protect_metrics=protect)))
        seen = set()
        with TestClient(app) as client:
            for route in app.routes:
                path = route.path.replace("{name}", "dashboard.js")
                for method in route.methods - {"HEAD"}:
                    status = client.request(method, path).status_code
                    assert (status == 401) is not is_public(method, path, metrics_need_key=protect), (method, path)
                seen.add(path)
            assert client.post("/v1/completions", content=b"{not json").status_code == 401  # before parsing
            assert client.get("/unknown").status_code == 401
        assert PUBLIC_PATHS <= seen  # nothing listed that the server no longer has
    assert not is_public("POST", "/health", True) and not is_public("GET", "/v1/models", False)
    assert not is_public("GET", "/static", False) and not is_public("GET", "/metrics", True)


def test_an_empty_key_is_refused_and_the_key_reaches_ingress_and_replicas():
    with pytest.raises(ValueError, match="empty"):
        LadderIngress(FakeReplicas(), api_key="")
    with pytest.raises(ValueError, match="api_key is empty"):
        RayAppConfig.from_args(with_api_key_from_env({}, {"LADDER_API_KEY": ""}))
    # $LADDER_API_KEY when the arguments give none; an argument wins.
    assert with_api_key_from_env({"replicas": 2}, {"LADDER_API_KEY": KEY}) == {"replicas": 2, "api_key": KEY}
    assert with_api_key_from_env({"api_key": "arg"}, {"LADDER_API_KEY": KEY})["api_key"] == "arg"
    assert with_api_key_from_env({}, {}) == {}
    config = RayAppConfig.from_args(with_api_key_from_env({"replicas": 2}, {"LADDER_API_KEY": KEY}))
    assert config.api_key == KEY and RayAppConfig().api_key is None
    app = build_app(config)  # no cluster needed to bind: the ingress's and the replicas' arguments
    ingress = app._bound_deployment
    replicas, max_body_bytes, api_key = ingress.init_args
    assert (max_body_bytes, api_key) == (config.max_body_bytes, KEY)
    assert replicas._bound_deployment.init_args[1]["api_key"] == KEY  # the replicas' ServerSettings


def test_the_prefix_of_a_large_body_is_not_parsed(monkeypatch):
    text = "word " * 1000
    small = json.dumps({"prompt": text}).encode()
    assert request_prefix("/v1/completions", small) == block_hashes(text)
    large = json.dumps({"prompt": text, "pad": "x" * MAX_PARSE_BYTES}).encode()

    def refuse(*_: object, **__: object):
        raise AssertionError("json.loads ran on a body over MAX_PARSE_BYTES")

    monkeypatch.setattr(prefix_key.json, "loads", refuse)
    assert request_prefix("/v1/completions", large) == ()  # routed by load alone


def test_malformed_bodies_route_anywhere_without_an_error():
    deep = b"[" * 100_000 + b"]" * 100_000  # nesting past Python's recursion limit
    assert request_prefix("/v1/completions", b'{"prompt": ' + deep + b"}") == ()
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}, {"text": "Hi"}, "x"]}]}
    assert prefix_key.routing_text("/v1/chat/completions", json.dumps(parts).encode()) == "user\x00Hi\x00"


def test_long_prompts_hash_as_before_from_bounded_text():
    # Only the first MAX_TEXT_CHARS characters are hashed: stopping there changes no hash.
    messages = [{"role": "user", "content": f"message number {i} " * 20} for i in range(200)]
    full = "".join(f"user\x00{m['content']}\x00" for m in messages)
    body = json.dumps({"messages": messages}).encode()
    assert len(full) > 10 * MAX_TEXT_CHARS
    assert request_prefix("/v1/chat/completions", body) == block_hashes(full)
    tokens = list(range(1000, 30000))
    assert request_prefix("/v1/completions", json.dumps({"prompt": tokens}).encode()) == block_hashes(
        ",".join(map(str, tokens)))


def test_a_key_that_reads_like_none_stays_a_key():
    # Other string arguments turn "none" into None (the default); a key must never turn into no key.
    for key in ("none", "null", "None"):
        assert RayAppConfig.from_args({"api_key": key}).api_key == key
    assert RayAppConfig.from_args({"api_key": None}).api_key is None  # YAML's null: no key, deliberately


def test_serve_ray_refuses_an_empty_key_in_one_line_before_starting_ray(tiny_dir, monkeypatch, capsys):
    from ladder.cli import main

    monkeypatch.setenv("LADDER_API_KEY", "")  # set, but to nothing: not a way to serve without a key
    assert main(["serve", "--ray", "--model", str(tiny_dir)]) == 1
    assert "API key is empty" in capsys.readouterr().err
