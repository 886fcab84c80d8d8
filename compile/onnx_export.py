"""ONNX export of the decoder's engine step with its paged KV cache (`engine/backends/onnx_runtime.py` runs it).

`export_onnx` traces one engine step (`LlamaForCausalLM.sample_logits`: write the new tokens' K/V into the
paged caches, attend through the block tables, return the logits of the sampled rows) with
`torch.onnx.export(dynamo=True)`. The attention plan's tensors and the per-layer caches are graph inputs; the
logits and the updated caches are graph outputs (the names and shapes are listed in
`engine/backends/onnx_runtime.py`). Each layer's cache update is one ScatterND straight into the 5-d cache
(indices (k|v, block, offset)), which the runtime binds in place.

Precisions (all three run on ONNX Runtime's CPU provider; `export_onnx` takes the fp32 module, or one
already in the target precision as `model.quantization.apply_precision` leaves it):
  fp32  the traced module as is.
  fp16  weights and KV cache in float16 (rotary angles, softmax and logits in float32). The CPU provider has
        no float16 Gemm/MatMul on x86, so its optimiser wraps those in Casts to float32: half the file and
        cache memory, no speed gain on CPU (it is the GPU precision).
  int8  `onnxruntime.quantization`'s MatMulNBits quantizer: 8-bit symmetric weights in blocks of 32 along K
        on every MatMul with a constant weight (nn.Linear exports as Gemm, rewritten as MatMul first), run
        at accuracy level 4 (activations quantized to int8 per block, integer dot products); KV cache
        float32. See `onnx_rewrites.quantize_int8` for why not `quantize_dynamic`. An `Int8Linear`
        module is exported as the float linear it stands for.
bf16 and w8a8 are refused (see UNSUPPORTED).

The artifact is `model.onnx` plus `model.onnx.data` (every weight, one external file), already optimised
offline by ONNX Runtime at the extended level (fusions that do not depend on the CPU it was built on).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from compile import onnx_rewrites
from engine.backends.onnx_runtime import DATA_FILE, MODEL_FILE, STEP_INPUTS, cache_input, cache_output
from kernels.ops import TORCH_OPS, Ops
from model.attention import ExportPagedAttention, TorchAttentionPlan, TorchPagedAttention, installed
from model.attention_metadata import AttentionMetadata
from model.config import ModelConfig
from model.llama import LlamaForCausalLM
from model.precision import COMPILE_PRECISIONS
from model.quantization import Int8Weights
from model.rope import inverse_frequencies
from model.step import allocate_kv_caches

OPSET = 18
# ONNX Runtime's CPU provider has no bfloat16 MatMul kernels; W8A8 is a torch-compile precision.
UNSUPPORTED = {
    "bf16": "the onnx backend has no bf16: ONNX Runtime's CPU provider has no bfloat16 MatMul kernels; use "
            "--precision fp16 or fp32, or the torch-compile backend for bf16",
    "w8a8": "the onnx backend has no w8a8: use --precision int8 (MatMulNBits), or the torch-compile backend",
}


# --- the traced step -------------------------------------------------------------------------------------


class _StepGraph(nn.Module):
    """The engine step with flat tensor arguments, as the exporter sees it."""

    def __init__(self, module: LlamaForCausalLM, attention: ExportPagedAttention) -> None:
        super().__init__()
        self.module = module
        self.attention = attention

    def forward(self, input_ids, positions, query_index, output_index, block_tables, mask, slot_mapping,
                seq_lens, sample_rows, *kv_caches):
        plan = TorchAttentionPlan(query_index=query_index, output_index=output_index, block_tables=block_tables,
                                  mask=mask, slot_mapping=slot_mapping, seq_lens=seq_lens)
        self.attention.updated = []
        logits = self.module.sample_logits(input_ids, positions, list(kv_caches), plan, sample_rows)
        updated = self.attention.updated
        self.attention.updated = []
        return (logits, *updated)


@contextlib.contextmanager
def _exportable(module: LlamaForCausalLM) -> Iterator[ExportPagedAttention]:
    """Temporarily give `module` the plain-torch ops and the export attention backend (restored after)."""
    saved: list[tuple[object, str, object]] = []

    def swap(obj: object, name: str, value: object) -> None:
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    try:
        for sub in module.modules():
            if isinstance(getattr(sub, "ops", None), Ops):
                swap(sub, "ops", TORCH_OPS)
        for name, sub in list(module.named_modules()):
            if isinstance(sub, Int8Weights):  # its CPU kernel does not trace: the float linear it stands for
                parent_name, _, child = name.rpartition(".")
                swap(module.get_submodule(parent_name) if parent_name else module, child, _dequantized(sub))
        # Rotary angles in float32 whatever the weights (a `module.to(float16)` casts this buffer too).
        swap(module, "inv_freq", inverse_frequencies(module.config).to(module.inv_freq.device))
        with installed(module, ExportPagedAttention(module.block_size, module.config.sliding_window)) as attention:
            yield attention
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def example_step(config: ModelConfig, block_size: int, num_blocks: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
    """A small mixed batch (a prefill chunk and a decode) to trace with: (args, kv_caches), on the
    model's `device`. No dim is 0 or 1: the exporter would specialise it."""
    meta = AttentionMetadata.build([5, 1], [5, block_size + 3], [[1], [2, 3]], block_size, device)
    plan = TorchPagedAttention(block_size, config.sliding_window).plan(meta)
    input_ids = torch.arange(6, dtype=torch.long, device=device) % config.vocab_size
    positions = torch.tensor([0, 1, 2, 3, 4, block_size + 2], dtype=torch.long, device=device)
    sample_rows = torch.tensor([4, 5], dtype=torch.long, device=device)
    caches = allocate_kv_caches(config, block_size, num_blocks, dtype, device)
    args = (input_ids, positions, plan.query_index, plan.output_index, plan.block_tables, plan.mask,
            plan.slot_mapping, plan.seq_lens, sample_rows)
    return args, caches


