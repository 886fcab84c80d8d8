"""`ladder compile` on a tiny model: the torch-compile precisions, the artifact's checks, serving it.

fp16 is left to ONNX here: on a CPU its torch-compile artifact takes bf16's path with another dtype, and
each AOTInductor export costs the suite 15-20 s (the default model's fp16 artifact is compiled by
benchmarks/compile_matrix.sh).

The default model's artifacts are compiled in tests/compile/test_compile_default.py; the speed figures come
from the compile command's benchmark stage (benchmarks/RESULTS.md), not from tests.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from engine.backends import load_artifact
from engine.backends.aoti_runtime import PACKAGE, VECTOR_FLAGS, PackagedModel, cpu_vector_flags, package_record
from engine.backends.packed_weights import PACKED, load_packed
from engine.backends.torch_compiled import rebuild
from engine.backends.manifest import FORMAT_VERSION, MANIFEST_NAME, ArtifactError, read_manifest
from compile import parity
from compile.pipeline import CompileOptions, run
from engine.config import GIB, bytes_per_block
from engine.llm import LLM
from engine.sampling_params import SamplingParams

PRECISIONS = ("fp32", "bf16", "int8", "w8a8")
HAS_ONNX = all(importlib.util.find_spec(m) for m in ("onnx", "onnxscript", "onnxruntime"))
# ONNX Runtime's CPU provider has no bf16 kernels; its fp16 runs through casts (see compile/onnx_export.py).
ONNX_PRECISIONS = ("fp32", "fp16", "int8") if HAS_ONNX else ()
BUILDS = [("torch-compile", p) for p in PRECISIONS] + [("onnx", p) for p in ONNX_PRECISIONS]
ALL = list(PRECISIONS) + [f"onnx-{p}" for p in ONNX_PRECISIONS]
# Relative perplexity increase allowed on the built-in text (issue 7).
PPL_BOUND = {"fp32": 1e-4, "fp16": 0.005, "bf16": 0.005, "int8": 0.02, "w8a8": 0.02}
PPL_BOUND |= {f"onnx-{p}": bound for p, bound in PPL_BOUND.items()}


@pytest.fixture(scope="module")
def artifacts(tiny_dir, tmp_path_factory):
    """Every torch-compile precision by name, and the ONNX ones as onnx-<precision>: each a LoadedArtifact
    as `ladder compile` verified it (loaded back from its files), which the serving tests share."""
    from model.loader import load

    root = tmp_path_factory.mktemp("artifacts")
    eager = load(str(tiny_dir), dtype=torch.float32)  # one fp32 eager reference serves the seven builds
    reference = parity.reference(eager.module, *parity.encode_inputs(eager.tokenizer, eager.config.vocab_size))
    built = {}
    for backend, precision in BUILDS:
        name = precision if backend == "torch-compile" else f"onnx-{precision}"
        built[name] = run(CompileOptions(model=str(tiny_dir), backend=backend, precision=precision,
                                         out=root / name, max_model_len=256, max_num_seqs=8, run_bench=False),
                          reference=reference)
    return built


@pytest.mark.parametrize("precision", ALL)
def test_parity_report_within_bounds(artifacts, precision):
    manifest = artifacts[precision].manifest
    report = manifest.parity
    assert report["perplexity_change"] <= PPL_BOUND[precision], report
    assert report["greedy_tokens_compared"] == 4 * 64
    if precision == "fp32":
        assert report["greedy_tokens_equal"] == report["greedy_tokens_compared"], report
        assert report["max_abs_logit_diff"] < 1e-4 and report["teacher_forced_top1_agreement"] == 1.0


def test_a_reference_of_other_inputs_is_refused(tiny_dir, tmp_path):
    other = parity.Reference([[1, 2, 3]], torch.zeros(3, 8), [[4]], [torch.zeros(1, 8)], [5, 6], 1.0)
    with pytest.raises(ValueError, match="other inputs"):
        run(CompileOptions(model=str(tiny_dir), backend="torch-compile", precision="fp32", out=tmp_path / "a",
                           max_model_len=256, max_num_seqs=8, run_bench=False), reference=other)
    assert not (tmp_path / "a").exists()


def test_manifest_records_what_was_built(artifacts):
    out = artifacts["int8"].path
    data = json.loads((out / MANIFEST_NAME).read_text())
    assert data["format_version"] == FORMAT_VERSION
    assert data["backend"] == "torch-compile" and data["precision"] == "int8"
    assert data["shapes"] == {"max_num_seqs": 8, "max_model_len": 256, "block_size": 16, "max_num_batched_tokens": 2048}
    assert len(data["model"]["sha256"]) == 64 and data["libraries"]["torch"] == torch.__version__
    assert data["device"]["type"] == "cpu"
    on_disk = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()} - {MANIFEST_NAME}
    assert set(data["files"]) == on_disk
    assert {"model.safetensors", "config.json", "tokenizer/tokenizer.json", PACKAGE} <= on_disk
    assert data["package"] == package_record() and data["package"]["torch"] == torch.__version__
    # Every linear layer is stored int8 with float32 per-channel scales; the embedding stays float.
    with safe_open(out / "model.safetensors", "pt") as f:
        tensors = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    assert tensors["layers.0.mlp.down_proj.weight"] == "I8" and tensors["lm_head.weight"] == "I8"
    assert tensors["layers.0.self_attn.qkv_proj.scale"] == "F32" and tensors["embed_tokens.weight"] == "F32"
    assert not list(out.parent.glob(".*")), "no staging directory left behind"


def test_w8a8_manifest_records_its_calibration(artifacts):
    out = artifacts["w8a8"].path
    record = read_manifest(out).quantization
    assert record["calibration_tokens"] == 2048 and record["calibration_text"] == "pydoc_data.topics"
    assert len(record["alphas"]) == 2 * 3 + 1 and "lm_head" in record["alphas"]
    assert read_manifest(artifacts["fp32"].path).quantization == {}


def _prompts():
    lengths = (3, 40, 17, 70, 5, 33)
    return [[(7 * i + 3 * n) % 300 + 20 for i in range(n)] for n in lengths]


@pytest.mark.parametrize("precision", ALL)
def test_artifact_batched_with_preemption_equals_one_at_a_time(artifacts, precision):
    loaded = artifacts[precision]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone_llm = LLM(loaded=loaded, kv_cache_memory_gib=0.001)
    alone = [alone_llm.generate([p], params)[0].outputs[0].token_ids for p in _prompts()]
    # A cache of 14 blocks (the longest request needs 6): the batch preempts and recomputes.
    per_block = bytes_per_block(loaded.config, 16, loaded.module.kv_cache_dtype)
    tiny_cache = LLM(loaded=loaded, kv_cache_memory_gib=14 * per_block / GIB, max_model_len=128)
    batched = [r.outputs[0].token_ids for r in tiny_cache.generate(_prompts(), params)]
    assert tiny_cache.engine.stats.num_preemptions > 0
    assert batched == alone


def test_llm_serves_artifact_text(artifacts):
    llm = LLM(artifact=str(artifacts["fp32"].path))  # by its path, as a user names one: checked and loaded
    result = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert len(result.outputs[0].token_ids) == 8 and isinstance(result.outputs[0].text, str)
    assert llm.engine.max_model_len == 256
    with pytest.raises(ValueError, match="exceeds the 256 tokens"):
        LLM(loaded=artifacts["fp32"], max_model_len=512)
    # Its graph takes the float32 cache it was compiled for: another --kv-cache-dtype is refused, its own taken.
    with pytest.raises(ValueError, match="graph takes a float32 KV cache, fixed when it was compiled"):
        LLM(loaded=artifacts["fp32"], kv_cache_dtype="bfloat16")
    assert LLM(loaded=artifacts["fp32"], kv_cache_dtype="float32").engine.runner.kv_caches[0].dtype == torch.float32


@pytest.fixture
def copy_of(artifacts, tmp_path):
    def make(precision: str = "fp32"):
        target = tmp_path / f"copy-{precision}"
        shutil.copytree(artifacts[precision].path, target)
        return target
    return make


def test_changed_byte_is_refused(copy_of):
    art = copy_of()
    weights = art / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="sha256 does not match"):
        load_artifact(art)


def test_missing_file_is_refused(copy_of):
    art = copy_of()
    (art / "tokenizer" / "tokenizer.json").unlink()
    with pytest.raises(ArtifactError, match="missing"):
        load_artifact(art)


def test_newer_format_is_refused(copy_of):
    art = copy_of()
    data = json.loads((art / MANIFEST_NAME).read_text())
    data["format_version"] = FORMAT_VERSION + 1
    (art / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="newer than this ladder reads"):
        load_artifact(art)


def test_wrong_device_is_refused(copy_of):
    art = copy_of()
    data = json.loads((art / MANIFEST_NAME).read_text())
    data["device"] = {"type": "cuda", "name": "NVIDIA H200", "capability": [9, 0]}
    (art / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="built for cuda"):
        load_artifact(art, "cpu")


def test_cpu_artifacts_serve_their_compiled_step(artifacts):
    # Every CPU torch-compile precision runs the AOTInductor package written beside its weights (the
    # parity test above checks what it computes, the preemption test how it batches).
    for precision in PRECISIONS:
        assert isinstance(artifacts[precision].module, PackagedModel), precision
        assert artifacts[precision].manifest.files[PACKAGE]["bytes"] > 0
        assert (PACKED in artifacts[precision].manifest.files) == (precision in ("int8", "w8a8"))


def test_stored_packing_is_what_packing_gives_and_is_ignored_from_other_kernel_code(copy_of):
    art = copy_of("w8a8")
    module = rebuild(art, "w8a8", 16, torch.device("cpu"))  # from packed.safetensors
    stored = {name: t.clone() for name, t in module.named_buffers() if name.endswith((".packed", ".wsum"))}
    for sub in module.modules():
        if hasattr(sub, "wsum"):
            sub.pack()
    assert stored and all(torch.equal(t, module.get_buffer(name)) for name, t in stored.items())
    from safetensors.torch import load_file, save_file

    save_file(load_file(art / PACKED), str(art / PACKED), metadata={"layout": "from other kernel code"})
    assert not load_packed(module, art)


def test_changed_compiled_step_is_refused(copy_of):
    art = copy_of("w8a8")
    package = art / PACKAGE
    data = bytearray(package.read_bytes())
    data[len(data) // 3] ^= 0x01
    package.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=f"{PACKAGE}: sha256 does not match"):
        load_artifact(art)


def _edit_package_record(art, **changes):
    data = json.loads((art / MANIFEST_NAME).read_text())
    data["package"] |= changes
    (art / MANIFEST_NAME).write_text(json.dumps(data))


def test_compiled_step_of_another_torch_or_cpu_is_refused(copy_of):
    art = copy_of()
    _edit_package_record(art, torch="2.0.0+cpu")
    with pytest.raises(ArtifactError, match="built with torch 2.0.0") as refused:
        load_artifact(art)
    assert "\n" not in str(refused.value)
    lacking = [flag for flag in VECTOR_FLAGS if flag not in cpu_vector_flags()][0]
    _edit_package_record(art, torch=torch.__version__, cpu_flags=[*cpu_vector_flags(), lacking])
    with pytest.raises(ArtifactError, match=f"CPU lacks {lacking}: recompile"):
        load_artifact(art)
    data = json.loads((art / MANIFEST_NAME).read_text())
    del data["files"][PACKAGE]  # a package without a checksum is never loaded
    (art / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="has no sha256"):
        load_artifact(art)


def test_artifact_without_compiled_step_compiles_at_start(artifacts, copy_of):
    # A format 1 artifact (written before packages) still loads: its step is compiled with torch.compile,
    # the path CUDA artifacts take, and it gives the package's tokens.
    art = copy_of()
    (art / PACKAGE).unlink()
    data = json.loads((art / MANIFEST_NAME).read_text())
    del data["package"], data["files"][PACKAGE]
    data["format_version"] = 1
    (art / MANIFEST_NAME).write_text(json.dumps(data))
    old = load_artifact(art)
    assert not isinstance(old.module, PackagedModel)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = _prompts()[:3]
    expected = [r.outputs[0].token_ids for r in LLM(loaded=artifacts["fp32"]).generate(prompts, params)]
    assert [r.outputs[0].token_ids for r in LLM(loaded=old).generate(prompts, params)] == expected


def test_not_an_artifact_is_refused(tiny_dir):
    with pytest.raises(ArtifactError, match="not an artifact directory"):
        load_artifact(tiny_dir)


def _ladder(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ladder.cli", *args], capture_output=True, text=True, timeout=120)


def test_cli_refusals_are_one_line(tmp_path, tiny_dir, artifacts):
    if not torch.cuda.is_available():
        result = _ladder("compile", "--model", str(tiny_dir), "--backend", "tensorrt", "--out", str(tmp_path / "t"))
        assert result.returncode == 1 and "needs an NVIDIA GPU" in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "t").exists()
    existing = artifacts["fp32"].path
    result = _ladder("compile", "--model", str(tiny_dir), "--backend", "torch-compile", "--out", str(existing))
    assert result.returncode == 1 and "already exists" in result.stderr
    result = _ladder("compile", "--model", str(tiny_dir), "--backend", "onnx", "--precision", "w8a8",
                     "--out", str(tmp_path / "w"))
    assert result.returncode == 1 and "w8a8 is built for --backend torch-compile" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "w").exists()
    result = _ladder("serve", "--artifact", str(tmp_path / "nothing"), "--port", "0")
    assert result.returncode == 1 and "no such artifact directory" in result.stderr


def test_serve_artifact_over_http(artifacts, tmp_path):
    import httpx

    from server_process import LadderServer

    out = artifacts["int8"].path
    server = LadderServer("--artifact", str(out), "--served-model-name", "tiny-int8", log=tmp_path / "serve.log")
    try:
        models = httpx.get(server.url + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["tiny-int8"]
        body = {"model": "tiny-int8", "prompt": "Hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        first = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        again = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        assert first["usage"]["completion_tokens"] == 6
        assert first["choices"][0]["text"] == again["choices"][0]["text"]
        # The same artifact offline gives the same text.
        offline = LLM(loaded=artifacts["int8"]).generate("Hello", SamplingParams(temperature=0, max_tokens=6,
                                                                          ignore_eos=True))[0]
        assert offline.outputs[0].text == first["choices"][0]["text"]
    finally:
        server.stop()


def test_a_context_past_a_position_rule_is_refused_before_compiling():
    """An artifact's step has one rotation and no query temperature: Ministral 3's attention temperature and
    Phi's LongRoPE long factors begin past their original context, so a longer --max-model-len is refused."""
    from compile.pipeline import check_position_rules
    from model.config import ModelConfig
    from tiny_models import ministral3_config

    ministral = ModelConfig.from_hf(ministral3_config().to_dict())
    check_position_rules(ministral, 32)
    with pytest.raises(ValueError, match="--max-model-len 64: past 32 tokens this model takes Llama 4's attention"):
        check_position_rules(ministral, 64)
    longrope = ministral.replace(attention_temperature_beta=None, rope_original_max_position_embeddings=16)
    with pytest.raises(ValueError, match="past 16 tokens this model takes LongRoPE's long factors"):
        check_position_rules(longrope, 32)
