"""The `torch-compile` artifact runtime: the model's own module, compiled by `torch.compile` (Inductor).

The artifact (`compile/pipeline.py` writes it) holds the weights after the precision change
(`model.safetensors`: float, or int8 with per-channel scales; a tied LM head gets its own copy once
quantized or smoothed), the model config and the tokenizer; the manifest's `backend_options` hold the
`torch.compile` arguments. Loading rebuilds exactly that module. On a CPU the artifact also holds the
step compiled ahead of time (`step.pt2`, an AOTInductor package: `engine/backends/aoti_runtime.py`), which
runs that module's weights without compiling at start-up; elsewhere (CUDA, where decode steps replay CUDA
graphs, and CPU artifacts written before packages) the module is compiled again at every start.

What Inductor sees: one step, `sample_logits(input_ids, positions, kv_caches, plan, sample_rows)`, with
every batch dimension dynamic. Paged attention stays one opaque custom op (`ladder::paged_attention`,
which writes the cache in place and runs the C++ decode kernel or the torch path): Inductor fuses the
norms, rotary, SwiGLU and W8A8's per-token quantization around it and calls the matmuls (float, the INT8
weight-only kernel, or `_int_mm`) directly, with no Python per layer.

On CUDA the attention is the Triton paged kernels behind their own custom op
(`model/attention/graph_backend.py`), and decode steps run as CUDA graphs (`mode="reduce-overhead"`,
Inductor's CUDA graph trees): one graph recorded per decode batch size, replayed after. What a graph
needs to replay and not re-record or be skipped:
- the KV caches, which every step mutates, are marked static (`torch._dynamo.mark_static_address`), so
  the graph writes into them in place instead of refusing mutated inputs;
- block tables are padded to the width of max_model_len, so a batch size has one shape at every length;
- the logits live in the graph's memory pool, which the next replay overwrites: they are cloned.
Steps with a prompt chunk run a second compiled graph without CUDA graphs (every token count would be a
new recording). `cuda_graph_state()` says whether the last step replayed a recorded graph.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch._dynamo.config as dynamo_config
import torch.fx.experimental._config as fx_config
from torch._dynamo.utils import counters

from engine.backends.aoti_runtime import PackagedModel, check_package
from engine.backends.packed_weights import load_packed
from kernels import cpu_w8a8_linear
from kernels.kv_layout import blocks_for_tokens
from kernels.ops import TORCH_OPS, Ops, select_ops
from model.attention import AttentionPlan, GraphPagedAttention, OpaquePagedAttention, TorchPagedAttention, install
from model.attention_metadata import AttentionMetadata
from model.config import ModelConfig
from model.llama import LlamaForCausalLM
from model.quantization import INT8_LINEARS, activation_dtype, int8_skeleton, pack_all
from model.sequences import Sequences
from model.step import BaseStepModel, allocate_kv_caches

WEIGHTS, CONFIG = "model.safetensors", "config.json"
WARM_UP_BLOCKS = 4


def compiled_ops(device: torch.device) -> Ops:
    """The ops a compiled module is built with. On CUDA the plain-torch references: Inductor writes
    their fused kernels itself and traces them best (a hand-written launcher's Python would be traced
    or guarded on), while attention, which Inductor cannot fuse, stays the Triton custom op. On a CPU
    the usual choice (the references beside the C++ decode attention)."""
    return TORCH_OPS if device.type == "cuda" else select_ops(device)


def compile_options(device: torch.device) -> dict[str, Any]:
    # dynamic: one graph for every token count; CUDA graphs only where they exist.
    return {"dynamic": True, "fullgraph": True, "mode": "reduce-overhead" if device.type == "cuda" else "default"}


def uses_graph_attention(device: torch.device) -> bool:
    """The Triton attention op on CUDA; on a CPU only when the model's ops are the Triton kernels
    (interpreted: tests and the GPU check's dry run drive the CUDA code path on CPU tensors)."""
    return device.type == "cuda"


class TorchCompiledModel(BaseStepModel):
    """A compiled module as a StepModel (model/step.py).

    `max_model_len`: the longest sequence served; with the Triton attention it fixes the block tables'
    width (CUDA graphs need one shape per batch size). `graph_attention`: the Triton attention op
    (default: on CUDA)."""

    def __init__(self, module: LlamaForCausalLM, precision: str, options: dict[str, Any],
                 max_model_len: int | None = None, graph_attention: bool | None = None) -> None:
        self.module = module
        self.config = module.config
        self.block_size = module.block_size
        self.precision = precision
        self.kv_cache_dtype = activation_dtype(precision, module.device)
        self.device = module.device
        if graph_attention is None:
            graph_attention = uses_graph_attention(self.device)
        window = module.config.sliding_window
        if graph_attention:
            # At least the warm-up's width (its sequences reserve WARM_UP_BLOCKS blocks each).
            width = (None if max_model_len is None
                     else max(WARM_UP_BLOCKS, blocks_for_tokens(max_model_len, self.block_size)))
            self.attention = GraphPagedAttention(module.block_size, window, width)
        else:
            attention_type = OpaquePagedAttention if self.device.type == "cpu" else TorchPagedAttention
            self.attention = attention_type(module.block_size, window)
        install(module, self.attention)
        # Dynamo caches graphs per code object, and every model's `sample_logits` shares one: leave room
        # for several models in a process (tests, the compile pipeline) beside their shape variants.
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
        if self.device.type == "cpu" and precision == "w8a8":
            # Built (or read from its cache) before tracing: the lazy build takes a lock Dynamo cannot trace.
            cpu_w8a8_linear.load()
        self.cuda_graphs = options.get("mode") == "reduce-overhead"
        if self.cuda_graphs:
            # Weights and int8 scales never move: recorded graphs read them where they are.
            for tensor in [*module.parameters(), *module.buffers()]:
                torch._dynamo.mark_static_address(tensor)

        # Two functions, two code objects: Dynamo keeps each one's graphs apart.
        def decode_step(input_ids, positions, kv_caches, plan, sample_rows):
            return module.sample_logits(input_ids, positions, kv_caches, plan, sample_rows)

        def mixed_step(input_ids, positions, kv_caches, plan, sample_rows):
            return module.sample_logits(input_ids, positions, kv_caches, plan, sample_rows)

        self._compiled = torch.compile(mixed_step, **{**options, "mode": "default"} if self.cuda_graphs else options)
        self._decode = torch.compile(decode_step, **options) if self.cuda_graphs else self._compiled

    def warm_up(self, kv_caches: list[torch.Tensor]) -> None:
        """Nothing left to warm: `load` ran its warm-up steps (`warm_up_at_load`)."""

    def plan(self, meta: AttentionMetadata) -> AttentionPlan:
        return self.attention.plan(meta)

    def allocate_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        caches = allocate_kv_caches(self.config, self.block_size, num_blocks, self.kv_cache_dtype, self.device)
        if self.cuda_graphs:
            for cache in caches:  # mutated by every step: recorded graphs write them in place
                torch._dynamo.mark_static_address(cache)
        return caches

    def sample_logits(self, input_ids, positions, kv_caches, plan, sample_rows) -> torch.Tensor:
        # Size-oblivious shapes: a batch of one sequence or one token is not a special case, so the
        # same graph serves every step instead of one graph per pattern of 1s in the shapes.
        is_decode = input_ids.shape[0] == sample_rows.shape[0] == plan.seq_lens.shape[0]
        with fx_config.patch(backed_size_oblivious=True, use_duck_shape=False):
            if not (self.cuda_graphs and is_decode):
                return self._compiled(input_ids, positions, kv_caches, plan, sample_rows)
            # A new step: the graphs' previous outputs may be overwritten (ours were cloned).
            torch.compiler.cudagraph_mark_step_begin()
            return self._decode(input_ids, positions, kv_caches, plan, sample_rows).clone()


def warm_up_at_load(model: TorchCompiledModel | PackagedModel) -> None:
    """Compile now, not on the first requests: run the kinds of step the engine makes (one prompt, one
    decode, decodes beside a prefill chunk) on a scratch cache. A package needs no compile: one prompt
    and one decode beside a prompt load the C++ kernels it calls and show that it runs."""
    seqs = Sequences(model, 3, WARM_UP_BLOCKS * model.block_size)
    if isinstance(model, PackagedModel):
        seqs.step([[1, 2, 3], [], []])
        seqs.step([[4], [5, 6], []])
        return
    seqs.step([[1, 2, 3], [], []])  # a prompt alone
    seqs.step([[4], [], []])  # one decode
    seqs.step([[5], [1] * 19, [2, 3]])  # a decode beside two prompts of other lengths
    seqs.step([[6], [7], [8]])  # a decode batch


def cuda_graph_state(device: torch.device) -> dict[str, Any]:
    """Whether CUDA graphs replay: the graph-tree manager's state after the last step ("EXECUTION": it
    replayed a recorded graph; "RECORDING", "WARMUP": not yet) and how many graphs Inductor skipped
    (each skip is logged with its reason under TORCH_LOGS=cudagraphs)."""
    state = "none"
    if device.type == "cuda":
        from torch._inductor import cudagraph_trees

        manager = cudagraph_trees.get_manager(device.index or 0, create_if_none_exists=False)
        if manager is not None:
            state = manager.path_state.name
    return {"last_step": state, "skipped_graphs": int(counters["inductor"]["cudagraph_skips"])}


def rebuild(directory: Path, precision: str, block_size: int, device: torch.device) -> LlamaForCausalLM:
    """The saved module from the artifact's weights and config (no random init, no pickle), packed."""
    from safetensors.torch import load_file

    config = ModelConfig.from_dict(json.loads((directory / CONFIG).read_text(encoding="utf-8")))
    with torch.device("meta"):
        module = LlamaForCausalLM(config, block_size=block_size, ops=compiled_ops(device))
        if precision in INT8_LINEARS:
            int8_skeleton(module, precision)
    state = load_file(str(directory / WEIGHTS), device=str(device))
    tied = "lm_head.weight" not in state  # saved without its own head: the embedding is the head
    if tied:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    module.load_state_dict(state, strict=True, assign=True)
    if tied:
        module.lm_head.weight = module.embed_tokens.weight
    module.make_rotary(device)
    if not (device.type == "cpu" and load_packed(module, directory)):  # CPU artifacts store the packing
        pack_all(module)
    return module.eval().requires_grad_(False)


def load(directory: Path, precision: str, block_size: int, device: torch.device,
         options: dict[str, Any], max_model_len: int | None = None,
         package: dict[str, Any] | None = None) -> TorchCompiledModel | PackagedModel:
    """The saved module, run by its AOTInductor package when the artifact has one (`package`: the
    manifest's record of it; CPU only, loads in about a second), else compiled now with the recorded
    options (CUDA, and artifacts written before packages existed)."""
    module = rebuild(directory, precision, block_size, device)
    if package and device.type == "cpu":
        check_package(package)
        model: TorchCompiledModel | PackagedModel = PackagedModel(directory / package["file"], module, precision)
    else:
        model = TorchCompiledModel(module, precision, options, max_model_len)
    warm_up_at_load(model)
    return model