# --- export ----------------------------------------------------------------------------------------------


def _fp16_copy(module: LlamaForCausalLM) -> LlamaForCausalLM:
    """A float16 copy: parameters cast (the rotary frequencies are restored to float32 while tracing)."""
    half = copy.deepcopy(module)
    for param in half.parameters():
        param.data = param.data.to(torch.float16)
    return half


def _dequantized(sub: nn.Module) -> nn.Linear:
    """The float32 nn.Linear an Int8Linear stands for (weight * scale); the int8 export quantizes it again
    in its own blocks, so `ladder compile` hands the exporter the fp32 module instead."""
    linear = nn.Linear(sub.in_features, sub.out_features, bias=sub.bias is not None)
    linear.weight = nn.Parameter(sub.weight.float() * sub.scale.float()[:, None], requires_grad=False)
    if sub.bias is not None:
        linear.bias = nn.Parameter(sub.bias.detach().float(), requires_grad=False)
    return linear


def module_precision(module: LlamaForCausalLM) -> str:
    """fp32, fp16, bf16, or int8 (linears swapped for Int8Linear by `model.quantization`)."""
    if any(isinstance(sub, Int8Weights) for sub in module.modules()):
        return "int8"
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(
        module.embed_tokens.weight.dtype, str(module.embed_tokens.weight.dtype))


def check_precision(precision: str) -> None:
    if precision in UNSUPPORTED:
        raise ValueError(UNSUPPORTED[precision])
    if precision not in COMPILE_PRECISIONS:
        supported = [p for p in COMPILE_PRECISIONS if p not in UNSUPPORTED]
        raise ValueError(f"unknown precision {precision!r} for the onnx backend (choose from {', '.join(supported)})")


def check_available(precision: str, device: torch.device | str = "cpu") -> None:
    """Raise ValueError (one line, with the fix) when this backend cannot build `precision` for `device`."""
    check_precision(precision)
    for package, pip_name in (("onnx", "onnx"), ("onnxscript", "onnxscript"), ("onnxruntime", "onnxruntime")):
        try:
            __import__(package)
        except ImportError:
            raise ValueError(f"the onnx backend needs the `{package}` package (pip install {pip_name}, "
                             "or the `compile` extra)") from None
    device = torch.device(device)
    if device.type == "cuda":
        import onnxruntime as ort

        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise ValueError("--device cuda with the onnx backend needs onnxruntime-gpu (CUDAExecutionProvider); "
                             f"this onnxruntime has {', '.join(ort.get_available_providers())}")
    elif device.type != "cpu":
        raise ValueError(f"the onnx backend runs on cpu or cuda, not {device.type}")


