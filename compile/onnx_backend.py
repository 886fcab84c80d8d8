"""ONNX export of the decoder with its paged KV cache, and an ONNX Runtime model with the engine's interface.

`export_onnx` traces one engine step (`LlamaForCausalLM.sample_logits`: write the new tokens' K/V into the
paged caches, attend through the block tables, return the logits of the sampled rows) with
`torch.onnx.export(dynamo=True)`. The attention plan's tensors and the per-layer caches are graph inputs; the
logits and the updated caches are graph outputs:

    inputs   input_ids [T], positions [T], query_index [S, Q], output_index [T], block_tables [S, NB],
             mask [S, 1, Q, L] bool, slot_mapping [T], seq_lens [S], sample_rows [B]  (all int64 but mask),
             kv_cache.{i} [2, N, block_size, kv_heads, head_dim]  (one per layer)
    outputs  logits [B, vocab] float32, kv_cache_out.{i} (same shape as kv_cache.{i})

Inside the graph each layer's cache update is one ScatterND straight into the 5-d cache (indices
(k|v, block, offset)), and the attention reads the ScatterND's output, never the input cache. So when
`OnnxModel` binds `kv_cache_out.{i}` to the very buffer of `kv_cache.{i}`, ONNX Runtime's ScatterND sees
input == output and only writes the new slots: the cache is updated in place with no copy.

Precisions (all three run on ONNX Runtime's CPU provider; `export_onnx` takes the fp32 module, or one
already in the target precision as `compile.quantize.apply_precision` leaves it):
  fp32  the traced module as is.
  fp16  weights and KV cache in float16 (rotary angles, softmax and logits in float32). The CPU provider has
        no float16 Gemm/MatMul on x86, so its optimiser wraps those in Casts to float32: half the file and
        cache memory, no speed gain on CPU (it is the GPU precision).
  int8  `onnxruntime.quantization`'s MatMulNBits quantizer: 8-bit symmetric weights in blocks of 32 along K
        on every MatMul with a constant weight (nn.Linear exports as Gemm, rewritten as MatMul first), run
        at accuracy level 4 (activations quantized to int8 per block, integer dot products); KV cache
        float32. See `_quantize_int8` for why not `quantize_dynamic`. An `Int8Linear` module is exported
        as the float linear it stands for.
bf16 is refused (no bfloat16 MatMul kernels in ONNX Runtime's CPU provider).

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

from kernels.ops import TORCH_OPS, Ops
from model.attention import AttentionMetadata, TorchAttentionPlan, TorchPagedAttention
from model.config import ModelConfig
from model.llama import LlamaForCausalLM
from model.rope import inverse_frequencies

PRECISIONS = ("fp32", "fp16", "int8")
MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
OPSET = 18
INT8_BLOCK = 32  # weights per int8 scale along K (MatMulNBits)

PLAN_INPUTS = ("query_index", "output_index", "block_tables", "mask", "slot_mapping", "seq_lens")
STEP_INPUTS = ("input_ids", "positions", *PLAN_INPUTS, "sample_rows")


def cache_input(i: int) -> str:
    return f"kv_cache.{i}"


def cache_output(i: int) -> str:
    return f"kv_cache_out.{i}"


# --- the traced step -------------------------------------------------------------------------------------


class ExportPagedAttention(TorchPagedAttention):
    """`TorchPagedAttention` written for export: the cache update is functional (the new cache is a new
    tensor, recorded in `self.updated` for the exporter to return), and grouped-query attention is
    a reshape of the queries instead of SDPA's `enable_gqa` (no repeated K/V heads are materialised).

    Computes what the plain-torch backend computes, in the query's dtype with the softmax in float32.
    """

    def __init__(self, block_size: int, sliding_window: int | None = None) -> None:
        super().__init__(block_size, sliding_window)
        self.updated: list[torch.Tensor] = []

    def forward(self, q, k, v, kv_cache, plan: TorchAttentionPlan, scale: float) -> torch.Tensor:
        _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        num_heads = q.shape[1]
        group = num_heads // num_kv_heads
        # One ScatterND into the 5-d cache: rows (0|1, block, offset) get the new keys, then values.
        slots = plan.slot_mapping
        which = torch.cat([torch.zeros_like(slots), torch.ones_like(slots)])
        blocks = torch.cat([slots // block_size, slots // block_size])
        offsets = torch.cat([slots % block_size, slots % block_size])
        new_kv = torch.cat([k, v]).to(kv_cache.dtype)  # [2T, kvh, d]
        kv_cache = kv_cache.index_put((which, blocks, offsets), new_kv)
        self.updated.append(kv_cache)

        num_seqs, max_q = plan.query_index.shape
        # [S, NB, bs, kvh, d] -> [S, kvh, L, d]
        keys = kv_cache[0][plan.block_tables].reshape(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
        values = kv_cache[1][plan.block_tables].reshape(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        # Queries [S, Q, H, d] -> [S, kvh, Q * group, d]: the heads sharing a kv head side by side.
        queries = q[plan.query_index].reshape(num_seqs, max_q, num_kv_heads, group, head_dim)
        queries = queries.permute(0, 2, 1, 3, 4).reshape(num_seqs, num_kv_heads, max_q * group, head_dim)
        scores = torch.matmul(queries, keys.transpose(2, 3)).float() * scale  # [S, kvh, Q * group, L]
        scores = scores.reshape(num_seqs, num_kv_heads, max_q, group, -1)
        scores = scores.masked_fill(~plan.mask[:, :, :, None, :], float("-inf"))  # mask [S, 1, Q, 1, L]
        probs = torch.softmax(scores, dim=-1).to(q.dtype).reshape(num_seqs, num_kv_heads, max_q * group, -1)
        out = torch.matmul(probs, values)  # [S, kvh, Q * group, d]
        out = out.reshape(num_seqs, num_kv_heads, max_q, group, head_dim).permute(0, 2, 1, 3, 4)
        out = out.reshape(num_seqs * max_q, num_heads, head_dim)
        return out[plan.output_index]


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
    attention = ExportPagedAttention(module.block_size, module.config.sliding_window)
    saved: list[tuple[object, str, object]] = []

    def swap(obj: object, name: str, value: object) -> None:
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    try:
        for sub in module.modules():
            if isinstance(getattr(sub, "ops", None), Ops):
                swap(sub, "ops", TORCH_OPS)
        for name, sub in list(module.named_modules()):
            if _is_int8_linear(sub):  # its CPU kernel does not trace: the float linear it stands for
                parent_name, _, child = name.rpartition(".")
                swap(module.get_submodule(parent_name) if parent_name else module, child, _dequantized(sub))
        # Rotary angles in float32 whatever the weights (a `module.to(float16)` casts this buffer too).
        swap(module, "inv_freq", inverse_frequencies(module.config).to(module.inv_freq.device))
        swap(module, "attention", attention)
        for layer in module.layers:
            swap(layer.self_attn, "backend", attention)
        yield attention
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def example_step(config: ModelConfig, block_size: int, num_blocks: int, dtype: torch.dtype):
    """A small mixed batch (a prefill chunk and a decode) to trace with: (args, kv_caches). No dim is
    0 or 1: the exporter would specialise it."""
    meta = AttentionMetadata.build([5, 1], [5, block_size + 3], [[1], [2, 3]], block_size)
    plan = TorchPagedAttention(block_size, config.sliding_window).plan(meta)
    input_ids = torch.arange(6, dtype=torch.long) % config.vocab_size
    positions = torch.tensor([0, 1, 2, 3, 4, block_size + 2], dtype=torch.long)
    sample_rows = torch.tensor([4, 5], dtype=torch.long)
    shape = (2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
    caches = [torch.zeros(shape, dtype=dtype) for _ in range(config.num_layers)]
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


def _is_int8_linear(sub: nn.Module) -> bool:
    """`compile.quantize.Int8Linear` (duck-typed): int8 `weight` [N, K] with a float32 `scale` [N]."""
    weight = getattr(sub, "weight", None)
    return (not isinstance(sub, nn.Linear) and isinstance(weight, torch.Tensor) and weight.dtype == torch.int8
            and isinstance(getattr(sub, "scale", None), torch.Tensor))


def _dequantized(sub: nn.Module) -> nn.Linear:
    """The float32 nn.Linear an Int8Linear stands for (weight * scale); the int8 export quantizes it again
    in its own blocks, so `ladder compile` hands the exporter the fp32 module instead."""
    linear = nn.Linear(sub.in_features, sub.out_features, bias=sub.bias is not None)
    linear.weight = nn.Parameter(sub.weight.float() * sub.scale.float()[:, None], requires_grad=False)
    if sub.bias is not None:
        linear.bias = nn.Parameter(sub.bias.detach().float(), requires_grad=False)
    return linear


def module_precision(module: LlamaForCausalLM) -> str:
    """fp32, fp16, bf16, or int8 (linears swapped for Int8Linear by `compile.quantize`)."""
    if any(_is_int8_linear(sub) for sub in module.modules()):
        return "int8"
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(
        module.embed_tokens.weight.dtype, str(module.embed_tokens.weight.dtype))


def check_precision(precision: str) -> None:
    if precision == "bf16":
        raise ValueError("the onnx backend has no bf16: ONNX Runtime's CPU provider has no bfloat16 MatMul "
                         "kernels; use --precision fp16 or fp32, or the torch-compile backend for bf16")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r} for the onnx backend (choose from {', '.join(PRECISIONS)})")


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
    args, caches = example_step(cfg, module.block_size, num_blocks=8, dtype=cache_dtype)
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


def _gemm_to_matmul(path: Path) -> None:
    """Rewrite `Gemm(x, W, b, transB=1)` with a constant W as `MatMul(x, W^T) (+ b)` in place.

    ONNX Runtime's dynamic quantizer only quantizes MatMul (its integer-op registry has no Gemm), and
    the exporter writes every nn.Linear as a Gemm."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(path))  # with its external data
    graph = model.graph
    inits = {init.name: init for init in graph.initializer}
    nodes = []
    for node in graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if (node.op_type != "Gemm" or node.input[1] not in inits or attrs.get("transA", 0)
                or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0):
            nodes.append(node)
            continue
        weight = numpy_helper.to_array(inits[node.input[1]])
        if attrs.get("transB", 0):
            weight = np.ascontiguousarray(weight.T)
        name = node.input[1] + ".matmul"
        graph.initializer.append(numpy_helper.from_array(weight, name))
        has_bias = len(node.input) > 2 and node.input[2]
        mm_out = node.output[0] + ".mm" if has_bias else node.output[0]
        nodes.append(helper.make_node("MatMul", [node.input[0], name], [mm_out], name=node.name + ".matmul"))
        if has_bias:
            nodes.append(helper.make_node("Add", [mm_out, node.input[2]], [node.output[0]], name=node.name + ".bias"))
    _save_with_nodes(model, nodes, path)


