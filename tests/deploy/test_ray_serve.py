"""The Ray Serve application on a local Ray instance this module starts: 2 CPUs, the tiny chat model, 2
engine replicas of one torch thread each, reached through both fronts: Serve's HTTP proxy and the ingress
deployment (`serve run`), and an ingress hosted in this process over the replicas' handle (`ladder serve
--ray`). The OpenAI client answers through each, prefix routing shows in each front's /metrics, and a
killed replica fails its in-flight stream cleanly while service goes on and Serve replaces it."""

from __future__ import annotations

import json
import os
import threading
import time

import httpx
import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'ladder[ray]')")
from ray import serve
from server_process import free_port
from waiting import wait_until

from deploy.ray_app import RayAppConfig, build_app

APP = "ladder"
GROUPS = [f"Group {g}: you are assistant number {g} and you answer every question about topic {g} at length. "
          for g in range(4)]  # each over 64 characters: one full prefix block at least


def metrics(url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


@pytest.fixture(scope="module")
def ray_app(tiny_dir):
    model_dir = tiny_dir
    niceness = os.environ.get("RAY_worker_niceness")
    os.environ["RAY_worker_niceness"] = "0"  # as `ladder serve --ray` starts them: not below the other tests
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    if niceness is None:
        os.environ.pop("RAY_worker_niceness")
    else:
        os.environ["RAY_worker_niceness"] = niceness
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = RayAppConfig(replicas=2, num_cpus_per_replica=1, shutdown_timeout=2,
                              engine={"model": str(model_dir), "kv_cache_memory_gib": 0.02, "max_model_len": 512,
                                      "max_num_seqs": 8},
                              server={"served_model_name": "tiny"})
        serve.run(build_app(config), name=APP, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        ray.shutdown()  # stops every process of this Ray instance; Serve's graceful drain is not under test


@pytest.fixture(scope="module")
def process_front(ray_app):
    """The ingress as `ladder serve --ray` hosts it: an HTTP server of this process, routing through its own
    handle to the same replicas (its router, and its counts, are this process's)."""
    import uvicorn

    from deploy.ingress import LadderIngress, ingress_asgi_app

    handle = serve.get_deployment_handle("LadderReplica", app_name=APP)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(ingress_asgi_app(LadderIngress(handle)), host="127.0.0.1", port=port,
                                           lifespan="off", access_log=False, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), what="the ingress serving")
    assert server.started, "the ingress's server thread ended before it started serving"
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


@pytest.fixture(params=["serve", "process"])
def front(request):
    return request.getfixturevalue("ray_app" if request.param == "serve" else "process_front")


def test_the_openai_client_answers_through_ray(front):
    import openai

    ray_app = front

    client = openai.OpenAI(base_url=ray_app + "/v1", api_key="unused", max_retries=0)
    completion = client.completions.create(model="tiny", prompt="Hello there", max_tokens=5)
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 5
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=6, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 6
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # The replicas' own validation and errors come back unchanged, status and shape.
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt="Hi", max_tokens=5, temperature=-1)
    assert caught.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="another", prompt="Hi", max_tokens=5)
    assert httpx.get(ray_app + "/ready", timeout=10).json() == {"status": "ready"}
    assert httpx.get(ray_app + "/health", timeout=10).json() == {"status": "ok"}


def test_an_ingress_with_a_key_refuses_requests_without_it(ray_app):
    """The key check over the real replicas' handle (tests/deploy/test_ingress_auth.py has the cases)."""
    from starlette.testclient import TestClient

    from deploy.ingress import LadderIngress, ingress_asgi_app

    handle = serve.get_deployment_handle("LadderReplica", app_name=APP)
    # Not as a context manager: the app answers http only (no lifespan), as uvicorn runs it.
    client = TestClient(ingress_asgi_app(LadderIngress(handle, api_key="the-key")))
    body = {"prompt": "Hello", "max_tokens": 2}
    refused = client.post("/v1/completions", json=body)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    served = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer the-key"})
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 2
    assert client.get("/ready").json() == {"status": "ready"}  # probes need no key


