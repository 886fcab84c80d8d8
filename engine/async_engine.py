"""The engine for asyncio servers: the step loop runs on its own thread, each request gets a stream.

The event loop never waits on the model. Requests and aborts are handed to the engine thread through a
queue and applied between steps; outputs come back with `call_soon_threadsafe` into one asyncio queue
per request. If a step raises, the engine is dead: every in-flight request ends with an error and new
requests are refused, while the process stays up to report it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

from engine.llm_engine import LLMEngine
from engine.outputs import SampleDelta
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats
from model.tokenizer import Tokenizer

log = logging.getLogger(__name__)


# The error every in-flight request gets when the step loop fails; the cause goes to the log only.
ENGINE_DIED = "the engine stopped after an internal error"


class EngineDeadError(RuntimeError):
    """The step loop failed; the engine takes no more requests."""


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class EngineInfo:
    """What the server needs to know of the engine it fronts, fixed once the model is loaded."""

    model_name: str
    model_path: Path
    tokenizer: Tokenizer | None
    vocab_size: int
    max_model_len: int
    num_kv_blocks: int
    block_size: int


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine  # used from the engine thread only
        self.info = EngineInfo(engine.model.name, engine.model.path, engine.tokenizer, engine.model.config.vocab_size,
                               engine.max_model_len, engine.blocks.num_blocks, engine.config.block_size)
        self.stats: EngineStats = engine.stats  # thread-safe: it takes its own lock
        self.commands: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        # request id -> (the caller's loop, its queue, n)
        self.streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, int]] = {}
        self.dead_reason: str | None = None
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ladder-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        return len(self.streams)

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[SampleDelta]:
        """Stream the request's deltas until all its samples finish. Leaving early aborts it."""
        if not self.is_alive:
            raise EngineDeadError(self.dead_reason or "the engine is stopped")
        request_id = request_id or self.new_request_id()
        stream: asyncio.Queue[SampleDelta] = asyncio.Queue()
        self.streams[request_id] = (asyncio.get_running_loop(), stream, params.n)
        if not self.is_alive:  # died while this request registered: it may have missed the death notice
            self.streams.pop(request_id, None)
            raise EngineDeadError(self.dead_reason or "the engine is stopped")
        self.commands.put(_Add(request_id, list(prompt_token_ids), params))
        finished: set[int] = set()
        try:
            while len(finished) < params.n:
                delta = await stream.get()
                if delta.index in finished:
                    continue  # a death notice after the sample had already ended
                if delta.finished:
                    finished.add(delta.index)
                yield delta
        finally:
            self.streams.pop(request_id, None)
            if len(finished) < params.n:  # the consumer went away: free the request's blocks at the next step
                self.commands.put(_Abort(request_id))

    def abort(self, request_id: str) -> None:
        self.commands.put(_Abort(request_id))

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self.commands.put(None)
        self._thread.join(timeout)

    # -- the engine thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._apply_commands(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    self._dispatch(self.engine.step())
        except Exception as error:  # the step loop must never die silently
            log.exception("engine step failed")
            self._die(f"engine step failed: {type(error).__name__}: {error}")

    def _apply_commands(self, block: bool) -> None:
        try:
            command = self.commands.get(timeout=0.5) if block else self.commands.get_nowait()
        except queue.Empty:
            return
        while command is not None:
            if isinstance(command, _Add):
                try:
                    self.engine.add_request(command.request_id, command.prompt_token_ids, command.params)
                except ValueError as error:
                    self._fail_request(command.request_id, command.params.n, str(error))
            else:
                self.engine.abort(command.request_id)
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return

    def _dispatch(self, deltas: list[SampleDelta]) -> None:
        for delta in deltas:
            target = self.streams.get(delta.request_id)
            if target is not None:
                loop, stream, _ = target
                try:
                    loop.call_soon_threadsafe(stream.put_nowait, delta)
                except RuntimeError:  # the caller's event loop is closed
                    pass

    def _fail_request(self, request_id: str, n: int, message: str) -> None:
        self._dispatch([SampleDelta.failure(request_id, i, message) for i in range(n)])

    def _die(self, reason: str) -> None:
        self.dead_reason = reason
        for request_id, (_, _, n) in list(self.streams.items()):
            self._fail_request(request_id, n, ENGINE_DIED)
