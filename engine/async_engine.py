"""The engine for asyncio servers: the step loop runs on its own thread, each request gets a stream.

The event loop never waits on the model. Requests and aborts are handed to the engine thread through a
queue and applied between steps; outputs come back with `call_soon_threadsafe` into one asyncio queue
per request.

Faults, as designed:
- A request's own part of a step (its inputs, its sampled row, its text) that raises ends that request
  with an error; the step's other requests keep their tokens and nothing counts against the engine
  (engine/llm_engine.py, engine/sampler.py).
- A step that raises otherwise (the forward pass) fails every request in flight (STEP_FAILED); the engine aborts them, checks that
  every KV block came back, and serves new requests. After MAX_CONSECUTIVE_STEP_FAILURES failed steps
  with no good step between (or if its bookkeeping did not come back whole) the engine is dead: requests
  end with ENGINE_DIED, new ones are refused, and the process stays up to report it (health 503).
- A tensor-parallel worker that dies (or a collective that fails) ends the group for good: every request
  in flight ends with ENGINE_WORKER_LOST (503) as soon as the worker's process exits, even between
  steps, and the engine is dead.
- A step that runs past `step_timeout` seconds (a hung forward) cannot be interrupted; a watchdog
  thread logs it, ends every request in flight with ENGINE_HUNG and marks the engine dead, so clients
  get an answer and health turns 503 for the orchestrator to restart the process.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from engine.config import EngineConfig
from engine.guide import GuideCompiler
from engine.image_cache import ImageEncoding
from engine.llm_engine import LLMEngine
from engine.outputs import SampleDelta
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats
from model.config import ModelConfig
from model.image_processor import Gemma3ImageProcessor, ImageProcessor, ProcessedImage
from model.lora import LoRAAdapter
from model.pooling import Pooling
from model.precision import precision_of_dtype
from model.tokenizer import Tokenizer
from model.vision import EncodedImages, joined

log = logging.getLogger(__name__)
T = TypeVar("T")


# The errors in-flight requests get when a step fails; the cause goes to the log only.
ENGINE_DIED = "the engine stopped after an internal error"
STEP_FAILED = "the engine step running this request failed"
ENGINE_HUNG = "the engine stopped responding: a step ran past its time limit"
ENGINE_WORKER_LOST = "the engine lost a tensor-parallel worker process and cannot run; restart the server"
MAX_CONSECUTIVE_STEP_FAILURES = 3


class EngineDeadError(RuntimeError):
    """The step loop failed; the engine takes no more requests."""


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    lora: str | None = None
    pooling: str | None = None  # an embedding request (LLMEngine.add_request)
    images: EncodedImages | None = None  # the prompt's images' embeddings (LLMEngine.add_request)


@dataclass(frozen=True)
class _Encode:
    """Run the vision tower over a prompt's images, between steps (see `AsyncLLMEngine.encode_images`)."""

    images: list[ProcessedImage]
    done: concurrent.futures.Future


@dataclass(frozen=True)
class _ChangeLoRA:
    """Add an adapter (read off the engine thread) or remove one by name, between steps."""

    adapter: LoRAAdapter | None
    name: str
    done: concurrent.futures.Future


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
    # What the dashboard and `ladder doctor --base-url` show of the deployment (GET /stats).
    model_config: ModelConfig | None = None
    engine_config: EngineConfig | None = None
    precision: str | None = None  # the artifact's precision, or the eager weights' dtype (fp32, bf16, fp16)
    # Compiles structured-output guides (thread-safe, cached; None without a tokenizer): the server compiles
    # a request's guide off its event loop to refuse a bad one, and the engine finds it in the cache.
    guides: GuideCompiler | None = None
    lora_enabled: bool = False  # the engine has LoRA slots: adapters may be loaded at run time
    kv_cache_dtype: str = "float32"  # the KV cache's element type, torch's name (--kv-cache-dtype resolved)
    # A request's sampling fields default to these when it leaves them out (the model's generation_config.json).
    sampling_defaults: dict = field(default_factory=dict)
    # How embeddings are pooled and normalized (model/pooling.py), and why this engine cannot make them
    # (None: it can).
    pooling: Pooling = field(default_factory=Pooling)
    embeddings_unavailable: str | None = None
    # The model is a reranker file (a classification head of LM-head rows, model/loader.py read_score_rows).
    reranker_file: bool = False
    # The image processor of a model that reads images (model/image_processor.py), else None; its vision
    # tower runs through `AsyncLLMEngine.encode_images`.
    image_processor: ImageProcessor | Gemma3ImageProcessor | None = None


