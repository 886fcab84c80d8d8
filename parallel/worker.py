"""Ranks 1..N-1 of a tensor-parallel group: each in its own process, started by rank 0.

A worker joins the process group, receives its shard of the weights from rank 0 (torch.distributed
sends of raw tensors: the weights are loaded once, by rank 0), then runs the commands rank 0 writes to
its pipe: allocate the KV cache (its KV heads only), run a step, stop. It exits when rank 0 says stop,
when the pipe closes (rank 0 exited), or when a collective fails (a peer died, or the timeout passed).
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import torch.distributed as dist

from kernels.ops import select_ops
from model.config import ModelConfig
from model.step import allocate_kv_caches
from parallel import step_message
from parallel.collectives import Collectives, create_group
from parallel.layout import TensorParallelLayout
from parallel.sequence_split import rank_plan
from parallel.shard import build_rank_module
from parallel.shared_memory_all_reduce import SharedMemoryAllReduce

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs besides the weights (plain data: it crosses the process boundary)."""

    rank: int
    size: int
    backend: str  # gloo or nccl
    store_host: str
    store_port: int
    timeout_s: float  # of every collective, and of joining the group
    device: str  # this rank's device
    num_threads: int  # torch intra-op threads of this rank (CPU)
    config: ModelConfig
    block_size: int
    quantization: str  # the int8 scheme the linears carry, or none
    tensors: list[tuple[str, tuple[int, ...], str]]  # the shard's state dict: (name, shape, dtype), in send order
    attention: str  # split by "heads" or "sequences" (parallel/layout.py)
    kv_cache_dtype: str  # torch's name of the KV cache's element type (rank 0's)
    shared_region: str | None = None  # the shared-memory all-reduce's file (CPU ranks), mapped before joining


def worker_main(spec: WorkerSpec, commands: Connection) -> None:
    # Ctrl-C reaches the whole process group; rank 0 handles it and closes the pipe, which ends this rank.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(spec.num_threads)
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore(spec.store_host, spec.store_port, spec.size, is_master=False,
                          timeout=timedelta(seconds=spec.timeout_s))
    shared = None
    if spec.shared_region is not None:  # mapped before joining: rank 0 removes the file once all have joined
        shared = SharedMemoryAllReduce(Path(spec.shared_region), spec.rank, spec.size, spec.timeout_s,
                                       parent_pid=os.getppid())
    group = create_group(spec.backend, store, spec.rank, spec.size, spec.timeout_s)
    collectives = Collectives(group, spec.rank, spec.size, shared)
    state = {name: collectives.receive(torch.empty(shape, dtype=getattr(torch, dtype), device=device), 0)
             for name, shape, dtype in spec.tensors}
    layout = TensorParallelLayout.for_model(spec.config, spec.size, spec.attention)
    module = build_rank_module(spec.config, spec.block_size, select_ops(device), spec.quantization, state, layout,
                               collectives)
    module.kv_cache_dtype = getattr(torch, spec.kv_cache_dtype)
    del state
    local_config = layout.local_config(spec.config, spec.rank)
    kv_caches: list[torch.Tensor] = []
    blocks_per_rank = 0
    with torch.inference_mode():
        while True:
            try:
                command, values = step_message.command_of(commands.recv_bytes())
            except (EOFError, OSError):  # rank 0 is gone
                log.warning("tensor-parallel rank %d: rank 0 closed the pipe; exiting", spec.rank)
                os._exit(0)  # nothing to tear down with a peer that is gone
            if command == step_message.STOP:
                break
            if command == step_message.ALLOCATE:
                blocks_per_rank = layout.blocks_per_rank(int(values[0]))
                kv_caches = allocate_kv_caches(local_config, spec.block_size, blocks_per_rank, module.kv_cache_dtype,
                                               device)
            elif command == step_message.STEP:
                step = step_message.decode_step(values, device)
                plan = rank_plan(module, layout, step.meta, spec.rank, blocks_per_rank)
                module.sample_logits(step.input_ids, step.positions, kv_caches, plan, step.sample_rows)
            else:
                raise RuntimeError(f"tensor-parallel rank {spec.rank}: unknown command {command}")
    collectives.shutdown()
