"""The one step interface every runnable model implements, and the function that builds its inputs.

A step runs the new tokens of S sequences, laid end to end as one flat batch, over a paged KV cache:
it writes their keys and values into the cache and returns the logits of the rows whose next token is
drawn. The eager `LlamaForCausalLM` implements `StepModel`, and so do the tensor-parallel model
(parallel/tensor_parallel_model.py) and each artifact runtime (`engine/backends/`: compiled torch, ONNX
Runtime, TensorRT); the engine names none of them. Every driver (the engine's runner, the small
`Sequences` driver of generation, parity and benchmarks) builds a step with `build_step`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kernels.kv_layout import kv_cache_shape
from model.attention_metadata import AttentionMetadata
from model.config import ModelConfig


class StepModel(Protocol):
    config: ModelConfig
    block_size: int  # tokens per KV block
    kv_cache_dtype: torch.dtype
    device: torch.device  # where its caches and step inputs live
    # Pools the KV blocks are split into, each sequence's blocks in one pool: 1, or one per rank when tensor
    # parallelism splits by sequences (a rank holds its pool's blocks with every head).
    kv_pools: int
    failure: str | None  # why the model can run no more steps (its steps raise from then on); None: it can

    def plan(self, meta: AttentionMetadata) -> Any:
        """The attention plan of a step: the tensors every layer shares (backend-specific)."""

    def allocate_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        """Zeroed caches, one per layer, each `kernels.kv_cache.kv_cache_shape(num_blocks, ...)`. A model with
        linear-attention layers (`keeps_states`) takes `num_state_slots=` too: those layers' state pools."""

    def sample_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                      plan: Any, sample_rows: torch.Tensor) -> torch.Tensor:
        """Run one step: input_ids, positions [T] int64, sample_rows [B] int64 -> logits [B, vocab] float32;
        the step's keys and values are written into `kv_caches` in place."""

    def warm_up(self, kv_caches: list[torch.Tensor]) -> None:
        """Make the first request's step as quick as later ones, before the engine takes requests; may run
        steps that write block 0 of `kv_caches` (whichever sequence gets it overwrites it before reading)."""

    def communication_seconds(self) -> dict[str, float]:
        """Seconds spent per collective since the warm-up (empty for a model in one process)."""

    def on_failure(self, listener: Callable[[str], None]) -> None:
        """Call `listener(reason)` once when the model fails for good, even between steps (`failure`)."""

    def close(self) -> None:
        """Release what outlives the model's steps (worker processes); no step runs after."""


class HiddenStepModel(StepModel, Protocol):
    """A step model that can also return final hidden states (embeddings pool them): the eager model in one
    process. Compiled artifacts return logits only, and tensor-parallel ranks keep their hidden states."""

    def sample_logits_and_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
                                 kv_caches: list[torch.Tensor], plan: Any, sample_rows: torch.Tensor,
                                 hidden_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`sample_logits`, and the final (normed) hidden states [H, hidden] float32 of `hidden_rows` [H]."""

    def token_logits(self, hidden: torch.Tensor, token_ids: Sequence[int]) -> torch.Tensor:
        """The next-token logits [T] float32 of `token_ids` after a final hidden state [hidden] float32."""


def returns_hidden(model: StepModel) -> bool:
    return callable(getattr(model, "sample_logits_and_hidden", None))


def keeps_states(model: StepModel) -> bool:
    """Whether the model has linear-attention layers, which keep a state per sequence in a slot of their pools
    (model/linear_attention.py): its caches are allocated with `num_state_slots` and each step's chunks name
    their slots (`SeqChunk.state_slot`)."""
    return bool(model.config.linear_layers)


def allocate_caches(model: StepModel, num_blocks: int, num_state_slots: int, **kwargs: Any) -> list[torch.Tensor]:
    """`model.allocate_kv_caches`, with room for `num_state_slots` sequences' states where the model keeps any."""
    if keeps_states(model):
        kwargs["num_state_slots"] = num_state_slots
    return model.allocate_kv_caches(num_blocks, **kwargs)


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's part of a step."""

    token_ids: Sequence[int]  # the new tokens
    num_cached: int  # tokens of the sequence already in the cache before them
    block_table: list[int]  # the sequence's blocks, enough for num_cached + len(token_ids) tokens
    num_sampled: int = 1  # how many of the new tokens, counted from the last, give logits
    adapter: int = -1  # the LoRA slot its tokens run with (model/lora_slots.py); -1: the base model
    # The sliding-window layers' blocks when they have a cache of their own (engine/window_blocks.py): one
    # entry per block of the sequence, negative for a block no query of the step can see.
    window_block_table: list[int] | None = None
    # Rows of the chunk that take these embeddings instead of their tokens' (an image's, model/vision.py).
    embeds: InputEmbeds | None = None
    # The sequence's row of the linear-attention layers' state pools (model/linear_attention.py); -1: none.
    state_slot: int = -1


