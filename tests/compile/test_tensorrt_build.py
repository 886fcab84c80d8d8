"""compile/tensorrt_build.py against the TensorRT generations it must build with, without TensorRT: fake
`tensorrt` modules with the attributes each generation has (8.x builder flags only; 10.x both; 11.x strongly
typed only) show which path the builder takes, and ONNX Runtime checks the cast graph it parses."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from compile import tensorrt_build
from compile.tensorrt_build import BUILDER_FLAGS, CAST_FILE, STRONGLY_TYPED, build_engine, cast_matmuls
from engine.backends.onnx_runtime import MODEL_FILE
from engine.backends.tensorrt_runtime import ENGINE_FILE
from model.config import ModelConfig

CONFIG = ModelConfig.from_dict(dict(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5,
                                    rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=True))
OPTIONS = dict(max_num_seqs=2, max_model_len=32, block_size=16, max_num_batched_tokens=16)


def write_graph(path, with_dq: bool) -> None:
    """x [N, 4] -> Gemm(x, W^T, b) [N, 3] -> MatMul with a constant weight [3, 5] (int8 behind a
    DequantizeLinear when `with_dq`); W also feeds a Gather (a tied embedding), which must stay fp32."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((3, 4)).astype(np.float32)
    second = rng.standard_normal((3, 5)).astype(np.float32)
    inits = [numpy_helper.from_array(weight, "W"), numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), "b")]
    nodes = [helper.make_node("Gemm", ["x", "W", "b"], ["h"], name="gemm", transB=1),
             helper.make_node("Gather", ["W", "ids"], ["rows"], name="gather", axis=0)]
    if with_dq:
        scale = np.abs(second).max(axis=0) / 127
        inits += [numpy_helper.from_array(np.round(second / scale).astype(np.int8), "W2.int8"),
                  numpy_helper.from_array(scale.astype(np.float32), "W2.scale")]
        nodes.append(helper.make_node("DequantizeLinear", ["W2.int8", "W2.scale"], ["W2"], name="dq", axis=1))
    else:
        inits.append(numpy_helper.from_array(second, "W2"))
    nodes.append(helper.make_node("MatMul", ["h", "W2"], ["y"], name="matmul"))
    graph = helper.make_graph(nodes, "step", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]),
                                              helper.make_tensor_value_info("ids", TensorProto.INT64, ["M"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5]),
                               helper.make_tensor_value_info("rows", TensorProto.FLOAT, ["M", 4])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))


def run_graph(path) -> list[np.ndarray]:
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32), "ids": np.array([0, 2])}
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.mark.parametrize("with_dq", [False, True], ids=["float weights", "int8 weights"])
def test_cast_matmuls_runs_the_matmuls_in_fp16_and_keeps_the_boundary_fp32(tmp_path, with_dq):
    source, target = tmp_path / "model.onnx", tmp_path / "cast.onnx"
    write_graph(source, with_dq)
    assert cast_matmuls(source, target, "fp16") == 2
    onnx.checker.check_model(str(target), full_check=True)
    model = onnx.load(str(target))
    casts = [n for n in model.graph.node if n.op_type == "Cast"]
    # Gemm: x, W, b in and the result out; MatMul: h in, the weight (unless its dequantize scale is cast), out.
    assert len(casts) == 4 + (2 if with_dq else 3)
    inits = {i.name: i for i in model.graph.initializer}
    assert inits["W"].data_type == TensorProto.FLOAT  # the Gather still reads it in fp32
    if with_dq:
        assert inits["W2.scale"].data_type == TensorProto.FLOAT16
        assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) >= 19
    expected, got = run_graph(source), run_graph(target)
    assert [g.dtype for g in got] == [np.float32, np.float32]
    np.testing.assert_allclose(got[0], expected[0], rtol=2e-2, atol=2e-2)
    np.testing.assert_array_equal(got[1], expected[1])


def test_cast_matmuls_to_bf16_gives_a_valid_graph(tmp_path):
    write_graph(tmp_path / "model.onnx", with_dq=False)
    cast_matmuls(tmp_path / "model.onnx", tmp_path / "cast.onnx", "bf16")
    onnx.checker.check_model(str(tmp_path / "cast.onnx"), full_check=True)
    to = {helper.get_attribute_value(a) for n in onnx.load(str(tmp_path / "cast.onnx")).graph.node
          if n.op_type == "Cast" for a in n.attribute}
    assert to == {TensorProto.BFLOAT16, TensorProto.FLOAT}


# --- which path the builder takes ------------------------------------------------------------------------


