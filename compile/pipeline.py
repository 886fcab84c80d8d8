"""`ladder compile`: load, reference, quantize, export, build, verify, benchmark, write.

The fp32 eager model's outputs on the parity inputs are taken before the precision change. Verification
and the benchmark then load the artifact back from the files just written, exactly as
`ladder serve --artifact` will, so the report describes the artifact and not the module that produced
it. The benchmark runs a fresh fp32 eager model beside the artifact, their decode steps interleaved.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from compile import parity, speed
from compile.manifest import describe_device, file_entries, library_versions, sha256_source, write_artifact
from engine.backends.artifact import TOKENIZER_DIR, LoadedArtifact, load_backend, loaded_artifact
from engine.backends.manifest import BACKENDS, ArtifactError, Manifest
from model.config import ModelConfig
from model.loader import load
from model.precision import COMPILE_PRECISIONS
from model.quantization import apply_precision


@dataclass(frozen=True)
class CompileOptions:
    model: str | None
    backend: str
    precision: str
    out: Path
    device: str = "cpu"
    max_num_seqs: int = 32
    max_model_len: int = 2048
    block_size: int = 16
    max_num_batched_tokens: int = 2048  # tokens per step the artifact serves (TensorRT builds for it)
    bench_batch: int = 32
    run_bench: bool = True


@dataclass
class StageLog:
    """Prints each stage as it starts and ends; keeps the timings for the summary."""

    write: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)
    seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def stage(self, name: str, what: str) -> Iterator[None]:
        self.write(f"[{name}] {what}")
        start = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - start
        self.write(f"[{name}] done in {self.seconds[name]:.1f} s")


def check_position_rules(config: ModelConfig, max_model_len: int) -> None:
    """An artifact's step is compiled with one rotation and no query temperature: ValueError (one line) for a
    context past where LongRoPE's long factors or Llama 4's attention temperature begin."""
    for begins, what in ((config.rope_original_max_position_embeddings, "LongRoPE's long factors"),
                         (config.attention_temperature_length if config.attention_temperature_beta else None,
                          "Llama 4's attention temperature")):
        if begins is not None and max_model_len > begins:
            raise ValueError(f"--max-model-len {max_model_len}: past {begins} tokens this model takes {what}, which "
                             f"a compiled artifact does not; use {begins} or less")


def check_options(options: CompileOptions) -> None:
    """Everything that can be refused before any work is done, with a one-line reason."""
    if options.backend not in BACKENDS:
        raise ValueError(f"unknown backend {options.backend!r} (choose from {', '.join(BACKENDS)})")
    if options.precision not in COMPILE_PRECISIONS:
        raise ValueError(f"unknown precision {options.precision!r} (choose from {', '.join(COMPILE_PRECISIONS)})")
    if Path(options.out).exists():
        raise ValueError(f"{options.out}: already exists; choose another --out or remove it")
    if min(options.max_num_seqs, options.max_model_len, options.block_size, options.bench_batch,
           options.max_num_batched_tokens) < 1:
        raise ValueError("--max-num-seqs, --max-model-len, --block-size, --max-num-batched-tokens and "
                         "--bench-batch must be positive")
    device = torch.device(options.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available here")
    if options.precision == "w8a8" and (options.backend != "torch-compile" or device.type != "cpu"):
        raise ValueError("--precision w8a8 is built for --backend torch-compile on --device cpu only; "
                         "use --precision int8 (weight-only) elsewhere")
    if options.backend == "onnx":
        from compile.onnx_export import check_available

        check_available(options.precision, device)
    if options.backend == "tensorrt":
        from compile.tensorrt_build import check_available

        check_available(options.precision, device)


def quantize(module, options: CompileOptions, tokenizer) -> tuple[Any, dict[str, Any]]:
    """The module in the artifact's precision, and what the manifest records of how. ONNX INT8 keeps the
    fp32 module (the ONNX quantizer works on the exported graph; quantizing twice would add both errors);
    TensorRT always takes fp32 (its builder chooses 16-bit kernels from flags, INT8 weights come as Q/DQ
    in the graph). W8A8 is smoothed first on calibration text (model/smoothquant.py)."""
    if options.backend == "tensorrt" or (options.backend == "onnx" and options.precision == "int8"):
        return module, {}
    record: dict[str, Any] = {}
    if options.precision == "w8a8":
        from model import smoothquant as smooth

        calibration = smooth.calibration_ids(tokenizer, module.config.vocab_size)
        record = {"method": "smoothquant, per-token int8 activations, per-channel int8 weights",
                  "calibration_tokens": len(calibration),
                  "calibration_text": "pydoc_data.topics" if tokenizer is not None else "pseudo-random ids",
                  "alphas": smooth.smooth(module, calibration)}
    return apply_precision(module, options.precision), record


def export(module, options: CompileOptions, directory: Path) -> list[str]:
    """The backend's files for the (already precision-changed) module, written into `directory`."""
    if options.backend == "torch-compile":
        files = save_weights(module, directory)
        if torch.device(options.device).type == "cpu":
            files += compile_package(options, directory)
        return files
    from compile import onnx_export

    if options.backend == "onnx":
        return onnx_export.export_onnx(module, directory, options.precision)
    from compile import tensorrt_build

    files = onnx_export.export_for_tensorrt(module, directory, options.precision)
    return files + tensorrt_build.build_engine(directory, options, module.config)