def _export_graph(module: LlamaForCausalLM, path: Path, cache_dtype: torch.dtype) -> None:
    """Trace one step of `module` and save it at `path` (weights in `path` + ".data")."""
    cfg = module.config
    args, caches = example_step(cfg, module.block_size, num_blocks=8, dtype=cache_dtype, device=module.device)
    dynamic = torch.export.Dim.DYNAMIC
    num_blocks = torch.export.Dim("num_blocks")  # one symbol shared by every layer's cache
    dims = {
        "input_ids": {0: dynamic}, "positions": {0: dynamic}, "query_index": {0: dynamic, 1: dynamic},
        "output_index": {0: dynamic}, "block_tables": {0: dynamic, 1: dynamic},
        "mask": {0: dynamic, 2: dynamic, 3: dynamic}, "slot_mapping": {0: dynamic}, "seq_lens": {0: dynamic},
        "sample_rows": {0: dynamic},
    }
    # forward(*step, *kv_caches): the varargs take one entry, a tuple with one spec per cache.
    dynamic_shapes = (*(dims[n] for n in STEP_INPUTS), tuple({1: num_blocks} for _ in caches))
    names_in = [*STEP_INPUTS, *(cache_input(i) for i in range(cfg.num_layers))]
    names_out = ["logits", *(cache_output(i) for i in range(cfg.num_layers))]
    with _exportable(module) as attention, torch.no_grad():
        program = torch.onnx.export(
            _StepGraph(module, attention).eval(), (*args, *caches), dynamo=True, input_names=names_in,
            output_names=names_out, dynamic_shapes=dynamic_shapes, opset_version=OPSET, optimize=True,
            verbose=False,
        )
    program.save(str(path), external_data=True)


def export_for_tensorrt(module: LlamaForCausalLM, out_dir: Path, precision: str) -> list[str]:
    """The graph TensorRT builds from: the fp32 step (TensorRT picks fp16/bf16 kernels itself from
    builder flags), with Q/DQ int8 weights for int8; not optimised by ONNX Runtime, whose constant
    folding would undo the Q/DQ. Writes `model.onnx` and `model.onnx.data`."""
    import onnx

    if module_precision(module) != "fp32":
        raise ValueError("the TensorRT export takes the fp32 module")
    out_dir = Path(out_dir)
    target = out_dir / MODEL_FILE
    _export_graph(module, target, torch.float32)
    if precision == "int8":
        onnx_rewrites.gemm_to_matmul(target)
        onnx_rewrites.weight_qdq(target)
    onnx.checker.check_model(str(target), full_check=True)
    return [MODEL_FILE, DATA_FILE]


def export_onnx(module: LlamaForCausalLM, out_dir: Path, precision: str) -> list[str]:
    """Export one engine step of `module` to `out_dir` as an ONNX Runtime-optimised graph.

    Writes `model.onnx` and `model.onnx.data` (all weights, one external file) and returns those names,
    relative to `out_dir`. `precision`: fp32, fp16 or int8 (see the module docstring). `module` itself is
    left as it was (its ops and attention backend are swapped only while tracing)."""
    import onnx

    check_precision(precision)
    have = module_precision(module)
    if have != "fp32" and have != precision:
        raise ValueError(f"cannot export a {have} module as {precision}: pass the fp32 module"
                         + ("" if precision == "fp32" else f" or one already in {precision}"))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / MODEL_FILE
    staging = out_dir / ".export"
    staging.mkdir(exist_ok=True)
    try:
        raw = staging / "step.onnx"
        if precision == "fp16":
            _export_graph(module if have == "fp16" else _fp16_copy(module), raw, torch.float16)
        else:
            _export_graph(module, raw, torch.float32)
        onnx.checker.check_model(str(raw), full_check=True)
        if precision == "int8":
            raw = onnx_rewrites.quantize_int8(raw, staging / "step.int8.onnx")
        for name in (MODEL_FILE, DATA_FILE):
            (out_dir / name).unlink(missing_ok=True)
        onnx_rewrites.optimize(raw, target)
        onnx.checker.check_model(str(target))
    finally:
        for path in sorted(staging.iterdir()) if staging.exists() else ():
            path.unlink()
        staging.rmdir()
    return [name for name in (MODEL_FILE, DATA_FILE) if (out_dir / name).exists()]
