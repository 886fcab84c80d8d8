"""Precision changes applied to a built model: 16-bit casts and two INT8 forms of the linear layers.

They are module swaps and weight transforms applied from outside `model/llama.py`: `ladder compile`
applies them offline, and the artifact runtimes rebuild the same modules when they load the weights.

Both INT8 forms swap every `nn.Linear` of the decoder (and the LM head) for an int8 module with weights
stored int8 and one float32 scale per output channel (symmetric). The embedding stays float: a lookup
reads a few rows, not the whole table.

- `int8`, weight-only (`Int8Linear`), as gpt-fast does: activations stay float32. Decode reads a quarter
  of the fp32 weight bytes, which is what bounds it at small batches; the arithmetic is still float32.
- `w8a8`, weights and activations (`W8A8Linear`): each row of the input is quantized to int8 on the fly
  with its own scale (per token), the product is an integer matmul with int32 accumulation (on a CPU the
  VNNI kernel of kernels/cpu_w8a8_linear.py, bit-equal to its `torch._int_mm` reference), rescaled to
  float32. It is the fastest form here at every batch size: one VNNI instruction per 64 weight bytes keeps
  batch-1 decode at the memory bound, and prefill runs on integer arithmetic. Activation outliers are
  first moved into the weights by SmoothQuant (`model/smoothquant.py`), which `ladder compile` and
  `model.load(..., quantization="w8a8")` run before this.

A third form, `w4a8`, keeps a GGUF file's own 4-bit (and 8-bit) blocks instead of int8 rows: see
model/block_quantization.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from kernels import cpu_int8_linear, cpu_w4a8_linear, cpu_w8a8_linear
from kernels.cpu_w8a8_linear import w8a8_matmul_ref as w8a8_matmul
from kernels.int8_matmul import int8_matmul_op, quantize_int8_ref
from model.moe import is_moe_checkpoint, is_mxfp4_directory, quantize_experts
from model.precision import COMPILE_PRECISIONS, FLOAT_PRECISIONS, QUANTIZATIONS, parse_dtype

# `auto` takes W4A8 over W8A8 where it reads at most this fraction of W8A8's weight bytes a step. Both stream
# their weights at about the copy bandwidth at batch 1, but W4A8's float work per 32-block (its scales and
# mins) costs more than W8A8's per row: at 0.94x the bytes (Gemma 3 270M's file, its 8-bit LM head most of
# it) W4A8's step measured 1.07x W8A8's; at 0.87x (a Q6_K file, 6-bit codes and their sub-scales) 0.98x, and
# a batch of 32 took 1.75x as long; at 0.69-0.78x (a 1B Q4_K_M or Q5_K_M file) it is the faster.
W4A8_BYTES_AT_MOST = 0.85

if TYPE_CHECKING:  # the decoder imports its C++ step, which takes this module's W8A8 linears
    from model.llama import LlamaForCausalLM


def resolve_quantization(quantization: str, dtype: str, device: str | torch.device,
                         model: str | Path | None = None, tensor_parallel_size: int = 1) -> str:
    """`auto` -> the fastest scheme whose perplexity stays within +1% of float32 (benchmarks/RESULTS.md,
    "Fast by default"), for `model` (None: the embedded default) on `device`:

    - a quantized GGUF file whose W4A8 layers read at most 0.85x W8A8's bytes a step (`W4A8_BYTES_AT_MOST`;
      mostly 4- and 5-bit codes: Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, IQ4_NL, IQ4_XS (where the tiles take IQ4's
      table: model/gguf_blocks.py); `gguf_checkpoint.linear_bytes`; Gemma 3
      270M's file, its Q8_0 LM head most of its bytes, reads 0.93x and decodes 7% slower in W4A8; a Q6_K
      file 0.87x), on a
      CPU, in one process: W4A8 over the file's own blocks. For a Q4_1 file it reads 5/8 of W8A8's weight
      bytes, so one stream decodes 1.2-1.8x faster, and it adds no error to the file's weights (perplexity
      +0.38% against W8A8's +0.55%); at batches of 16-32 it runs at 0.8-0.95x of W8A8, still far ahead of
      llama.cpp's server there. One scheme serves every batch: mixing the two per step would make a
      request's tokens depend on its batch.
    - other float32 weights on a CPU (a Hugging Face directory, a float GGUF, a GGUF of mostly 8-bit codes
      such as Gemma 3 270M's or a Q8_0 file, tensor-parallel ranks, which do not split W4A8): W8A8;
    - a 16-bit dtype or a GPU, where 16-bit weights are the fast path: nothing;
    - a CPU without AVX-512 VNNI or AVX2 (or a build without a compiler): nothing, since the int8 kernels'
      portable loops run several times slower than torch's float32 matmuls there (`int8_kernels_are_fast`);
    - a mixture-of-experts checkpoint (a local directory or GGUF file, model/moe.py): W4A8, experts too,
      for any quantized GGUF file (a quarter of float32's bytes or less) and a directory of MXFP4 experts
      (GPT-OSS's published files: float32 would be 84 GB for its 20B), else nothing.

    Other values pass through, checked."""
    if quantization == "auto":
        if parse_dtype(dtype) != torch.float32 or torch.device(device).type != "cpu":
            return "none"
        if not int8_kernels_are_fast():
            return "none"
        sizes = linear_bytes_of(model) if tensor_parallel_size == 1 else None
        if model is not None and is_moe_checkpoint(Path(model).expanduser()):
            # W8A8's calibration does not cover expert weights (model/moe.py): W4A8 (a quantized GGUF, or
            # GPT-OSS's MXFP4 directory) or float32.
            return "w4a8" if sizes or is_mxfp4_directory(Path(model).expanduser()) else "none"
        return "w4a8" if sizes and sizes[0] <= W4A8_BYTES_AT_MOST * sizes[1] else "w8a8"
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r} (choose from auto, {', '.join(QUANTIZATIONS)})")
    if quantization == "w4a8" and torch.device(device).type == "cuda":
        # Its only kernel is the CPU one; elsewhere the reference runs a loop per 32-column block.
        raise ValueError("--quantization w4a8 is a CPU kernel; on CUDA use none (bfloat16), int8 or w8a8")
    return quantization


def int8_kernels_are_fast() -> bool:
    """Whether this CPU runs the W8A8 and W4A8 linears on their vector tiles (AVX-512 VNNI or AVX2, built
    here). On an AVX2-only EPYC, W4A8 decodes the default model 4.5x faster than float32 at batch 1 and 2.6x
    at batch 32 (benchmarks/RESULTS.md, "Stop 34"); without either (or without a compiler) the portable loops
    lose to float32 at every batch size."""
    return cpu_w4a8_linear.has_int8_tiles()


def linear_bytes_of(model: str | Path | None) -> tuple[int, int] | None:
    """(W4A8's, W8A8's) weight bytes for a quantized GGUF file (model/gguf_checkpoint.linear_bytes); None for
    anything else."""
    from model.default import is_packaged, packaged_model_path
    from model.errors import ModelLoadError

    try:
        path = packaged_model_path(model and str(model)) if is_packaged(model) else Path(model).expanduser()
    except ModelLoadError:  # a packaged model that is not installed: loading it says so
        return None
    if not (path.is_file() and path.suffix.lower() == ".gguf"):
        return None
    from model.gguf_checkpoint import linear_bytes  # the gguf package, only for GGUF files

    return linear_bytes(path)


class Int8Weights(nn.Module):
    """A linear layer's weights as int8 [N, K] with one float32 scale per output channel [N] (and a float
    bias); subclasses say how the product is computed."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scale", torch.ones(out_features, dtype=torch.float32))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Weights:
        module = cls(linear.in_features, linear.out_features, linear.bias is not None)
        module.weight, module.scale = quantize_int8_ref(linear.weight.detach())
        if linear.bias is not None:
            module.bias = linear.bias.detach().float()
        return module.pack()

    def pack(self) -> Int8Weights:
        """Derive any run-time layout from `weight` (after loading too); none by default."""
        return self


class Int8Linear(Int8Weights):
    """Weight-only: y = x @ (weight_int8 * scale[:, None]).T + bias, x float32."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias)
        # The CPU kernel's interleaved layout, rebuilt from `weight` by `pack()` (not saved).
        self.register_buffer("packed", None, persistent=False)

    def pack(self) -> Int8Linear:
        if self.weight.device.type == "cpu":
            self.packed = cpu_int8_linear.pack(self.weight)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:  # the Triton kernel; bias added after
            y = int8_matmul_op(x.reshape(-1, self.in_features), self.weight, self.scale)
            y = y.reshape(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias.to(y.dtype)
        return cpu_int8_linear.int8_linear(x, self.packed, self.scale, self.bias, self.out_features)


class W8A8Linear(Int8Weights):
    """y = w8a8_matmul(x, weight_int8, scale) + bias for x [.., K], float32 out. On a CPU the VNNI kernel
    (kernels/cpu_w8a8_linear.py) computes it, bit for bit equal to the torch reference."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias)
        # The CPU kernel's layout and column sums, rebuilt from `weight` by `pack()` (not saved).
        self.register_buffer("packed", None, persistent=False)
        self.register_buffer("wsum", None, persistent=False)

    def pack(self) -> W8A8Linear:
        if self.weight.device.type == "cpu":
            self.packed, self.wsum = cpu_w8a8_linear.pack(self.weight)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.device.type == "cpu":
            return cpu_w8a8_linear.w8a8_linear(x, self.packed, self.wsum, self.scale, self.bias, self.out_features)
        y = w8a8_matmul(x.reshape(-1, self.in_features).float(), self.weight, self.scale)  # [M, N]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


INT8_LINEARS: dict[str, type[Int8Weights]] = {"int8": Int8Linear, "w8a8": W8A8Linear}


def release_unpacked(module: nn.Module) -> int:
    """Drop each int8 weight that a CPU kernel reads only in its packed layout (a linear's `weight` beside its
    `packed`, a MoE block's `w13`/`w2` beside `w13_packed`/`w2_packed`); returns the bytes freed. For a model
    about to be served in this process: the int8 weights were held twice (Gemma 3 270M's W8A8 LM head 2 x 160
    MB). What reads the plain layout (a state dict for `ladder compile` or tensor-parallel shards, the CUDA
    path) runs before this or on another copy; a released tensor is empty, so any later reader fails loudly."""
    freed = 0
    for sub in module.modules():
        for name in packed_twins(sub):
            tensor = getattr(sub, name)
            if tensor.numel():
                freed += tensor.numel() * tensor.element_size()
                setattr(sub, name, torch.empty(0, dtype=tensor.dtype, device=tensor.device))
    return freed


def packed_twins(module: nn.Module) -> list[str]:
    """The names of `module`'s own int8 tensors that its CPU kernel reads only in a packed copy: an int8
    linear's `weight` beside `packed`, a MoE block's `w13`/`w2` beside `w13_packed`/`w2_packed` (each where the
    packed copy exists)."""
    buffers = dict(module.named_buffers(recurse=False))
    plain = {"weight": "packed"} if isinstance(module, Int8Weights) else {}
    plain |= {name.removesuffix("_packed"): name for name in buffers if name.endswith("_packed")}
    return [name for name, packed in plain.items()
            if buffers.get(packed) is not None and buffers.get(name) is not None]


def linear_names(module: LlamaForCausalLM) -> list[str]:
    """Every linear layer INT8 replaces: q/k/v, o, gate/up, down of each layer, and the LM head. A mixture
    of experts' router (`mlp.gate`, Gemma 4's `router.proj`; a shared expert's gate) stays float
    (model/moe.py Int8SparseMoeBlock says why)."""
    return [name for name, m in module.named_modules()
            if isinstance(m, nn.Linear) and not name.endswith(("mlp.gate", "router.proj", "shared_expert_gate"))]


def quantize_int8(module: LlamaForCausalLM, precision: str = "int8") -> LlamaForCausalLM:
    """Swap the linear layers for the precision's int8 module in place (a tied LM head gets its own
    int8 copy)."""
    linear_type = INT8_LINEARS[precision]
    for name in linear_names(module):
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, child, linear_type.from_linear(getattr(parent, child)))
    if precision == "int8":  # mixture-of-experts layers: their experts weight-only int8 too
        quantize_experts(module)
    return module