def save_weights(module, directory: Path) -> list[str]:
    """The torch-compile artifact's files: the weights after the precision change, and the config
    (`engine/backends/torch_compiled.py` rebuilds the module from them)."""
    from safetensors.torch import save_file

    from engine.backends.torch_compiled import CONFIG, WEIGHTS

    state = {name: t.contiguous() for name, t in module.state_dict().items()}
    if module.lm_head.weight is module.embed_tokens.weight:
        del state["lm_head.weight"]  # the embedding itself; safetensors stores no aliases
    save_file(state, str(directory / WEIGHTS), metadata={"format": "pt"})
    (directory / CONFIG).write_text(json.dumps(module.config.to_dict(), indent=1), encoding="utf-8")
    return [WEIGHTS, CONFIG]


def compile_package(options: CompileOptions, directory: Path) -> list[str]:
    """The step compiled ahead of time (AOTInductor) over the module rebuilt from the weights just saved,
    exactly as `ladder serve --artifact` rebuilds it (compile/aoti_export.py), and the int8 kernels' packed
    weights (engine/backends/packed_weights.py)."""
    from compile.aoti_export import export_package
    from engine.backends.packed_weights import save_packed
    from engine.backends.torch_compiled import rebuild
    from model.quantization import activation_dtype

    device = torch.device(options.device)
    module = rebuild(directory, options.precision, options.block_size, device)
    packed = save_packed(module, directory)  # int8 layouts, so serving does not pack them again
    return packed + export_package(module, directory, activation_dtype(options.precision, device))


def package_record(options: CompileOptions) -> dict[str, Any]:
    if options.backend != "torch-compile" or torch.device(options.device).type != "cpu":
        return {}
    from engine.backends.aoti_runtime import package_record as record

    return record()


def backend_options(options: CompileOptions) -> dict[str, Any]:
    if options.backend == "torch-compile":
        from engine.backends.torch_compiled import compile_options

        return compile_options(torch.device(options.device))
    return {}


