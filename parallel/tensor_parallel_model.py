"""Rank 0 of a tensor-parallel group, as the engine sees it: one `StepModel` (model/step.py).

`start` shards a loaded model over N ranks: rank 0 (this process) keeps its shard, and ranks 1..N-1 run in
worker processes it spawns (torch.multiprocessing; gloo on a CPU, NCCL on CUDA). Each step, rank 0 sends
the step's flat inputs to every worker, runs its own shard, and returns the full logits gathered from the
ranks' vocabulary shards; scheduler, block manager, sampler and server are unchanged. Split by heads,
each rank holds the KV cache of its own KV heads for the same block ids, so the block manager's count is
every rank's; split by sequences (parallel/sequence_split.py), the block manager keeps a pool per rank
(`kv_pools`) and rank r holds pool r's blocks with every head.

Failure: a worker that exits (its process sentinel fires), a collective that errors or outlives the
timeout, or a step that breaks off half way leaves the ranks out of step for good. The model then raises
`TensorParallelError` for that step and every later one, and tells its listeners at once (the async
engine fails its requests with a 503), even while no step runs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from model.attention_metadata import AttentionMetadata
from model.block_embedding import BlockEmbedding
from model.config import ModelConfig
from model.llama import LlamaForCausalLM
from model.loader import LoadedModel
from model.quantization import INT8_LINEARS
from model.step import BaseStepModel, allocate_kv_caches
from parallel import step_message
from parallel.collectives import Collectives, create_group
from parallel.errors import TensorParallelError
from parallel.layout import TensorParallelLayout
from parallel.sequence_split import rank_plan
from parallel.shard import build_rank_module, shard_state
from parallel.shared_memory_all_reduce import SharedMemoryAllReduce, available, create_region
from parallel.worker import WorkerSpec, worker_main

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0
SPLIT_QUANTIZATIONS = ("none", *INT8_LINEARS)  # the linears `shard.py` knows how to split
EXPERT_QUANTIZATIONS = ("int8", "none")  # the forms of a mixture of experts' weights (model/moe.py)


@dataclass(frozen=True)
class TensorParallelPlan:
    meta: AttentionMetadata  # sent to the workers, which build their own plan from it
    local: Any  # rank 0's attention plan


def cpu_threads_per_rank(size: int) -> int:
    """Ranks share the cores: more threads than cores per rank only spin against each other."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // size)


