"""Rewrites of an exported ONNX step, file to file: MatMul for Gemm, INT8 weights (MatMulNBits for ONNX
Runtime, Q/DQ for TensorRT), and ONNX Runtime's offline optimisation. Weights live in one external
data file beside each graph.
"""

from __future__ import annotations

from pathlib import Path

INT8_BLOCK = 32  # weights per int8 scale along K (MatMulNBits)


def gemm_to_matmul(path: Path) -> None:
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
    save_with_nodes(model, nodes, path)


def quantize_int8(source: Path, target: Path) -> Path:
    """INT8 weights and activations through `onnxruntime.quantization`: every MatMul with a constant weight
    becomes MatMulNBits with 8-bit symmetric weights in blocks of INT8_BLOCK along K, run at accuracy
    level 4 (activations quantized to int8 per block on the fly, integer dot products).

    Not `quantize_dynamic`: its one uint8 scale per activation tensor cost SmolLM2-135M +10.7% perplexity
    on the built-in text (+14.6% on its first 1,024 tokens; +5.6% with the LM head and down projections
    left in fp32), against +0.8% for this."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    gemm_to_matmul(source)  # the quantizer takes MatMul only; the exporter writes nn.Linear as Gemm
    quantizer = MatMulNBitsQuantizer(onnx.load(str(source)), bits=8, block_size=INT8_BLOCK, is_symmetric=True,
                                     accuracy_level=4)
    quantizer.process()
    save(quantizer.model.model, target)
    return target


def weight_qdq(path: Path) -> None:
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
    save_with_nodes(model, nodes, path)


def save_with_nodes(model, nodes: list, path: Path) -> None:
    """Give `model`'s graph the node list `nodes`, drop the initializers nothing reads any more, save."""
    graph = model.graph
    del graph.node[:]
    graph.node.extend(nodes)
    used = {i for n in graph.node for i in n.input}
    kept = [init for init in graph.initializer if init.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    save(model, path)


def save(model, path: Path) -> None:
    import onnx

    data = path.name + ".data"
    (path.parent / data).unlink(missing_ok=True)
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data,
                    size_threshold=1024)


def optimize(source: Path, target: Path) -> None:
    """ONNX Runtime's offline graph optimisation (extended level: portable across CPUs) of `source`."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(target)
    options.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                     target.name + ".data")
    options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])
