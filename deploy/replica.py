"""One engine replica: `ladder serve`'s FastAPI app over its own engine, called by the ingress."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import torch
from ray import serve

from deploy.forwarding import ForwardedRequest, call_asgi
from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from server.app import ServerSettings, ServerState, create_app

log = logging.getLogger("ladder.replica")


class LadderReplica:
    """Loads the model in the constructor, so Serve routes nothing to it before it can answer."""

    def __init__(self, engine_kwargs: dict, server_kwargs: dict, num_threads: int,
                 step_timeout: float | None) -> None:
        # Replicas share the machine: each computes on its own share of the cores.
        torch.set_num_threads(num_threads)
        start = time.perf_counter()
        self.state = ServerState(ServerSettings(**server_kwargs))
        self.state.attach(AsyncLLMEngine(LLMEngine(EngineConfig(**engine_kwargs)), step_timeout=step_timeout))
        self.app = create_app(self.state)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        log.info("replica %s loaded %s in %.1f s with %d threads", self.replica_id, self.state.model_name,
                 time.perf_counter() - start, num_threads)

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[list[dict]]:
        async for messages in call_asgi(self.app, request, self.replica_id):
            yield messages

    def check_health(self) -> None:
        # Serve calls this periodically and replaces a replica that raises: a dead engine step loop
        # (an internal error, or a hung step caught by the watchdog) makes the replica useless.
        engine = self.state.engine
        if engine is None or not engine.is_alive:
            raise RuntimeError(f"the engine of replica {self.replica_id} has stopped")

    def __del__(self) -> None:
        # Serve has already waited (graceful_shutdown_timeout_s) for in-flight requests.
        engine = getattr(getattr(self, "state", None), "engine", None)
        if engine is not None:
            engine.shutdown()
