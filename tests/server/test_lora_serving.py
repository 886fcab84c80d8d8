"""LoRA adapters over HTTP, through the official client and plain requests: a request picks an adapter by
`model`, /v1/models lists adapters with their parent, adapters load and unload at run time behind the
API key, an adapter in use is not unloaded, and a bad adapter is refused while the server serves on."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx
import pytest
from in_process_server import InProcessServer
from lora_adapters import ALL_TARGETS, make_peft_adapter

from engine import EngineConfig, LLMEngine
from engine.async_engine import AsyncLLMEngine
from engine.llm import LLM
from server.app import ServerSettings, ServerState

KEY = "sk-lora-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def adapters(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("server-loras")
    paths = {"alpha": root / "alpha", "beta": root / "beta"}
    make_peft_adapter(tiny_dir, paths["alpha"], dict(r=8, lora_alpha=16, target_modules=ALL_TARGETS), seed=1)
    make_peft_adapter(tiny_dir, paths["beta"], dict(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]),
                      seed=2)
    return paths


@pytest.fixture(scope="module")
def server(tiny_dir, adapters):
    state = ServerState(ServerSettings(api_key=KEY))
    engine = LLMEngine(EngineConfig(model=str(tiny_dir), kv_cache_memory_gib=0.01, max_model_len=256, max_num_seqs=8,
                                    lora_modules={"alpha": str(adapters["alpha"])}, max_loras=1))
    state.attach(AsyncLLMEngine(engine))
    running = InProcessServer(state)
    yield running
    running.stop()


def complete(url: str, model: str, max_tokens: int = 8, **extra) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60)


def test_models_lists_adapters_with_their_parent(server, adapters):
    data = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"]
    base = data[0]["id"]
    assert [(m["id"], m["parent"]) for m in data] == [(base, None), ("alpha", base)]
    assert data[1]["root"] == str(adapters["alpha"])


def test_a_request_runs_with_the_adapter_its_model_names(server, tiny_dir, adapters):
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY)
    base = client.models.list().data[0].id
    with_alpha = client.completions.create(model="alpha", prompt=PROMPT, max_tokens=8, temperature=0)
    without = client.completions.create(model=base, prompt=PROMPT, max_tokens=8, temperature=0)
    assert with_alpha.model == "alpha" and without.model == base
    offline = LLM(str(tiny_dir), lora=str(adapters["alpha"]), kv_cache_memory_gib=0.01, max_model_len=256)
    from engine.sampling_params import SamplingParams

    expected = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    assert with_alpha.choices[0].text == expected != without.choices[0].text
    chat = client.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.model == "alpha" and chat.choices[0].message.content is not None


def test_an_unknown_model_is_404_naming_what_is_served(server):
    reply = complete(server.url, "gamma")
    assert reply.status_code == 404
    assert "'gamma'" in reply.json()["error"]["message"] and "'alpha'" in reply.json()["error"]["message"]


def test_load_and_unload_at_run_time(server, adapters, tmp_path):
    url = server.url
    body = {"lora_name": "beta", "lora_path": str(adapters["beta"])}
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=body).status_code == 401  # behind the key
    loaded = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=AUTH)
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["rank"] == 4
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=AUTH).status_code == 400  # name taken
    # One slot (max_loras 1): alpha and beta take turns in it.
    texts = {name: complete(url, name).json()["choices"][0]["text"] for name in ("beta", "alpha", "beta")}
    assert texts["beta"] != texts["alpha"]
    assert server.state.engine.engine.lora.num_loads >= 3
    metrics = httpx.get(f"{url}/metrics", headers=AUTH).text
    assert "ladder_lora_adapters_resident 1.0" in metrics
    loads = next(line for line in metrics.splitlines() if line.startswith("ladder_lora_adapter_loads_total"))
    assert float(loads.split()[1]) >= 3
    unloaded = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "beta"}, headers=AUTH)
    assert unloaded.status_code == 200
    assert complete(url, "beta").status_code == 404
    missing = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "beta"}, headers=AUTH)
    assert missing.status_code == 404


def test_bad_adapters_are_refused_and_the_server_serves_on(server, tmp_path):
    url = server.url
    not_safetensors = tmp_path / "broken"
    not_safetensors.mkdir()
    (not_safetensors / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 8, "target_modules": ["q_proj"]}')
    (not_safetensors / "adapter_model.safetensors").write_bytes(b"garbage")
    cases = {str(not_safetensors): "not a readable safetensors file", str(tmp_path / "none"): "no such file"}
    for path, message in cases.items():
        reply = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": path},
                           headers=AUTH)
        assert reply.status_code == 400 and message in reply.json()["error"]["message"]
        assert "\n" not in reply.json()["error"]["message"]
    for body in ({"lora_name": "has space", "lora_path": "x"}, {"lora_path": "x"}, {"lora_name": "x"}):
        assert httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=AUTH).status_code == 400
    assert complete(url, "alpha").status_code == 200


def test_an_adapter_in_use_is_not_unloaded(server):
    url = server.url
    replies: list[httpx.Response] = []
    long = threading.Thread(target=lambda: replies.append(complete(url, "alpha", max_tokens=200, ignore_eos=True)))
    long.start()
    engine = server.state.engine.engine
    deadline = time.monotonic() + 30
    while not any(s.lora == "alpha" for samples in list(engine.requests.values()) for s in samples):
        assert time.monotonic() < deadline, "the request never reached the engine"
        time.sleep(0.01)
    refused = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "alpha"}, headers=AUTH)
    assert refused.status_code == 409 and "in use" in refused.json()["error"]["message"]
    long.join(120)
    assert replies[0].status_code == 200 and replies[0].json()["usage"]["completion_tokens"] == 200


def test_a_server_without_lora_slots_refuses_loads(tiny_dir, adapters):
    state = ServerState(ServerSettings())
    state.attach(AsyncLLMEngine(LLMEngine(EngineConfig(model=str(tiny_dir), kv_cache_memory_gib=0.01,
                                                       max_model_len=128))))
    running = InProcessServer(state)
    try:
        reply = httpx.post(f"{running.url}/v1/load_lora_adapter",
                           json={"lora_name": "alpha", "lora_path": str(adapters["alpha"])})
        assert reply.status_code == 400 and "--enable-lora" in reply.json()["error"]["message"]
    finally:
        running.stop()


def ladder(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ladder.cli", *args], capture_output=True, text=True, timeout=180)


def test_ladder_generate_with_a_lora(tiny_dir, adapters, tmp_path):
    common = ["generate", "Hello", "--model", str(tiny_dir), "--max-tokens", "8", "--quantization", "none", "--raw"]
    with_lora = ladder(*common, "--lora", str(adapters["alpha"]))
    without = ladder(*common)
    assert with_lora.returncode == 0 and without.returncode == 0, with_lora.stderr + without.stderr
    assert "+ alpha" in with_lora.stderr and with_lora.stdout != without.stdout
    offline = LLM(str(tiny_dir), lora=str(adapters["alpha"]), kv_cache_memory_gib=0.01, max_model_len=64,
                  quantization="none")
    from engine.sampling_params import SamplingParams

    expected = offline.generate("Hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert with_lora.stdout.startswith(expected.outputs[0].text[:10])
    broken = ladder(*common, "--lora", str(tmp_path / "missing"))
    assert broken.returncode == 1 and len(broken.stderr.strip().splitlines()) == 1
    assert "no such file" in broken.stderr
