"""The ONNX backend: export of one engine step with its paged KV cache, run in ONNX Runtime, against eager."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("onnx")
pytest.importorskip("onnxscript")
pytest.importorskip("onnxruntime")

import onnx
from tiny_models import make_hf_model

import model
from compile import onnx_export
from engine.backends import onnx_runtime
from compile.onnx_export import export_onnx
from engine.backends.onnx_runtime import OnnxModel
from model.attention_metadata import AttentionMetadata

NUM_BLOCKS = 12
TABLES = [[3, 7, 1], [5, 2, 9], [10, 0, 4]]
# New tokens per sequence and step, and whether the step samples that sequence. Step 0: two prefills
# and the first chunk of a third prompt (not sampled); then decodes beside the prompt's second chunk,
# crossing block boundaries (16) on the way.
STEPS = [
    [(14, True), (15, True), (10, False)],
    [(1, True), (1, True), (8, True)],
    [(1, True), (1, True), (1, True)],
    [(1, True), (1, True), (1, True)],
    [(1, True), (1, True), (1, True)],
]


def step_batches(vocab_size: int, block_size: int, seed: int = 0):
    """(metadata, input_ids, positions, sample_rows) of each step of STEPS."""
    gen = torch.Generator().manual_seed(seed)
    lens = [0] * len(TABLES)
    for step in STEPS:
        query_lens, seq_lens, ids, positions, rows = [], [], [], [], []
        for s, (q, sampled) in enumerate(step):
            ids += torch.randint(0, vocab_size, (q,), generator=gen).tolist()
            positions += range(lens[s], lens[s] + q)
            lens[s] += q
            query_lens.append(q)
            seq_lens.append(lens[s])
            if sampled:
                rows.append(len(ids) - 1)
        meta = AttentionMetadata.build(query_lens, seq_lens, TABLES, block_size)
        yield meta, torch.tensor(ids), torch.tensor(positions), torch.tensor(rows, dtype=torch.long)


def run_both(eager, onnx_model, kv_dtype=torch.float32):
    """Run every step in eager and in ONNX Runtime; yield (onnx logits, eager logits, onnx caches, eager caches)."""
    ref_caches = eager.allocate_kv_caches(NUM_BLOCKS)
    caches = onnx_model.allocate_kv_caches(NUM_BLOCKS)
    assert caches[0].dtype == kv_dtype
    for meta, ids, positions, rows in step_batches(eager.config.vocab_size, eager.block_size):
        with torch.inference_mode():
            ref = eager.sample_logits(ids, positions, ref_caches, eager.attention.plan(meta), rows)
        got = onnx_model.sample_logits(ids, positions, caches, onnx_model.attention.plan(meta), rows)
        assert got.dtype == torch.float32 and got.shape == ref.shape
        yield got, ref, caches, ref_caches


@pytest.fixture(scope="module", params=["llama3", "qwen2"])
def tiny(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    make_hf_model(request.param, directory)
    return model.load(directory).module


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama3-only")
    make_hf_model("llama3", directory)
    return model.load(directory).module


@pytest.fixture(scope="module")
def fp32_artifact(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("onnx-fp32")
    files = export_onnx(tiny, out, "fp32")
    return out, files


def test_fp32_export_files_and_checker(tiny, fp32_artifact):
    out, files = fp32_artifact
    assert files == ["model.onnx", "model.onnx.data"]
    assert sorted(p.name for p in out.iterdir()) == sorted(files)  # nothing else left behind
    onnx.checker.check_model(str(out / "model.onnx"))
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
    layers = tiny.config.num_layers
    assert [i.name for i in graph.input] == [*onnx_runtime.STEP_INPUTS, *(f"kv_cache.{i}" for i in range(layers))]
    assert [o.name for o in graph.output] == ["logits", *(f"kv_cache_out.{i}" for i in range(layers))]
    # Batch-dependent dims are symbolic; the cache's block count is one symbol shared by every layer.
    for tensor in (*graph.input, *graph.output):
        dims = tensor.type.tensor_type.shape.dim
        if tensor.name.startswith("kv_cache"):
            assert [d.dim_value for d in dims[2:]] == [tiny.block_size, 2, tiny.config.head_dim]
            assert dims[1].dim_param == graph.input[len(onnx_runtime.STEP_INPUTS)].type.tensor_type.shape.dim[1].dim_param
        elif tensor.name == "logits":
            assert dims[0].dim_param and dims[1].dim_value == tiny.config.vocab_size
        else:
            assert dims[0].dim_param, tensor.name
    # The cache update is a ScatterND from the input cache straight to the output.
    producers = {out_name: node for node in graph.node for out_name in node.output}
    assert producers["kv_cache_out.0"].op_type == "ScatterND"
    assert producers["kv_cache_out.0"].input[0] == "kv_cache.0"


def test_export_leaves_module_unchanged(tiny, fp32_artifact):
    attention = tiny.attention
    assert all(layer.self_attn.backend is attention for layer in tiny.layers)
    assert not isinstance(attention, onnx_export.ExportPagedAttention)
    assert tiny.layers[0].self_attn.ops is tiny.ops


@pytest.mark.parametrize("alias_caches", [True, False], ids=["caches-aliased", "caches-copied"])
def test_fp32_artifact_matches_eager(tiny, fp32_artifact, alias_caches):
    out, _ = fp32_artifact
    onnx_model = OnnxModel.load(out, tiny.config, tiny.block_size, torch.float32, num_threads=1,
                                alias_caches=alias_caches)
    for got, ref, caches, ref_caches in run_both(tiny, onnx_model):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
        for cache, ref_cache in zip(caches, ref_caches, strict=True):
            torch.testing.assert_close(cache, ref_cache, atol=1e-5, rtol=1e-5)


def test_prefill_only_step_and_single_decode(tiny, fp32_artifact):
    """B = 0 (a prompt chunk, nothing sampled) and T = S = B = 1."""
    out, _ = fp32_artifact
    onnx_model = OnnxModel.load(out, tiny.config, tiny.block_size, torch.float32, num_threads=1)
    ref_caches, caches = tiny.allocate_kv_caches(4), onnx_model.allocate_kv_caches(4)
    for q_len, seq_len, rows in ((7, 7, []), (1, 8, [0])):
        meta = AttentionMetadata.build([q_len], [seq_len], [[2]], tiny.block_size)
        ids, positions = torch.arange(q_len) + 3, torch.arange(seq_len - q_len, seq_len)
        rows = torch.tensor(rows, dtype=torch.long)
        with torch.inference_mode():
            ref = tiny.sample_logits(ids, positions, ref_caches, tiny.attention.plan(meta), rows)
        got = onnx_model.sample_logits(ids, positions, caches, onnx_model.attention.plan(meta), rows)
        assert got.shape == ref.shape == (len(rows), tiny.config.vocab_size)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
        for cache, ref_cache in zip(caches, ref_caches, strict=True):
            torch.testing.assert_close(cache, ref_cache, atol=1e-5, rtol=1e-5)


def test_load_refuses_a_mismatched_cache(tiny, fp32_artifact):
    out, _ = fp32_artifact
    with pytest.raises(ValueError, match="KV cache"):
        OnnxModel.load(out, tiny.config, tiny.block_size, torch.float16)
    with pytest.raises(ValueError, match="shape"):
        OnnxModel.load(out, tiny.config, tiny.block_size * 2, torch.float32)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("precision, kv_dtype, tolerance", [("int8", torch.float32, 0.15),
                                                            ("fp16", torch.float16, 0.01)])
def test_reduced_precision_stays_close(tiny_llama, tmp_path, precision, kv_dtype, tolerance):
    """Against fp32 eager, exporting the fp32 module as `ladder compile` does (int8 quantizes the graph)."""
    files = export_onnx(tiny_llama, tmp_path, precision)
    onnx.checker.check_model(str(tmp_path / files[0]))
    onnx_model = OnnxModel.load(tmp_path, tiny_llama.config, tiny_llama.block_size, kv_dtype, num_threads=1)
    for got, ref, caches, ref_caches in run_both(tiny_llama, onnx_model, kv_dtype):
        assert torch.isfinite(got).all()
        assert relative_error(got, ref) < tolerance
        for cache, ref_cache in zip(caches, ref_caches, strict=True):
            assert relative_error(cache.float(), ref_cache) < tolerance
        # A different best token only where eager's own margin is within the measured error (a near tie
        # on this random model's flat logits).
        error = (got - ref).abs().max(dim=-1).values
        chosen = ref.gather(-1, got.argmax(-1, keepdim=True)).squeeze(-1)
        assert (ref.max(dim=-1).values - chosen <= 2 * error).all()


def test_unsupported_precisions_are_refused(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="bf16"):
        export_onnx(tiny_llama, tmp_path, "bf16")
    with pytest.raises(ValueError, match="unknown precision"):
        export_onnx(tiny_llama, tmp_path, "int4")
    with pytest.raises(ValueError, match="bf16"):
        onnx_export.check_available("bf16", "cpu")
    onnx_export.check_available("int8", "cpu")


@pytest.mark.parametrize("precision, tolerance", [("fp32", 1e-4), ("int8", 0.15)])
def test_tensorrt_graph_runs_in_onnx_runtime(tiny_llama, tmp_path, precision, tolerance):
    """The graph TensorRT is built from (fp32 step; int8 weights as DequantizeLinear per output channel),
    checked here by ONNX Runtime against eager, since TensorRT itself needs a GPU."""
    files = onnx_export.export_for_tensorrt(tiny_llama, tmp_path, precision)
    graph = onnx.load(str(tmp_path / files[0]), load_external_data=False).graph
    dequantized = [n for n in graph.node if n.op_type == "DequantizeLinear"]
    linears = 4 * tiny_llama.config.num_layers + 1  # qkv, o, gate_up, down per layer, and the LM head
    assert len(dequantized) == (linears if precision == "int8" else 0)
    onnx_model = OnnxModel.load(tmp_path, tiny_llama.config, tiny_llama.block_size, torch.float32, num_threads=1)
    for got, ref, caches, ref_caches in run_both(tiny_llama, onnx_model):
        assert relative_error(got, ref) < tolerance
        for cache, ref_cache in zip(caches, ref_caches, strict=True):
            assert relative_error(cache, ref_cache) < tolerance