def exit_description(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        return f"was killed by signal {-code} ({signal.Signals(-code).name})"
    return f"exited with code {code}"


class TensorParallelModel(BaseStepModel):
    def __init__(self, shard: LlamaForCausalLM, config: ModelConfig, layout: TensorParallelLayout,
                 collectives: Collectives, workers: list, pipes: list[Connection], num_threads_before: int) -> None:
        self.shard = shard
        self.config = config  # the whole model's: vocabulary, KV sizing per block across all ranks
        self.layout = layout
        self.collectives = collectives
        self.workers = workers  # ranks 1..N-1
        self.pipes = pipes
        self.block_size = shard.block_size
        self.kv_pools = layout.kv_pools  # the block manager's pools (engine/block_manager.py)
        self.blocks_per_rank = 0  # set when the KV cache is allocated
        self.kv_cache_dtype = shard.kv_cache_dtype
        self.activation_dtype = shard.activation_dtype
        self.device = shard.device
        self.num_steps = 0
        self.failure: str | None = None  # why the group can run no more steps
        self._num_threads_before = num_threads_before
        self._listeners: list[Callable[[str], None]] = []
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._reap_lock = threading.Lock()  # see _dead_worker
        threading.Thread(target=self._watch_workers, name="ladder-tp-monitor", daemon=True).start()

    @property
    def size(self) -> int:
        return self.layout.size

    # -- the step interface ------------------------------------------------------------------------

    def plan(self, meta: AttentionMetadata) -> TensorParallelPlan:
        return TensorParallelPlan(meta, rank_plan(self.shard, self.layout, meta, 0, self.blocks_per_rank))

    def allocate_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        """Split by heads: `num_blocks` blocks on every rank, each of its own KV heads; by sequences: a
        pool of num_blocks / size blocks on each rank, every head."""
        self._send(step_message.encode_command(step_message.ALLOCATE, num_blocks))
        local = self.layout.local_config(self.config, 0)
        self.blocks_per_rank = self.layout.blocks_per_rank(num_blocks)
        return allocate_kv_caches(local, self.block_size, self.blocks_per_rank, self.kv_cache_dtype, self.device)

    def sample_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                      plan: TensorParallelPlan, sample_rows: torch.Tensor) -> torch.Tensor:
        """The step on every rank; logits [B, vocab] float32 on rank 0."""
        self.num_steps += 1
        message = step_message.StepMessage(input_ids, positions, plan.meta, sample_rows, self.num_steps)
        started = time.perf_counter()
        self._send(step_message.encode_step(message))
        self.collectives.record("broadcast", started)
        try:
            return self.shard.sample_logits(input_ids, positions, kv_caches, plan.local, sample_rows)
        except Exception as error:
            raise self._fail(f"step {self.num_steps} failed on rank 0: {type(error).__name__}: "
                             f"{' '.join(str(error).split())[:300]}") from error

    def warm_up(self, kv_caches: list[torch.Tensor]) -> None:
        """The one-process warm-up on every rank (each loads its own kernels); collectives are counted
        from its end, so the warm-up stays out of them as it does of step time."""
        super().warm_up(kv_caches)
        self.collectives.reset()

    # -- health and figures ------------------------------------------------------------------------

    def communication_seconds(self) -> dict[str, float]:
        """Seconds rank 0 has spent per collective since the warm-up: broadcast (the step's inputs to the
        workers), all_reduce (the row-parallel sums), all_reduce_max (W8A8's activation scales),
        all_gather (the attention output before W8A8's whole o_proj), gather (the logits)."""
        return dict(self.collectives.seconds)

    def on_failure(self, listener: Callable[[str], None]) -> None:
        """Call `listener(reason)` once when the group fails (from the monitor thread, or the step's)."""
        with self._lock:
            failure = self.failure
            if failure is None:
                self._listeners.append(listener)
        if failure is not None:
            listener(failure)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the workers (they exit on their own if this process dies first) and leave the group."""
        if self._closing.is_set():
            return
        self._closing.set()
        for pipe in self.pipes:
            try:
                pipe.send_bytes(step_message.encode_command(step_message.STOP))
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for worker in self.workers:
            worker.join(max(0.0, deadline - time.monotonic()))
            if worker.is_alive():
                worker.kill()
                worker.join(1.0)
        for pipe in self.pipes:
            pipe.close()
        self.collectives.shutdown()
        if self.device.type == "cpu":
            torch.set_num_threads(self._num_threads_before)

    # -- failure ---------------------------------------------------------------------------------

    def _send(self, payload: bytes) -> None:
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        for rank, pipe in enumerate(self.pipes, start=1):
            try:
                pipe.send_bytes(payload)
            except OSError as error:
                raise self._fail(f"could not reach rank {rank}: {error}") from error

    def _dead_worker(self, wait_s: float) -> str | None:
        """Why a worker is gone, waiting up to `wait_s` for one to finish exiting, or None."""
        deadline = time.monotonic() + wait_s
        # One thread reaps at a time: the monitor and the step's thread both get here when a worker dies, and
        # the one whose waitpid loses the race would take the dead worker for alive (and blame rank 0).
        with self._reap_lock:
            for rank, worker in enumerate(self.workers, start=1):
                worker.join(max(0.0, deadline - time.monotonic()))
                if not worker.is_alive():
                    return (f"tensor-parallel worker rank {rank} (pid {worker.pid}) "
                            f"{exit_description(worker.exitcode)}")
        return None

    def _fail(self, cause: str) -> TensorParallelError:
        """Mark the group failed (a dead worker is named first: it is the cause of whatever rank 0 saw)."""
        reason = self._dead_worker(wait_s=1.0) or f"tensor-parallel group of {self.size} ranks: {cause}"
        self._mark_failed(reason)
        return TensorParallelError(self.failure)

    def _mark_failed(self, reason: str) -> None:
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
            listeners = list(self._listeners)
        self.collectives.abort()  # ranks waiting in a shared-memory all-reduce stop waiting
        log.error("%s; the group can run no more steps", reason)
        for listener in listeners:
            listener(reason)

    def _watch_workers(self) -> None:
        wait([worker.sentinel for worker in self.workers])
        if not self._closing.is_set():
            # The sentinel closes as the process dies, a moment before it can be reaped for its exit code.
            self._mark_failed(self._dead_worker(wait_s=1.0) or "a tensor-parallel worker exited")


def start(loaded: LoadedModel, size: int, timeout_s: float = DEFAULT_TIMEOUT_S, attention: str = "heads") -> LoadedModel:
    """`loaded` (an eager LlamaForCausalLM, float or quantized at load) served by `size` ranks, attention
    split by "heads" or "sequences" (a mixture of experts' layers split by experts, parallel/shard.py): the
    same LoadedModel with a TensorParallelModel as its module.
    `loaded` itself is left as it was. ValueError (one line) for a size the model cannot be split into,
    or more CUDA devices than there are."""
    full = loaded.module
    if not isinstance(full, LlamaForCausalLM):
        raise ValueError("tensor parallelism applies to an eager model, not to a compiled artifact")
    if loaded.quantization not in SPLIT_QUANTIZATIONS:
        raise ValueError(f"quantization {loaded.quantization} is not split across tensor-parallel ranks "
                         f"(choose {', '.join(INT8_LINEARS)} or none)")
    config = loaded.config
    if config.num_experts and loaded.quantization not in EXPERT_QUANTIZATIONS:  # loading refuses it first
        raise ValueError(f"quantization {loaded.quantization} is not split across expert-parallel ranks "
                         f"(choose {' or '.join(EXPERT_QUANTIZATIONS)})")
    layout = TensorParallelLayout.for_model(config, size, attention)
    if layout.by_sequences and config.layer_types is not None:
        raise ValueError(f"{config.architecture} has sliding-window layers beside full-attention ones, and a split "
                         "by sequences plans one window; use a split by heads or --tensor-parallel-size 1")
    device = full.device
    if device.type == "cuda":
        base = device.index or 0
        if base + size > torch.cuda.device_count():
            raise ValueError(f"--tensor-parallel-size {size} from {device} needs {base + size} CUDA devices, "
                             f"this machine has {torch.cuda.device_count()}")
        devices, backend = [torch.device("cuda", base + rank) for rank in range(size)], "nccl"
    else:
        devices, backend = [torch.device("cpu")] * size, "gloo"
    threads_before = torch.get_num_threads()
    num_threads = cpu_threads_per_rank(size) if device.type == "cpu" else threads_before
    state = full.state_dict()
    if isinstance(full.embed_tokens, BlockEmbedding):  # a GGUF's rows (model/block_embedding.py): split as floats
        state["embed_tokens.weight"] = full.embed_tokens(torch.arange(full.embed_tokens.num_embeddings))
    shards = [shard_state(state, config, layout, rank, loaded.quantization) for rank in range(size)]
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    # CPU ranks all-reduce and gather through a shared file (gloo's loopback TCP costs ~1 ms a call); gloo
    # still joins the group and carries the weights and any tensor the file does not take.
    region = create_region(size) if backend == "gloo" and available() else None
    context = mp.get_context("spawn")
    workers, pipes = [], []
    for rank in range(1, size):
        tensors = [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in shards[rank].items()]
        spec = WorkerSpec(rank, size, backend, "127.0.0.1", store.port, timeout_s, str(devices[rank]), num_threads,
                          config, full.block_size, loaded.quantization, tensors, attention,
                          str(full.kv_cache_dtype).removeprefix("torch."), None if region is None else str(region))
        receive, send = context.Pipe(duplex=False)
        worker = context.Process(target=worker_main, args=(spec, receive), name=f"ladder-tp-rank{rank}", daemon=True)
        worker.start()
        receive.close()
        workers.append(worker)
        pipes.append(send)
    joined: list[Collectives] = []

    def join_and_send() -> None:
        shared = None if region is None else SharedMemoryAllReduce(region, 0, size, timeout_s)
        joined.append(Collectives(create_group(backend, store, 0, size, timeout_s), 0, size, shared))
        for rank in range(1, size):
            for tensor in shards[rank].values():
                joined[0].send(tensor, rank)  # from rank 0's device (NCCL) or the CPU (gloo)

    try:
        run_watching(workers, join_and_send)
        collectives = joined[0]
        module = build_rank_module(config, full.block_size, full.ops, loaded.quantization, shards[0], layout,
                                   collectives)
        module.kv_cache_dtype = full.kv_cache_dtype
    except BaseException:
        for worker, pipe in zip(workers, pipes):
            worker.kill()
            worker.join(1.0)
            pipe.close()
        raise
    finally:
        if region is not None:  # every rank has mapped it (or failed): the mappings outlive the name
            region.unlink(missing_ok=True)
    del shards, state
    if device.type == "cpu":
        torch.set_num_threads(num_threads)
    log.info("tensor parallel: %d ranks (%s), attention split by %s, KV heads per rank %s, %s%d CPU threads per "
             "rank", size, backend, attention, [len(r) for r in layout.kv_heads],
             f"{config.num_experts // size} experts per rank, " if config.num_experts else "", num_threads)
    model = TensorParallelModel(module, config, layout, collectives, workers, pipes, threads_before)
    return dataclasses.replace(loaded, module=model)


def run_watching(workers: list, fn: Callable[[], None]) -> None:
    """Run `fn` (which waits on the workers) on a helper thread, and stop waiting as soon as a worker
    exits: a worker that fails while starting is reported at once, not after the group's timeout."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as error:  # handed to the caller
            errors.append(error)

    helper = threading.Thread(target=target, name="ladder-tp-start", daemon=True)
    helper.start()
    while helper.is_alive():
        helper.join(0.1)
        for rank, worker in enumerate(workers, start=1):
            if not worker.is_alive() and helper.is_alive():
                raise TensorParallelError(f"tensor-parallel worker rank {rank} (pid {worker.pid}) "
                                          f"{exit_description(worker.exitcode)} while starting")
    if errors:
        raise errors[0]