def _quantize_int8(source: Path, target: Path) -> Path:
    """INT8 weights and activations through `onnxruntime.quantization`: every MatMul with a constant weight
    becomes MatMulNBits with 8-bit symmetric weights in blocks of INT8_BLOCK along K, run at accuracy
    level 4 (activations quantized to int8 per block on the fly, integer dot products).

    Not `quantize_dynamic`: its one uint8 scale per activation tensor cost SmolLM2-135M +10.7% perplexity
    on the built-in text (+14.6% on its first 1,024 tokens; +5.6% with the LM head and down projections
    left in fp32), against +0.8% for this."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    _gemm_to_matmul(source)  # the quantizer takes MatMul only; the exporter writes nn.Linear as Gemm
    quantizer = MatMulNBitsQuantizer(onnx.load(str(source)), bits=8, block_size=INT8_BLOCK, is_symmetric=True,
                                     accuracy_level=4)
    quantizer.process()
    _save(quantizer.model.model, target)
    return target


def _weight_qdq(path: Path) -> None:
    """INT8 weights as Q/DQ, in place: every MatMul with a constant weight W [K, N] reads
    DequantizeLinear(W_int8, scale[N], axis=1) instead (symmetric, one scale per output channel), the
    explicit quantization TensorRT builds int8 weights from. Activations stay float."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(path))
    graph = model.graph
    inits = {init.name: init for init in graph.initializer}
    nodes = []
    for node in graph.node:
        if node.op_type == "MatMul" and node.input[1] in inits:
            weight = numpy_helper.to_array(inits[node.input[1]]).astype(np.float32)  # [K, N]
            scale = np.maximum(np.abs(weight).max(axis=0), 1e-12) / 127.0
            quantized = np.clip(np.round(weight / scale), -127, 127).astype(np.int8)
            base = node.input[1]
            graph.initializer.extend([numpy_helper.from_array(quantized, base + ".int8"),
                                      numpy_helper.from_array(scale.astype(np.float32), base + ".scale")])
            nodes.append(helper.make_node("DequantizeLinear", [base + ".int8", base + ".scale"], [base + ".dq"],
                                          name=node.name + ".dq", axis=1))
            node.input[1] = base + ".dq"
        nodes.append(node)
    _save_with_nodes(model, nodes, path)


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
        _gemm_to_matmul(target)
        _weight_qdq(target)
    onnx.checker.check_model(str(target), full_check=True)
    return [MODEL_FILE, DATA_FILE]