@dataclass(frozen=True)
class InputEmbeds:
    """Embeddings that replace some rows' token embeddings: an image's in place of its `<image>` tokens."""

    rows: torch.Tensor  # [E] int64: a chunk's rows (SeqChunk), or the flat batch's (StepInputs)
    values: torch.Tensor  # [E, hidden]
    # Each run of consecutive rows is one image whose tokens attend to each other both ways (Gemma 3): the
    # chunk holds every run to its end (engine/scheduler.py), so each row sees the keys up to its run's end.
    bidirectional: bool = False


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn_metadata: AttentionMetadata
    sample_rows: torch.Tensor  # [B] int64 rows of the flat batch whose logits are returned
    adapters: torch.Tensor | None = None  # [T] int64 LoRA slot of each row (-1: none); None when no row has one
    hidden_rows: torch.Tensor | None = None  # [H] int64 rows whose final hidden states are returned too
    input_embeds: InputEmbeds | None = None  # rows run on given embeddings (a model with `vision` only)

    @property
    def model_kwargs(self) -> dict[str, Any]:
        """The step's optional inputs, for a model's step call: none unless the step has them."""
        return {} if self.input_embeds is None else {"input_embeds": self.input_embeds}


@torch.inference_mode()
def build_step(chunks: Sequence[SeqChunk], block_size: int, device: torch.device | str) -> StepInputs:
    """Flat tensors for a step from plain lists; chunks without tokens are skipped.

    Built under inference mode like the step itself, so every step's tensors carry the same dispatch
    keys: a compiled model guards on them and would compile again for a step built the other way."""
    input_ids: list[int] = []
    positions: list[int] = []
    query_lens, seq_lens, tables, sample_rows = [], [], [], []
    window_tables: list[list[int]] = []
    adapters: list[int] = []
    state_slots: list[int] = []
    embeds: list[InputEmbeds] = []
    key_ends: dict[int, int] = {}  # flat row -> the keys it sees, where more than its position + 1
    for chunk in chunks:
        if not chunk.token_ids:
            continue
        end = chunk.num_cached + len(chunk.token_ids)
        input_ids.extend(chunk.token_ids)
        positions.extend(range(chunk.num_cached, end))
        query_lens.append(len(chunk.token_ids))
        seq_lens.append(end)
        tables.append(chunk.block_table)
        if chunk.window_block_table is not None:
            # A block out of every query's window is never read: any valid id stands in for it.
            window = chunk.window_block_table
            window_tables.append([b if b >= 0 else window[-1] for b in window])
        sample_rows.extend(range(len(input_ids) - chunk.num_sampled, len(input_ids)))
        if chunk.embeds is not None:
            first = len(input_ids) - len(chunk.token_ids)
            embeds.append(InputEmbeds(chunk.embeds.rows + first, chunk.embeds.values))
            if chunk.embeds.bidirectional:
                key_ends.update(run_key_ends(chunk.embeds.rows.tolist(), first, chunk.num_cached))
        adapters.extend([chunk.adapter] * len(chunk.token_ids))
        state_slots.append(chunk.state_slot)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, device)
    as_long = {"dtype": torch.long, "device": device}
    if any(slot >= 0 for slot in state_slots):
        if min(state_slots) < 0:
            raise ValueError("either every chunk of a step has a state slot or none has")
        meta = dataclasses.replace(meta, state_slots=torch.tensor(state_slots, **as_long))
    if key_ends:
        ends = [key_ends.get(row, position + 1) for row, position in enumerate(positions)]
        meta = dataclasses.replace(meta, key_ends=torch.tensor(ends, **as_long))
    if window_tables:
        if len(window_tables) != len(tables):
            raise ValueError("either every chunk of a step has a window block table or none has")
        window = AttentionMetadata.build(query_lens, seq_lens, window_tables, block_size, device)
        meta = dataclasses.replace(meta, window=dataclasses.replace(window, key_ends=meta.key_ends))
    rows = torch.tensor(adapters, **as_long) if any(a >= 0 for a in adapters) else None
    given = None
    if embeds:
        given = InputEmbeds(torch.cat([e.rows for e in embeds]).to(device),
                            torch.cat([e.values for e in embeds]).to(device))
    return StepInputs(torch.tensor(input_ids, **as_long), torch.tensor(positions, **as_long), meta,
                      torch.tensor(sample_rows, **as_long), rows, input_embeds=given)