def run(options: CompileOptions, log: StageLog | None = None,
        reference: parity.Reference | None = None) -> LoadedArtifact:
    """Compile, verify and write the artifact; returns it as verified: loaded back from its files (and,
    for torch-compile, compiled), ready to serve (`LLM(loaded=...)`).

    `reference`: fp32 eager's outputs on this model's parity inputs, when the caller already has them
    (several artifacts of one model verified against one reference); refused if its inputs differ."""
    log = log or StageLog()
    check_options(options)
    device = torch.device(options.device)
    with log.stage("load", f"{options.model or 'the default model'} in fp32 on {device}"):
        loaded = load(options.model, dtype=torch.float32, device=device, block_size=options.block_size)
        eager = loaded.module
        loaded.config.require_alike_layers("ladder compile")
        check_position_rules(loaded.config, options.max_model_len)
        source_sha = sha256_source(loaded.path)
    with log.stage("reference", "fp32 eager outputs on the parity inputs" + (" (given)" if reference else "")):
        prompts, corpus = parity.encode_inputs(loaded.tokenizer, loaded.config.vocab_size)
        if reference is None:
            reference = parity.reference(eager, prompts, corpus)
        elif (reference.prompt_ids, reference.corpus_ids) != (prompts, corpus):
            raise ValueError("the given parity reference was computed on other inputs than this model's")
    with log.stage("quantize", f"to {options.precision}"):
        module, quantization = quantize(eager, options, loaded.tokenizer)
    parent = Path(options.out).resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".ladder-compile-", dir=parent))
    try:
        with log.stage("export", f"{options.backend} files" + (" (weights; the step compiled by AOTInductor)"
                                                               if package_record(options) else "")):
            files = export(module, options, staging)
            if loaded.tokenizer is not None:
                (staging / TOKENIZER_DIR).mkdir()
                loaded.tokenizer.save(staging / TOKENIZER_DIR)
        del module, eager  # the artifact is verified from its files alone
        manifest = Manifest(
            backend=options.backend, precision=options.precision,
            model={"name": loaded.name, "source": str(loaded.path), "sha256": source_sha,
                   "config": loaded.config.to_dict()},
            shapes={"max_num_seqs": options.max_num_seqs, "max_model_len": options.max_model_len,
                    "block_size": options.block_size, "max_num_batched_tokens": options.max_num_batched_tokens},
            device=describe_device(device), libraries=library_versions(), backend_options=backend_options(options),
            quantization=quantization, package=package_record(options),
        )
        manifest.files = file_entries(staging)  # as written; moved unchanged into the artifact below
        with log.stage("build", "load the artifact back from its files, as serving will"):
            model = load_backend(staging, manifest, device)
        with log.stage("verify", "parity against fp32 eager"):
            manifest.parity = parity.compare(model, reference).to_dict()
        if options.run_bench:
            batches = sorted({1, min(options.bench_batch, options.max_num_seqs)})
            with log.stage("benchmark", f"decode tokens/s at batch {batches}, eager fp32 interleaved"):
                manifest.bench = benchmark(model, options, batches)
        with log.stage("write", str(options.out)):
            out = write_artifact(Path(options.out), manifest, lambda tmp: _move_all(staging, tmp))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.write(summary(out, manifest, log.seconds, files))
    return loaded_artifact(out, manifest, model, log.seconds["build"])


def benchmark(model, options: CompileOptions, batches: list[int]) -> dict[str, dict[str, float]]:
    """The artifact against a fresh fp32 eager model, decode rounds interleaved (compile/speed.py)."""
    eager = load(options.model, dtype=torch.float32, device=options.device, block_size=options.block_size)
    figures = {}
    for batch in batches:
        speeds = speed.compare_decode({"eager": eager.module, "artifact": model}, batch, eager.config.vocab_size)
        figures[f"batch_{batch}"] = {
            "eager_fp32_tokens_per_s": speeds["eager"].tokens_per_s,
            "artifact_tokens_per_s": speeds["artifact"].tokens_per_s,
            "speedup": speeds["artifact"].tokens_per_s / speeds["eager"].tokens_per_s,
            "eager_median_step_ms": speeds["eager"].median_step_ms,
            "artifact_median_step_ms": speeds["artifact"].median_step_ms,
            "timed_steps_each": speeds["artifact"].steps,
        }
    return figures


def _move_all(source: Path, target: Path) -> None:
    for child in source.iterdir():
        shutil.move(str(child), target / child.name)


def summary(out: Path, manifest: Manifest, seconds: dict[str, float], files: list[str]) -> str:
    p = manifest.parity
    size = sum(entry["bytes"] for entry in manifest.files.values()) / 2**20
    rows = [
        ("artifact", str(out)),
        ("backend / precision", f"{manifest.backend} / {manifest.precision}"),
        ("files", f"{len(manifest.files)} ({size:.1f} MiB)"),
        ("logit diff max / mean", f"{p['max_abs_logit_diff']:.3g} / {p['mean_abs_logit_diff']:.3g}"),
        ("greedy tokens equal", f"{p['greedy_tokens_equal']} / {p['greedy_tokens_compared']} "
                                f"(first divergences at {p['greedy_first_divergence']})"),
        ("teacher-forced top-1", f"{p['teacher_forced_top1_agreement']:.1%}"),
        ("perplexity (fp32)", f"{p['perplexity']:.4f} ({p['perplexity_fp32']:.4f}, "
                              f"{p['perplexity_change']:+.2%})"),
    ]
    for name, figures in manifest.bench.items():
        rows.append((f"decode tok/s {name.replace('_', ' ')}",
                     f"{figures['artifact_tokens_per_s']:.1f} vs eager fp32 "
                     f"{figures['eager_fp32_tokens_per_s']:.1f} ({figures['speedup']:.2f}x)"))
    rows.append(("stages", ", ".join(f"{k} {v:.1f}s" for k, v in seconds.items())))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


__all__ = ["ArtifactError", "CompileOptions", "StageLog", "run"]
