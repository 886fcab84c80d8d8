"""Building the `tensorrt` backend: a serialized TensorRT engine from the ONNX export.

Built with the TensorRT Python API: the ONNX parser fills a network, one optimization profile covers the
shapes the artifact declares (tokens per step from `--max-num-batched-tokens`, sequences, blocks per
sequence, cache blocks; zero sampled rows for prompt-only steps), and the
builder serializes the engine to `model.plan`, which `engine/backends/tensorrt_runtime.py` runs.

TensorRT needs an NVIDIA GPU and the `tensorrt` package; without them `check_available` stops the
command before any work. The graph is the fp32 ONNX step (`onnx_export.export_for_tensorrt`); INT8 is
explicit quantization, int8 weights behind DequantizeLinear nodes (one scale per output channel). The
caches and logits stay fp32 at the engine's boundary. How the 16-bit precisions reach the engine depends
on the installed TensorRT (`precision_mode`):

- strongly typed (TensorRT 10.x, where `NetworkDefinitionCreationFlag.STRONGLY_TYPED` exists and weak
  typing is deprecated from 10.12; TensorRT 11.x, where every network is strongly typed, the flag is
  accepted and ignored, and the FP16/BF16/INT8 builder flags are gone): the precision is in the graph.
  `cast_matmuls` casts every matmul with a constant weight to fp16/bf16 (weight, activation in, result
  back to fp32) before parsing; norms, rotary, softmax, attention and the cache stay fp32. For int8 the
  weights' DequantizeLinear scales become fp16, so the dequantized weight and the matmul are fp16.
- builder flags (TensorRT before strongly typed networks: 8.x and 9.x, which `tensorrt>=10` in the extra
  no longer installs): the fp32 graph with FP16/BF16/INT8 flags, TensorRT choosing per layer.

This module has not run on a machine with TensorRT: it follows the TensorRT Python API docs and the
10.x-to-11.x migration guide.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.backends.onnx_runtime import MODEL_FILE, cache_input
from engine.backends.tensorrt_runtime import ENGINE_FILE
from kernels.kv_layout import blocks_for_tokens, kv_cache_shape
from model.config import ModelConfig


def check_available(precision: str, device: torch.device) -> None:
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError("the tensorrt backend needs an NVIDIA GPU (--device cuda); none is available here")
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        raise ValueError("the tensorrt backend needs the `tensorrt` Python package "
                         "(pip install 'ladder[tensorrt]')") from None


def _profile_shapes(config: ModelConfig, shapes: dict[str, int], tokens: int) -> dict[str, tuple[tuple, tuple, tuple]]:
    """(min, opt, max) of every input for the declared shapes."""
    seqs, bs = shapes["max_num_seqs"], shapes["block_size"]
    blocks_per_seq = blocks_for_tokens(shapes["max_model_len"], bs)
    cache_blocks = seqs * blocks_per_seq
    one = {
        "input_ids": (tokens,), "positions": (tokens,), "output_index": (tokens,), "slot_mapping": (tokens,),
        "query_index": (seqs, tokens), "block_tables": (seqs, blocks_per_seq),
        "mask": (seqs, 1, tokens, blocks_per_seq * bs), "seq_lens": (seqs,), "sample_rows": (seqs,),
    }
    profiles = {name: (tuple(1 for _ in dims), tuple(max(1, d // 2) for d in dims), dims)
                for name, dims in one.items()}
    # A step of prompt chunks only samples no row: sample_rows (and the logits) may be empty.
    profiles["sample_rows"] = ((0,), (max(1, seqs // 2),), (seqs,))
    cache = kv_cache_shape(cache_blocks, bs, config.num_kv_heads, config.head_dim)
    for i in range(config.num_layers):
        profiles[cache_input(i)] = (kv_cache_shape(1, bs, config.num_kv_heads, config.head_dim), cache, cache)
    return profiles


STRONGLY_TYPED, BUILDER_FLAGS = "strongly typed", "builder flags"
ONNX_DTYPE = {"fp16": 10, "bf16": 16}  # onnx.TensorProto.FLOAT16, BFLOAT16
CAST_FILE = "model.trt.onnx"  # the cast graph, beside the export while the engine builds (then removed)


def precision_mode(trt: Any) -> str:
    """How this TensorRT takes a 16-bit precision: in the graph (strongly typed network) where it can,
    from builder flags only where strong typing does not exist yet."""
    if hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
        return STRONGLY_TYPED
    if hasattr(trt, "BuilderFlag") and hasattr(trt.BuilderFlag, "FP16"):
        return BUILDER_FLAGS
    raise ValueError(f"TensorRT {getattr(trt, '__version__', '?')} has neither strongly typed networks nor "
                     "precision builder flags; install tensorrt>=10")


def cast_matmuls(source: Path, target: Path, precision: str) -> int:
    """Write `source` to `target` with every MatMul and Gemm whose weight is constant (an initializer or
    a DequantizeLinear of one) computed in `precision`: Cast nodes to it on the inputs (int8: the
    dequantize scale itself) and one back to float32 on the output. Returns how many were cast."""
    import onnx
    from onnx import helper, numpy_helper

    to = ONNX_DTYPE[precision]
    model = onnx.load(str(source))  # with its external data
    graph = model.graph
    inits = {init.name: init for init in graph.initializer}
    dequantized = {n.output[0]: n for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits}
    consumers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            consumers[name] = consumers.get(name, 0) + 1
    nodes, count = [], 0
    casts: dict[str, str] = {}  # tensor -> its cast
    for node in graph.node:
        if node.op_type not in ("MatMul", "Gemm") or not (node.input[1] in inits or node.input[1] in dequantized):
            nodes.append(node)
            continue
        count += 1
        for i, name in enumerate(node.input):
            if not name:
                continue
            dq = dequantized.get(name)
            if dq is not None and precision == "fp16" and consumers[dq.input[1]] == 1:
                # DequantizeLinear's output has its scale's type: an fp16 scale gives an fp16 weight
                # (TensorRT's weight-only int8 form). Opset 19 is the first to allow it.
                scale = inits[dq.input[1]]
                scale.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(scale).astype("float16"), scale.name))
                continue
            if name not in casts:  # one Cast per tensor, however many matmuls read it (graph order kept)
                casts[name] = f"{name}.to_{precision}"
                nodes.append(helper.make_node("Cast", [name], [casts[name]], name=casts[name], to=to))
            node.input[i] = casts[name]
        result = node.output[0]
        node.output[0] = f"{result}.in_{precision}"
        nodes += [node, helper.make_node("Cast", [node.output[0]], [result], name=f"{result}.to_float",
                                         to=onnx.TensorProto.FLOAT)]
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx") and any(n.op_type == "DequantizeLinear" for n in nodes):
            opset.version = max(opset.version, 19)
    del graph.node[:]
    graph.node.extend(nodes)
    data = target.name + ".data"
    (target.parent / data).unlink(missing_ok=True)
    onnx.save_model(model, str(target), save_as_external_data=True, all_tensors_to_one_file=True, location=data,
                    size_threshold=1024)
    return count


def build_engine(directory: Path, options: Any, model_config: ModelConfig) -> list[str]:
    """Parse `model.onnx` in `directory` and write the serialized engine beside it."""
    import tensorrt as trt

    mode = precision_mode(trt)
    source = directory / MODEL_FILE
    cast = directory / CAST_FILE
    try:
        if mode == STRONGLY_TYPED and options.precision in ("fp16", "bf16", "int8"):
            # int8: fp16 beside the int8 weights, as the builder flags allowed before.
            cast_matmuls(source, cast, "bf16" if options.precision == "bf16" else "fp16")
            source = cast
        serialized = _build(trt, mode, source, options, model_config)
    finally:
        cast.unlink(missing_ok=True)
        (directory / (CAST_FILE + ".data")).unlink(missing_ok=True)
    (directory / ENGINE_FILE).write_bytes(bytes(serialized))
    return [ENGINE_FILE]


def _build(trt: Any, mode: str, onnx_file: Path, options: Any, model_config: ModelConfig):
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    if mode == STRONGLY_TYPED:
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    elif hasattr(trt.NetworkDefinitionCreationFlag, "EXPLICIT_BATCH"):
        # TensorRT 8.x: the ONNX parser needs an explicit-batch network (10.x: the only mode, flag ignored).
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_file)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ValueError(f"TensorRT cannot parse the ONNX export: {errors}")
    config = builder.create_builder_config()
    if mode == BUILDER_FLAGS:
        wanted = {"fp16": ("FP16",), "bf16": ("BF16",), "int8": ("FP16", "INT8")}.get(options.precision, ())
        for name in wanted:  # int8: Q/DQ weights; the rest may run in fp16
            if not hasattr(trt.BuilderFlag, name):
                raise ValueError(f"this TensorRT has no {name} builder flag for --precision {options.precision}")
            config.set_flag(getattr(trt.BuilderFlag, name))
    shapes = {"max_num_seqs": options.max_num_seqs, "max_model_len": options.max_model_len,
              "block_size": options.block_size}
    profile = builder.create_optimization_profile()
    tokens = options.max_num_batched_tokens  # the engine serving the artifact is capped to it (manifest)
    for name, (low, opt, high) in _profile_shapes(model_config, shapes, tokens).items():
        profile.set_shape(name, low, opt, high)
    config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise ValueError("TensorRT failed to build the engine (see its log above)")
    return serialized