def run_key_ends(rows: Sequence[int], first: int, num_cached: int) -> dict[int, int]:
    """For a chunk's bidirectional image rows (ascending, counted from the chunk's first), each flat row
    (`first` + row) -> the number of keys it sees: up to its run's last position, inclusive."""
    out: dict[int, int] = {}
    start = 0
    for k in range(1, len(rows) + 1):
        if k == len(rows) or rows[k] != rows[k - 1] + 1:  # rows[start:k] is one run
            end = num_cached + rows[k - 1] + 1
            out.update((first + r, end) for r in rows[start:k])
            start = k
    return out


@torch.inference_mode()
def run_step(model: StepModel, inputs: StepInputs, kv_caches: list[torch.Tensor]) -> torch.Tensor:
    """Logits [B, vocab] float32 of the step's sample rows (B may be 0: prefill chunks only)."""
    plan = model.plan(inputs.attn_metadata)
    return model.sample_logits(inputs.input_ids, inputs.positions, kv_caches, plan, inputs.sample_rows,
                               **inputs.model_kwargs)


@torch.inference_mode()
def run_step_with_hidden(model: HiddenStepModel, inputs: StepInputs,
                         kv_caches: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """`run_step`'s logits, and the final hidden states [H, hidden] float32 of the step's `hidden_rows`."""
    plan = model.plan(inputs.attn_metadata)
    return model.sample_logits_and_hidden(inputs.input_ids, inputs.positions, kv_caches, plan, inputs.sample_rows,
                                          inputs.hidden_rows, **inputs.model_kwargs)


class BaseStepModel:
    """What a model that runs in this process alone has of `StepModel` beyond its step: one KV pool, no
    failure but a step's own exception, nothing to close. Its warm-up runs a 2-token prefill and a 1-token
    decode in block 0, so the kernels built or loaded on first use (the C++ extensions, compiled once per
    CPU, tens of seconds on a fresh machine) are ready before the first request."""

    kv_pools = 1
    failure: str | None = None

    def warm_up(self, kv_caches: list[torch.Tensor]) -> None:
        if self.block_size < 3 or not kv_caches:
            return
        slot = 0 if keeps_states(self) else -1  # (a state slot's next sequence starts it from zeros)
        for chunk in (SeqChunk([0, 0], 0, [0], state_slot=slot), SeqChunk([0], 2, [0], state_slot=slot)):
            run_step(self, build_step([chunk], self.block_size, self.device), kv_caches)

    def communication_seconds(self) -> dict[str, float]:
        return {}

    def on_failure(self, listener: Callable[[str], None]) -> None:
        """Nothing to listen for: a failed step raises to its caller, and the next step may run."""

    def close(self) -> None:
        pass


def allocate_kv_caches(config: ModelConfig, block_size: int, num_blocks: int, dtype: torch.dtype,
                       device: torch.device | str, num_window_blocks: int | None = None,
                       num_state_slots: int = 0) -> list[torch.Tensor]:
    """Zeroed paged caches, one per layer; with `num_window_blocks`, the sliding-window layers' hold that
    many blocks (their own block ids, engine/window_blocks.py) and the others `num_blocks`. A linear-attention
    layer's entry is its state pool of `num_state_slots` rows instead (model/linear_attention.py)."""
    if config.linear_layers and num_state_slots < 1:
        raise ValueError(f"{config.architecture}'s linear-attention layers need at least one state slot")
    def blocks(layer: int) -> int:
        windowed = num_window_blocks is not None and config.layer_window(layer) is not None
        return num_window_blocks if windowed else num_blocks

    caches: list[torch.Tensor] = []
    for i in range(config.num_layers):
        if config.is_linear_layer(i):
            caches.append(torch.zeros(num_state_slots, config.linear_state_size, dtype=torch.float32, device=device))
            continue
        source = config.kv_source(i)  # a layer that reads an earlier layer's cache gets that very tensor
        caches.append(caches[source] if source != i else torch.zeros(
            kv_cache_shape(blocks(i), block_size, config.layer_kv_heads(i), config.layer_head_dim(i)), dtype=dtype,
            device=device))
    return caches
