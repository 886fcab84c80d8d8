"""A real uvicorn server of ladder's app in a thread of the test process, so tests can reach into its
engine (fault injection, counters) while talking to it over HTTP."""

from __future__ import annotations

import threading

import uvicorn
from server_process import free_port
from waiting import wait_until

from engine import EngineConfig, LLMEngine
from engine.async_engine import AsyncLLMEngine
from server.app import ServerSettings, ServerState, create_app


def make_state(model_dir, step_timeout: float | None = None, max_model_len: int = 256, max_num_seqs: int = 8,
               **settings) -> ServerState:
    """The app's state over an engine of the model in `model_dir` with a small KV cache."""
    state = ServerState(ServerSettings(**settings))
    engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory_gib=0.01, max_model_len=max_model_len,
                                    max_num_seqs=max_num_seqs))
    state.attach(AsyncLLMEngine(engine, step_timeout=step_timeout))
    return state


class InProcessServer:
    """A real uvicorn server in a thread, so tests can reach into its engine."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(state), port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started or not self.thread.is_alive(), what="uvicorn started")
        assert self.server.started, "the server thread ended before it started serving"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.state.engine.shutdown()


# A chat request the chat-markup tests share: one user message, greedy, room for a reasoning block and a call.
DEFAULT_CHAT = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 60, "temperature": 0}


def chat_completion(server: InProcessServer, model: str, **fields):
    """POST /v1/chat/completions with DEFAULT_CHAT, `fields` over it; the httpx response."""
    import httpx

    return httpx.post(server.url + "/v1/chat/completions", json={"model": model, **DEFAULT_CHAT, **fields}, timeout=60)


def chat_events(server: InProcessServer, model: str, **fields) -> list[dict]:
    """The same request streamed: its server-sent events' JSON payloads, [DONE] left out."""
    import json

    import httpx

    body = {"model": model, **DEFAULT_CHAT, "stream": True, **fields}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]
