"""LoRA adapters changed at run time: vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter.

Both need the API key (when the server has one) and an engine started with LoRA slots (`--enable-lora`
or `--lora-modules`). An adapter is read and checked off the event loop (model/lora.py) before the engine
takes it between two steps; an adapter that unfinished requests use is not unloaded (409). Loading reads
a path on the server's own file system, which is why it sits behind the key.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse

from engine.async_engine import EngineDeadError, in_passing_thread
from engine.lora_manager import LoRAInUseError
from model.errors import ModelLoadError
from model.lora import load_adapter
from server import protocol as p
from server.errors import APIError

if TYPE_CHECKING:
    from server.app import ServerState

ERRORS = {status: {"model": p.ErrorResponse} for status in (400, 401, 404, 409, 503)}


def install_lora_routes(app: FastAPI, state: ServerState, authorize) -> None:
    def lora_engine():
        engine = state.ready_engine()
        if not engine.info.lora_enabled:
            raise APIError(400, "this server has no LoRA slots; start it with --enable-lora or --lora-modules")
        return engine

    @app.post("/v1/load_lora_adapter", responses=ERRORS, dependencies=[Depends(authorize)])
    async def load_lora_adapter(body: p.LoadLoRARequest) -> JSONResponse:
        engine = lora_engine()
        name = body.lora_name
        if name == state.model_name or name in engine.loras:
            raise APIError(400, f"the model name {name!r} is already served", param="lora_name")
        try:
            # Not asyncio.to_thread: the adapter's torch ops on a pool thread would slow every later step.
            adapter = await in_passing_thread(load_adapter, body.lora_path, engine.info.model_config, name)
            await engine.add_lora(adapter)
        except EngineDeadError:
            raise APIError(503, "the engine has stopped after an internal error") from None
        except (ModelLoadError, ValueError) as error:
            raise APIError(400, " ".join(str(error).split()), param="lora_path") from None
        return JSONResponse({"object": "lora_adapter", "id": name, "root": str(adapter.path),
                             "parent": state.model_name, "rank": adapter.rank, "status": "loaded"})

    @app.post("/v1/unload_lora_adapter", responses=ERRORS, dependencies=[Depends(authorize)])
    async def unload_lora_adapter(body: p.UnloadLoRARequest) -> JSONResponse:
        engine = lora_engine()
        name = body.lora_name
        try:
            await engine.remove_lora(name)
        except EngineDeadError:
            raise APIError(503, "the engine has stopped after an internal error") from None
        except LoRAInUseError as error:
            raise APIError(409, str(error), param="lora_name") from None
        except KeyError:
            raise APIError(404, f"no LoRA adapter named {name!r} is loaded", param="lora_name",
                           code="model_not_found") from None
        return JSONResponse({"object": "lora_adapter", "id": name, "status": "unloaded"})