def int8_skeleton(module: LlamaForCausalLM, precision: str = "int8") -> LlamaForCausalLM:
    """Empty int8 layers of the precision in place of the linears (on the module's device, e.g. meta),
    ready for `load_state_dict(..., assign=True)` of a saved INT8 model; call `pack_all` after loading."""
    linear_type = INT8_LINEARS[precision]
    for name in linear_names(module):
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        old = getattr(parent, child)
        with torch.device(old.weight.device):
            setattr(parent, child, linear_type(old.in_features, old.out_features, old.bias is not None))
    return module


def pack_all(module: nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, Int8Weights):
            m.pack()


def apply_precision(module: LlamaForCausalLM, precision: str) -> LlamaForCausalLM:
    """The module in `precision` (fp32, fp16, bf16: a cast; int8 and w8a8: int8 linears, see above)."""
    if precision in FLOAT_PRECISIONS:
        module = module.to(FLOAT_PRECISIONS[precision])
        module.make_rotary(module.device)  # rotary frequencies stay float32 whatever the weights' dtype
        return module
    if precision in INT8_LINEARS:
        module = quantize_int8(module.float(), precision)
        dtype = activation_dtype(precision, module.device)
        if dtype != torch.float32:  # on CUDA: 16-bit activations, so the int8 kernel's dots use tensor cores
            for m in module.modules():
                if not isinstance(m, Int8Weights):  # int8 layers keep their float32 scales
                    for name, param in m.named_parameters(recurse=False):
                        param.data = param.data.to(dtype)
        return module
    raise ValueError(f"unknown precision {precision!r} (choose from {', '.join(COMPILE_PRECISIONS)})")


def activation_dtype(precision: str, device: torch.device | str = "cpu") -> torch.dtype:
    """The dtype of activations and of the KV cache for a precision. Weight-only INT8 computes in
    bfloat16 on CUDA (tensor-core dots over widened int8 tiles) and in float32 on a CPU (its kernel's
    type); W8A8 keeps float32 around its integer matmuls."""
    if precision == "int8" and torch.device(device).type == "cuda":
        return torch.bfloat16
    return FLOAT_PRECISIONS.get(precision, torch.float32)