def fake_tensorrt(creation_flags: dict[str, int], builder_flags: tuple[str, ...]):
    """A `tensorrt` with only the attributes a generation has; `calls` records what the build did."""
    calls = SimpleNamespace(network_flags=None, parsed=None, parsed_casts=None, set_flags=[])

    class Builder:
        def __init__(self, logger):
            pass

        def create_network(self, flags):
            calls.network_flags = flags
            return object()

        def create_builder_config(self):
            return SimpleNamespace(set_flag=calls.set_flags.append, add_optimization_profile=lambda p: None)

        def create_optimization_profile(self):
            return SimpleNamespace(set_shape=lambda name, low, opt, high: None)

        def build_serialized_network(self, network, config):
            return b"engine"

    class OnnxParser:
        num_errors = 0

        def __init__(self, network, logger):
            pass

        def parse_from_file(self, path):
            calls.parsed = path
            calls.parsed_casts = sum(n.op_type == "Cast" for n in onnx.load(path).graph.node)
            return True

    module = SimpleNamespace(Logger=SimpleNamespace(WARNING=2), Builder=Builder, OnnxParser=OnnxParser,
                             NetworkDefinitionCreationFlag=SimpleNamespace(**creation_flags),
                             BuilderFlag=SimpleNamespace(**{name: name for name in builder_flags}))
    module.Logger = type("Logger", (), {"WARNING": 2, "__init__": lambda self, level: None})
    return module, calls


TENSORRT_8 = ({"EXPLICIT_BATCH": 0}, ("FP16", "INT8", "TF32"))
TENSORRT_10 = ({"EXPLICIT_BATCH": 0, "STRONGLY_TYPED": 1}, ("FP16", "BF16", "INT8", "TF32"))
TENSORRT_11 = ({"STRONGLY_TYPED": 0}, ("TF32",))


@pytest.mark.parametrize("generation, mode", [(TENSORRT_8, BUILDER_FLAGS), (TENSORRT_10, STRONGLY_TYPED),
                                              (TENSORRT_11, STRONGLY_TYPED)], ids=["8.x", "10.x", "11.x"])
def test_precision_mode_prefers_strong_typing_where_it_exists(generation, mode):
    assert tensorrt_build.precision_mode(fake_tensorrt(*generation)[0]) == mode


def test_a_tensorrt_with_neither_is_refused():
    with pytest.raises(ValueError, match="neither strongly typed networks nor precision builder flags"):
        tensorrt_build.precision_mode(fake_tensorrt({}, ())[0])


@pytest.mark.parametrize("generation, strongly_typed_bit", [(TENSORRT_10, 1), (TENSORRT_11, 0)], ids=["10.x", "11.x"])
@pytest.mark.parametrize("precision", ["fp16", "bf16", "int8"])
def test_strongly_typed_builds_parse_the_cast_graph_and_set_no_precision_flag(tmp_path, monkeypatch, generation,
                                                                           strongly_typed_bit, precision):
    module, calls = fake_tensorrt(*generation)
    monkeypatch.setitem(sys.modules, "tensorrt", module)
    write_graph(tmp_path / MODEL_FILE, with_dq=precision == "int8")
    assert build_engine(tmp_path, SimpleNamespace(precision=precision, **OPTIONS), CONFIG) == [ENGINE_FILE]
    assert calls.network_flags == 1 << strongly_typed_bit and calls.set_flags == []
    assert calls.parsed == str(tmp_path / CAST_FILE) and calls.parsed_casts > 0
    assert (tmp_path / ENGINE_FILE).read_bytes() == b"engine"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([MODEL_FILE, ENGINE_FILE])  # cast graph removed


def test_strongly_typed_fp32_parses_the_export_as_it_is(tmp_path, monkeypatch):
    module, calls = fake_tensorrt(*TENSORRT_11)
    monkeypatch.setitem(sys.modules, "tensorrt", module)
    write_graph(tmp_path / MODEL_FILE, with_dq=False)
    build_engine(tmp_path, SimpleNamespace(precision="fp32", **OPTIONS), CONFIG)
    assert calls.parsed == str(tmp_path / MODEL_FILE) and calls.parsed_casts == 0 and calls.set_flags == []


@pytest.mark.parametrize("precision, flags", [("fp16", ["FP16"]), ("int8", ["FP16", "INT8"]), ("fp32", [])])
def test_builder_flags_on_a_tensorrt_without_strong_typing(tmp_path, monkeypatch, precision, flags):
    module, calls = fake_tensorrt(*TENSORRT_8)
    monkeypatch.setitem(sys.modules, "tensorrt", module)
    write_graph(tmp_path / MODEL_FILE, with_dq=precision == "int8")
    build_engine(tmp_path, SimpleNamespace(precision=precision, **OPTIONS), CONFIG)
    assert calls.network_flags == 1 << 0  # explicit batch, which the 8.x ONNX parser needs
    assert calls.set_flags == flags and calls.parsed == str(tmp_path / MODEL_FILE)


def test_a_flag_the_tensorrt_lacks_is_a_clear_error(tmp_path, monkeypatch):
    module, _ = fake_tensorrt(*TENSORRT_8)  # 8.x has no BF16 flag
    monkeypatch.setitem(sys.modules, "tensorrt", module)
    write_graph(tmp_path / MODEL_FILE, with_dq=False)
    with pytest.raises(ValueError, match="no BF16 builder flag"):
        build_engine(tmp_path, SimpleNamespace(precision="bf16", **OPTIONS), CONFIG)