def _save_with_nodes(model, nodes: list, path: Path) -> None:
    """Give `model`'s graph the node list `nodes`, drop the initializers nothing reads any more, save."""
    graph = model.graph
    del graph.node[:]
    graph.node.extend(nodes)
    used = {i for n in graph.node for i in n.input}
    kept = [init for init in graph.initializer if init.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    _save(model, path)


def _save(model, path: Path) -> None:
    import onnx

    data = path.name + ".data"
    (path.parent / data).unlink(missing_ok=True)
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data,
                    size_threshold=1024)


def _optimize(source: Path, target: Path) -> None:
    """ONNX Runtime's offline graph optimisation (extended level: portable across CPUs) of `source`."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(target)
    options.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                     target.name + ".data")
    options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])


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
            raw = _quantize_int8(raw, staging / "step.int8.onnx")
        for name in (MODEL_FILE, DATA_FILE):
            (out_dir / name).unlink(missing_ok=True)
        _optimize(raw, target)
        onnx.checker.check_model(str(target))
    finally:
        for path in sorted(staging.iterdir()) if staging.exists() else ():
            path.unlink()
        staging.rmdir()
    return [name for name in (MODEL_FILE, DATA_FILE) if (out_dir / name).exists()]


# --- running -----------------------------------------------------------------------------------------------

_ORT_TYPES = {torch.float32: "float32", torch.float16: "float16", torch.int64: "int64", torch.bool: "bool"}
_ONNX_ELEM = {1: torch.float32, 10: torch.float16, 7: torch.int64, 9: torch.bool}


def default_providers() -> list[str]:
    """CUDA when this onnxruntime build has it, then the CPU. (TensorRT needs shape profiles for the
    dynamic dims: pass it explicitly with its options when wanted.)"""
    import onnxruntime as ort

    available = ort.get_available_providers()
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]


def ort_value(array, device: torch.device):
    import onnxruntime as ort

    return ort.OrtValue.ortvalue_from_numpy(array, device.type, device.index or 0)


class OnnxModel:
    """An exported step in an `onnxruntime.InferenceSession`, with the interface the engine's runner uses
    on `LlamaForCausalLM`: `block_size`, `config`, `attention.plan(meta)`, `allocate_kv_caches`,
    `sample_logits` (which updates the caches in place)."""

    def __init__(self, session, config: ModelConfig, block_size: int, kv_cache_dtype: torch.dtype,
                 alias_caches: bool = True) -> None:
        self.session = session
        self.config = config
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype
        self.attention = TorchPagedAttention(block_size, config.sliding_window)
        # True: bind kv_cache_out.{i} to kv_cache.{i}'s own buffer (ScatterND then writes only the new
        # slots). False: ORT writes a fresh cache that is copied back (for measuring that cost).
        self.alias_caches = alias_caches
        self.device = torch.device("cuda", 0) if session.get_providers()[0] in (
            "CUDAExecutionProvider", "TensorrtExecutionProvider") else torch.device("cpu")
        self._check_graph()
        self._scratch: list[torch.Tensor] | None = None
        self.last_copy_seconds = 0.0

    @classmethod
    def load(cls, directory: Path, config: ModelConfig, block_size: int, kv_cache_dtype: torch.dtype,
             num_threads: int | None = None, providers: list | None = None, alias_caches: bool = True) -> OnnxModel:
        import onnxruntime as ort

        options = ort.SessionOptions()
        # The artifact is already optimised offline; the online pass may add machine-specific layouts.
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if num_threads is not None:
            options.intra_op_num_threads = num_threads
        session = ort.InferenceSession(str(Path(directory) / MODEL_FILE), options,
                                       providers=providers or default_providers())
        return cls(session, config, block_size, kv_cache_dtype, alias_caches)

    def _check_graph(self) -> None:
        cfg = self.config
        inputs = {i.name: i for i in self.session.get_inputs()}
        expected = [*STEP_INPUTS, *(cache_input(i) for i in range(cfg.num_layers))]
        if sorted(inputs) != sorted(expected):
            raise ValueError(f"ONNX graph inputs {sorted(inputs)} do not match the config's {cfg.num_layers} layers")
        cache = inputs[cache_input(0)]
        want_type = f"tensor({_ORT_TYPES[self.kv_cache_dtype]})".replace("float32", "float")
        if cache.type != want_type:
            raise ValueError(f"ONNX graph takes a {cache.type} KV cache, not {self.kv_cache_dtype}")
        shape = [2, None, self.block_size, cfg.num_kv_heads, cfg.head_dim]
        got = [d if isinstance(d, int) else None for d in cache.shape]
        if got != shape:
            raise ValueError(f"ONNX graph KV cache shape {cache.shape} does not match {shape}")

    def allocate_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        shape = (2, num_blocks, self.block_size, self.config.num_kv_heads, self.config.head_dim)
        self._scratch = None
        return [torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
                for _ in range(self.config.num_layers)]

    def _bind(self, binding, name: str, tensor: torch.Tensor, output: bool = False) -> None:
        import numpy as np

        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        device = tensor.device
        if tensor.numel() == 0:  # no buffer to point at (data_ptr 0): let ORT hold the empty tensor
            if output:
                binding.bind_output(name, device.type, device.index or 0)
            else:
                empty = np.empty(list(tensor.shape), dtype=_ORT_TYPES[tensor.dtype])
                binding.bind_ortvalue_input(name, ort_value(empty, device))
            return
        args = (name, device.type, device.index or 0, np.dtype(_ORT_TYPES[tensor.dtype]), list(tensor.shape),
                tensor.data_ptr())
        (binding.bind_output if output else binding.bind_input)(*args)

    @torch.inference_mode()
    def sample_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                      plan: TorchAttentionPlan, sample_rows: torch.Tensor) -> torch.Tensor:
        """Logits [B, vocab] float32 of `sample_rows`; writes this step's keys and values into `kv_caches`."""
        import time

        if len(kv_caches) != self.config.num_layers:
            raise ValueError(f"expected {self.config.num_layers} KV caches, got {len(kv_caches)}")
        device = self.device
        step = {
            "input_ids": input_ids, "positions": positions, "query_index": plan.query_index,
            "output_index": plan.output_index, "block_tables": plan.block_tables, "mask": plan.mask,
            "slot_mapping": plan.slot_mapping, "seq_lens": plan.seq_lens, "sample_rows": sample_rows,
        }
        # Keep every bound tensor referenced until the run is over.
        bound = {name: t.to(device=device, dtype=torch.bool if name == "mask" else torch.long).contiguous()
                 for name, t in step.items()}
        logits = torch.empty((sample_rows.shape[0], self.config.vocab_size), dtype=torch.float32, device=device)
        binding = self.session.io_binding()
        for name, tensor in bound.items():
            self._bind(binding, name, tensor)
        if not self.alias_caches and (self._scratch is None or self._scratch[0].shape != kv_caches[0].shape):
            self._scratch = [torch.empty_like(c) for c in kv_caches]
        for i, cache in enumerate(kv_caches):
            if cache.dtype != self.kv_cache_dtype:
                raise ValueError(f"KV cache {i} is {cache.dtype}, the graph takes {self.kv_cache_dtype}")
            self._bind(binding, cache_input(i), cache)
            self._bind(binding, cache_output(i), cache if self.alias_caches else self._scratch[i], output=True)
        self._bind(binding, "logits", logits, output=True)
        self.session.run_with_iobinding(binding)
        if not self.alias_caches:
            start = time.perf_counter()
            for cache, new in zip(kv_caches, self._scratch):
                cache.copy_(new)
            self.last_copy_seconds = time.perf_counter() - start
        return logits
