"""Turns the scheduler's plan into tensors, runs the model, and returns the logits to sample from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.scheduler import SchedulerOutput
from engine.request import Request
from model.attention import AttentionMetadata


class StepModel(Protocol):
    """What the runner drives: the eager `LlamaForCausalLM`, or a compiled artifact's model
    (`compile/torch_backend.py`, `compile/onnx_backend.py`, `compile/tensorrt_backend.py`)."""

    block_size: int
    attention: Any  # .plan(AttentionMetadata) -> the plan sample_logits takes

    def allocate_kv_caches(self, num_blocks: int) -> list[torch.Tensor]: ...

    def sample_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                      plan: Any, sample_rows: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class ModelInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn_metadata: AttentionMetadata
    sample_rows: torch.Tensor  # [B] rows of the flat batch whose logits are sampled
    sample_requests: list[Request]  # the B requests those rows belong to


class ModelRunner:
    def __init__(self, module: StepModel, num_blocks: int, device: torch.device) -> None:
        self.module = module
        self.block_size = module.block_size
        self.device = device
        self.kv_caches = module.allocate_kv_caches(num_blocks)

    def prepare(self, plan: SchedulerOutput) -> ModelInputs:
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, tables = [], [], []
        sample_rows: list[int] = []
        sample_requests: list[Request] = []
        for item in plan.scheduled:
            request, start = item.request, item.request.num_computed_tokens
            end = start + item.num_new_tokens
            input_ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            query_lens.append(item.num_new_tokens)
            seq_lens.append(end)
            tables.append(request.block_ids)
            if end == request.num_tokens:  # its last known token runs now: its logits give the next token
                sample_rows.append(len(input_ids) - 1)
                sample_requests.append(request)
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size, self.device)
        as_long = {"dtype": torch.long, "device": self.device}
        return ModelInputs(torch.tensor(input_ids, **as_long), torch.tensor(positions, **as_long), meta,
                           torch.tensor(sample_rows, **as_long), sample_requests)

    @torch.inference_mode()
    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        """Logits [B, vocab] float32 for the rows to sample (B may be 0 when only prefill chunks ran)."""
        plan = self.module.attention.plan(inputs.attn_metadata)
        return self.module.sample_logits(inputs.input_ids, inputs.positions, self.kv_caches, plan,
                                         inputs.sample_rows)
