"""What rank 0 sends the workers each time: one flat int64 buffer per command, over a pipe per worker.

A step's inputs are a few hundred integers (token ids, positions, the attention metadata, the rows to
sample), so one pipe write per worker costs less than a collective, and a worker waits on its pipe
without a timeout: an idle server keeps its workers, and rank 0's exit closes the pipe, which ends
them. Layout: [command, *header, *payload], all int64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.attention_metadata import AttentionMetadata

STEP, ALLOCATE, STOP = 1, 2, 3
STEP_HEADER = 7  # T, S, table width, B, max_query_len, max_seq_len, step number


@dataclass(frozen=True)
class StepMessage:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [B]
    step: int  # rank 0's count, so a worker's error names the step


def encode_step(message: StepMessage) -> bytes:
    meta = message.meta
    num_tokens, (num_seqs, width) = message.input_ids.numel(), meta.block_tables.shape
    header = torch.tensor([STEP, num_tokens, num_seqs, width, message.sample_rows.numel(), meta.max_query_len,
                           meta.max_seq_len, message.step], dtype=torch.long)
    parts = [header, message.input_ids, message.positions, meta.query_start_loc, meta.seq_lens,
             meta.block_tables.reshape(-1), meta.slot_mapping, message.sample_rows]
    return torch.cat([p.to("cpu", torch.long) for p in parts]).numpy().tobytes()


def encode_command(command: int, value: int = 0) -> bytes:
    return torch.tensor([command, value], dtype=torch.long).numpy().tobytes()


def command_of(buffer: bytes) -> tuple[int, torch.Tensor]:
    """(command, the int64 values after it)."""
    values = torch.frombuffer(bytearray(buffer), dtype=torch.long)
    return int(values[0]), values[1:]


def decode_step(values: torch.Tensor, device: torch.device) -> StepMessage:
    num_tokens, num_seqs, width, num_sampled, max_query_len, max_seq_len, step = values[:STEP_HEADER].tolist()
    sizes = [num_tokens, num_tokens, num_seqs + 1, num_seqs, num_seqs * width, num_tokens, num_sampled]
    ids, positions, starts, seq_lens, tables, slots, rows = values[STEP_HEADER:].to(device).split(sizes)
    meta = AttentionMetadata(starts, seq_lens, tables.view(num_seqs, width), slots, max_query_len, max_seq_len)
    return StepMessage(ids, positions, meta, rows, step)