def test_prefix_routing_shows_in_metrics(front):
    ray_app = front
    before = metrics(ray_app)
    served_by: dict[int, set[str]] = {g: set() for g in range(len(GROUPS))}
    with httpx.Client(base_url=ray_app, timeout=30) as client:
        for round_ in range(3):
            for g, prefix in enumerate(GROUPS):
                response = client.post("/v1/completions", json={"prompt": f"{prefix}Question {round_}?",
                                                                 "max_tokens": 2})
                assert response.status_code == 200
                served_by[g].add(response.headers["x-ladder-replica"])
    after = metrics(ray_app)
    counted = {name: after[name] - before.get(name, 0.0) for name in
               ("ladder_router_requests_total", "ladder_router_prefix_matches_total",
                "ladder_router_prefix_hits_total")}
    # Every group's first request is new; each later one found its group's replica and went there.
    assert counted == {"ladder_router_requests_total": 12, "ladder_router_prefix_matches_total": 8,
                       "ladder_router_prefix_hits_total": 8}
    assert all(len(replicas) == 1 for replicas in served_by.values())
    # New prefixes go to the replica holding fewer when loads are equal: the groups spread over both.
    assert len(set().union(*served_by.values())) == 2


def test_a_killed_replica_fails_its_stream_cleanly_and_service_goes_on(ray_app):
    body = {"prompt": "Tell me a long story", "max_tokens": 400, "ignore_eos": True, "stream": True}
    events = []
    with httpx.Client(base_url=ray_app, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            victim = response.headers["x-ladder-replica"]
            lines = response.iter_lines()
            events.append(next(line for line in lines if line.startswith("data: ")))
            actor = next(a for a in ray.util.list_named_actors(all_namespaces=True)
                         if a["name"].endswith(f"#{victim}"))
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
            events += [line for line in lines if line.startswith("data: ")]
        # The stream ends as an engine failure ends one in `ladder serve`: an error event, then [DONE].
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))
        assert error["error"]["type"] == "service_unavailable", events[-2]
        assert len(events) < 400  # it stopped early, not after all its tokens
        # The other replica keeps serving (a request routed to the dead one before Serve notices is retried).
        for i in range(6):
            response = client.post("/v1/completions", json={"prompt": f"after the kill {i}", "max_tokens": 3})
            assert response.status_code == 200, response.text
            assert response.headers["x-ladder-replica"] != victim
    assert metrics(ray_app)["ladder_router_replica_deaths_total"] >= 1
    # Serve replaces the dead replica.
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if "#LadderReplica#" in a["name"]]
        status = serve.status().applications[APP].deployments["LadderReplica"]
        if len(names) == 2 and not any(n.endswith(victim) for n in names) and status.status == "HEALTHY":
            break
        time.sleep(1)
    else:
        pytest.fail(f"the killed replica was not replaced: {names}, {status}")


def test_app_arguments_are_typed_and_checked():
    config = RayAppConfig.from_args({"replicas": "2", "max_replicas": "4", "max_num_seqs": "16",
                                     "model": "/models/x", "kv_cache_memory_gib": "0.5",
                                     "enable_prefix_caching": "false", "api_key": "k", "step_timeout": "none"})
    assert config.replicas == 2 and config.step_timeout is None
    assert config.engine == {"max_num_seqs": 16, "model": "/models/x", "kv_cache_memory_gib": 0.5,
                             "enable_prefix_caching": False}
    assert config.server == {"api_key": "k"}
    scaling = config.autoscaling()  # the queue-depth target: the engine's batch
    assert (scaling.min_replicas, scaling.initial_replicas, scaling.max_replicas) == (1, 2, 4)
    assert scaling.target_ongoing_requests == 16
    assert RayAppConfig(replicas=3).autoscaling() is None
    for args, message in (({"replicas": "0"}, "at least 1"), ({"replicas": "two"}, "expected int"),
                          ({"colour": "red"}, "unknown argument 'colour'"),
                          ({"replicas": "3", "max_replicas": "2"}, "min_replicas <= replicas <= max_replicas"),
                          ({"min_replicas": "1"}, "give max_replicas"), ({"max_queue": "0"}, "max_queue")):
        with pytest.raises(ValueError, match=message):
            RayAppConfig.from_args(args)