async def in_passing_thread(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on a thread of its own that ends when it returns, for torch work beside the engine (an
    adapter's tensors read and reshaped). A thread that lives on, as `asyncio.to_thread`'s do, keeps the
    OpenMP team its first parallel op made; with more OpenMP threads than cores libgomp stops spinning
    between parallel regions and every later engine step runs ~3x slower (measured: one 1M-element op on a
    pool thread took a decode from 159 to 55 tok/s for good; see `AsyncLLMEngine.encode_images`)."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ladder-passing")
    try:
        future = pool.submit(fn, *args)
    finally:
        pool.shutdown(wait=False)  # its thread ends once `fn` returns
    return await asyncio.wrap_future(future)


def weight_precision(engine: LLMEngine) -> str:
    manifest = getattr(engine.model, "manifest", None)  # artifacts carry theirs
    if manifest is not None:
        return manifest.precision
    if engine.model.quantization != "none":  # int8 linears applied at load
        return engine.model.quantization
    return precision_of_dtype(engine.model.module.activation_dtype)


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, step_timeout: float | None = None) -> None:
        """`step_timeout`: seconds one step may run before the watchdog declares the engine hung (None: no
        watchdog)."""
        if step_timeout is not None and step_timeout <= 0:
            raise ValueError(f"step_timeout must be positive, got {step_timeout}")
        self.engine = engine  # used from the engine thread only
        self.info = EngineInfo(engine.model.name, engine.model.path, engine.tokenizer, engine.model.config.vocab_size,
                               engine.max_model_len, engine.blocks.num_blocks, engine.config.block_size,
                               model_config=engine.model.config, engine_config=engine.config,
                               precision=weight_precision(engine), guides=engine.guides,
                               lora_enabled=engine.lora is not None, sampling_defaults=engine.sampling_defaults,
                               kv_cache_dtype=str(engine.runner.kv_caches[0].dtype).removeprefix("torch."),
                               pooling=engine.pooling, embeddings_unavailable=engine.embeddings_unavailable,
                               reranker_file=bool(getattr(engine.model.module, "score_rows", None)),
                               image_processor=engine.vision.processor if engine.vision else None)
        self.stats: EngineStats = engine.stats  # thread-safe: it takes its own lock
        # The adapters served, name -> where it was read from; replaced whole by the engine thread.
        self.loras: dict[str, Path] = self._lora_paths()
        self.commands: queue.SimpleQueue[_Add | _Abort | _ChangeLoRA | _Encode | None] = queue.SimpleQueue()
        # Images going through the vision tower a few tiles between steps, oldest first (engine thread).
        self._encoding: collections.deque[tuple[_Encode, ImageEncoding]] = collections.deque()
        # request id -> (the caller's loop, its queue, n)
        self.streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, int]] = {}
        self.dead_reason: str | None = None
        self.num_step_failures = 0
        self._consecutive_failures = 0
        self._step_started: float | None = None  # monotonic start of the step running now
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ladder-engine", daemon=True)
        self._thread.start()
        engine.runner.module.on_failure(self._worker_lost)
        if step_timeout is not None:
            threading.Thread(target=self._watch, args=(step_timeout,), name="ladder-watchdog", daemon=True).start()

    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        return len(self.streams)

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    async def embed(self, prompt_token_ids: list[int], request_id: str | None = None,
                    lora: str | None = None, score_token_ids: tuple[int, ...] = ()) -> SampleDelta:
        """The final delta of an embedding request, pooled by the engine's rule (`info.pooling`): its
        `embedding` [hidden] float32, unnormalized, or its error. With `score_token_ids`, the `embedding` is
        instead the next-token logits [T] of those tokens after the prompt (a reranker's)."""
        params = SamplingParams(max_tokens=1, score_token_ids=score_token_ids)
        pooling = "last" if score_token_ids else self.info.pooling.kind
        async for delta in self.generate(prompt_token_ids, params, request_id, lora, pooling=pooling):
            last = delta
        return last

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
        lora: str | None = None, pooling: str | None = None, images: EncodedImages | None = None,
    ) -> AsyncIterator[SampleDelta]:
        """Stream the request's deltas until all its samples finish. Leaving early aborts it. `lora`: the
        adapter to run it with (None: the base model); `pooling`: an embedding request (`embed`); `images`:
        its prompt's images, encoded (`encode_images`)."""
        if not self.is_alive:
            raise EngineDeadError(self.dead_reason or "the engine is stopped")
        request_id = request_id or self.new_request_id()
        stream: asyncio.Queue[SampleDelta] = asyncio.Queue()
        self.streams[request_id] = (asyncio.get_running_loop(), stream, params.n)
        if not self.is_alive:  # died while this request registered: it may have missed the death notice
            self.streams.pop(request_id, None)
            raise EngineDeadError(self.dead_reason or "the engine is stopped")
        self.commands.put(_Add(request_id, list(prompt_token_ids), params, lora, pooling, images))
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

    async def encode_images(self, images: list[ProcessedImage]) -> EncodedImages:
        """Run the vision tower over a prompt's images on the engine thread, `vision_tiles_per_step` tiles
        (EngineConfig) between two steps, so the requests running meanwhile wait for a tile at a time, not a
        whole image; ValueError when the model takes no images.

        Not on a worker thread beside the steps: a second thread running torch's parallel ops keeps an
        OpenMP team of its own alive, and with more OpenMP threads than cores libgomp stops spinning between
        parallel regions, so every later decode step of the engine thread ran 3x slower (measured: 190 tok/s
        before a worker thread's first tower run, 62 after, for good)."""
        if not self.is_alive:
            raise EngineDeadError(self.dead_reason or "the engine is stopped")
        done: concurrent.futures.Future = concurrent.futures.Future()
        self.commands.put(_Encode(images, done))
        if not self.is_alive:  # died meanwhile: its last drain may have run before the put
            self._drain_waiting()
        return await asyncio.wrap_future(done)

    async def add_lora(self, adapter: LoRAAdapter) -> None:
        """Serve another adapter from the next step on; ValueError as `LLMEngine.add_lora`."""
        await self._change_lora(adapter, adapter.name)

    async def remove_lora(self, name: str) -> None:
        """Stop serving an adapter; KeyError when unknown, LoRAInUseError while requests (queued ones too)
        use it."""
        await self._change_lora(None, name)

    async def _change_lora(self, adapter: LoRAAdapter | None, name: str) -> None:
        if not self.is_alive:
            raise EngineDeadError(self.dead_reason or "the engine is stopped")
        done: concurrent.futures.Future = concurrent.futures.Future()
        self.commands.put(_ChangeLoRA(adapter, name, done))
        if not self.is_alive:  # died meanwhile: its last drain may have run before the put
            self._drain_waiting()
        await asyncio.wrap_future(done)

    def _lora_paths(self) -> dict[str, Path]:
        manager = self.engine.lora
        return {name: a.path for name, a in manager.adapters.items()} if manager is not None else {}

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self.commands.put(None)
        self._thread.join(timeout)
        self._drain_waiting()
        self.engine.close()

    # -- the engine thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set() and self.dead_reason is None:
            try:
                self._apply_commands(block=not self.engine.has_unfinished() and not self._encoding)
                if self._encoding:
                    self._advance_encoding()
                if self.engine.has_unfinished():
                    self._step_started = time.monotonic()
                    deltas = self.engine.step()
                    self._step_started = None
                    if self.dead_reason is not None:  # the watchdog gave up on this step meanwhile
                        return
                    self._consecutive_failures = 0
                    self._dispatch(deltas)
            except Exception as error:  # the step loop must never die silently
                self._step_started = None
                if self.dead_reason is not None:
                    return
                failure = self.engine.runner.module.failure
                if failure is not None:  # the model can run no step again: nothing to recover
                    self._worker_lost(failure)
                    return
                log.exception("engine step failed")
                self._recover(f"{type(error).__name__}: {error}")

    def _recover(self, cause: str) -> None:
        """After a failed step: fail and drop every request, and go on if the bookkeeping is whole."""
        self.num_step_failures += 1
        self._consecutive_failures += 1
        if self._consecutive_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            self._die(f"{self._consecutive_failures} engine steps failed in a row, the last with {cause}")
            return
        # Requests still in the command queue were in no step: they run as usual.
        failed = list(self.engine.requests)
        try:
            for request_id in failed:
                self.engine.abort(request_id)
            self.engine.step()  # releases the aborted requests' blocks; nothing is left to run
            blocks = self.engine.blocks
            if self.engine.has_unfinished() or blocks.num_free_blocks != blocks.num_blocks:
                raise RuntimeError(f"{blocks.num_blocks - blocks.num_free_blocks} KV blocks still held")
        except Exception as error:
            log.exception("engine recovery failed")
            self._die(f"engine step failed ({cause}) and recovery failed: {type(error).__name__}: {error}")
            return
        for request_id in failed:  # told only now, so a client that hears of the failure finds the blocks free
            target = self.streams.get(request_id)
            if target is not None:
                self._fail_request(request_id, target[2], STEP_FAILED)
        log.warning("engine step failed (%s); its requests got errors, the engine serves on (%d of %d "
                    "failures in a row allowed)", cause, self._consecutive_failures,
                    MAX_CONSECUTIVE_STEP_FAILURES - 1)

    def _worker_lost(self, reason: str) -> None:
        """The tensor-parallel group failed (called from its monitor thread or the engine thread)."""
        if self.dead_reason is None:
            self._die(reason, ENGINE_WORKER_LOST)

    def _watch(self, timeout: float) -> None:
        """The step watchdog: a step over `timeout` seconds ends every request with ENGINE_HUNG."""
        while not self._stop.wait(min(timeout / 4, 1.0)):
            started = self._step_started
            if started is None or self.dead_reason is not None:
                continue
            elapsed = time.monotonic() - started
            if elapsed > timeout:
                log.error("engine step has run for %.1f s, over the %.1f s step timeout: failing %d requests in "
                          "flight with 503 and refusing new ones; restart the server", elapsed, timeout,
                          len(self.streams))
                self._die(f"engine step hung: no return after {elapsed:.1f} s (step timeout {timeout} s)",
                          ENGINE_HUNG)
                return

    def _apply_commands(self, block: bool) -> None:
        try:
            command = self.commands.get(timeout=0.5) if block else self.commands.get_nowait()
        except queue.Empty:
            return
        while command is not None:
            if isinstance(command, _Add):
                try:
                    self.engine.add_request(command.request_id, command.prompt_token_ids, command.params,
                                            command.lora, command.pooling, command.images)
                except ValueError as error:
                    self._fail_request(command.request_id, command.params.n, str(error))
            elif isinstance(command, _ChangeLoRA):
                self._change_lora_now(command)
            elif isinstance(command, _Encode):
                self._start_encoding(command)
            else:
                self.engine.abort(command.request_id)
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return

    def _start_encoding(self, command: _Encode) -> None:
        try:
            self._encoding.append((command, self.engine.start_encoding(command.images)))
        except ValueError as error:
            command.done.set_exception(error)

    def _advance_encoding(self) -> None:
        """The oldest pending encoding's next tiles; its result to its caller once all are through."""
        command, encoding = self._encoding[0]
        try:
            self.engine.advance_encoding(encoding, self.engine.config.vision_tiles_per_step or encoding.num_tiles)
            if encoding.done:
                self._encoding.popleft()
                command.done.set_result(joined(command.images, encoding.result()))
        except Exception as error:  # the tower failed: this caller's request fails, the engine serves on
            self._encoding.popleft()
            log.exception("the vision tower failed")
            command.done.set_exception(error)

    def _change_lora_now(self, command: _ChangeLoRA) -> None:
        try:
            if command.adapter is not None:
                self.engine.add_lora(command.adapter)
            else:
                self.engine.remove_lora(command.name)
        except (ValueError, KeyError) as error:  # LoRAInUseError is a ValueError
            command.done.set_exception(error)
            return
        self.loras = self._lora_paths()
        command.done.set_result(None)

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

    def _die(self, reason: str, message: str = ENGINE_DIED) -> None:
        log.error("the engine is dead (%s): requests in flight end with errors, new ones are refused", reason)
        self.dead_reason = reason
        for request_id, (_, _, n) in list(self.streams.items()):
            self._fail_request(request_id, n, message)
        self._drain_waiting()

    def _drain_waiting(self) -> None:
        """A dead or stopped engine applies no more commands: the adapter changes and image encodings
        waiting in the queue, or begun, fail (the requests waiting there were failed through their streams)."""
        while self._encoding:
            command, _ = self._encoding.popleft()
            if not command.done.done():
                command.done.set_exception(EngineDeadError(self.dead_reason or "the engine is stopped"))
        while True:
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _ChangeLoRA | _Encode) and not command.done.done():
                command.done.set_exception(EngineDeadError(self.dead_reason or "the engine is stopped"))
