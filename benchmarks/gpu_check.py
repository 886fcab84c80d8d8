"""The device check: one run on one NVIDIA GPU that says whether every CUDA path works and how fast it is.

    python benchmarks/gpu_check.py --out DIR            (on a CUDA machine; benchmarks/gpu_check.sh runs it)
    python benchmarks/gpu_check.py --dry-run --out DIR  (anywhere: the same code on CPU tensors, tiny shapes,
                                                         Triton interpreted)

Sections, in the order they run (cheapest and most informative first), each a table row group and a JSON
entry (DIR/gpu_check.json; the table also in gpu_check.txt):

0. bandwidth: a device-to-device copy; the other sections' fractions are of it (it always runs).
1. kernels: every Triton kernel against its plain-torch reference in float16 and bfloat16 (relative
   error, pass or fail), timed against the eager reference; the memory-bound ones as a fraction of the
   copy bandwidth measured in the same run.
2. parity: the fp32 model on the device (Triton ops) against the same weights on the CPU (torch ops):
   logits of a prompt step and a decode step, greedy tokens; and on the device, a speculative verify
   chunk's rows against decoding the same tokens one at a time (docs/speculative.md).
3. decode: a model with SmolLM2-135M's shapes and random weights (speed does not depend on the values)
   decoding at batch 1 and 64 in bf16: eager (Triton ops), the torch-compile runtime the artifacts use
   (CUDA graphs for decode steps, Triton attention as a custom op), and TensorRT when `tensorrt`, `onnx`
   and `onnxscript` are installed. Interleaved rounds (compile/speed.py), tokens/s, and the batch-64
   figure as a fraction of the memory roofline (weights + the KV cache read per step at the copy
   bandwidth). Whether the CUDA graphs replay is read from Inductor's graph-tree manager. Each batch
   size records the seconds of its first steps (compiles and CUDA graph recordings) and has its own
   time guard: when what is left of `--budget-s` is shorter than the last batch size took, the rest are
   skipped with the reason recorded. Dynamo's recompiles, each with the guard that failed, are captured
   into the JSON (`recompiles`).

A device machine may be lent for minutes only, so nothing measured may be lost: the JSON and the table
are rewritten (atomically: a temporary file, then a rename) after every section and every decode batch
size, and on SIGTERM or SIGINT (`timeout -s TERM` in gpu_check.sh) the figures so far are written with
the interrupted section named before the process exits with 128 + the signal number. `--sections`
splits the check into shorter runs (README: two runs of at most 5 minutes each).

It imports nothing that loads checkpoints or serves (no fastapi, gguf, tokenizers, safetensors, no
default model package): torch and Triton are all it needs besides this repository.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import signal
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from collections.abc import Callable
from pathlib import Path
from typing import Any

if "--dry-run" in sys.argv:  # before any kernel module is imported: Triton decides when a kernel is defined
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["LADDER_KERNELS"] = "triton"
# The repository root (its packages) and this directory (the kernel benchmarks' cases and timing), however
# the script is started.
sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402

from compile.speed import compare_decode  # noqa: E402
from engine.backends.torch_compiled import (  # noqa: E402
    TorchCompiledModel,
    compile_options,
    compiled_ops,
    cuda_graph_state,
)
import kernel_cases as bench_cases  # noqa: E402  (benchmarks/, this script's directory)
from kernel_bench import copy_bandwidth, measure_ms, relative_error  # noqa: E402
from kernels.ops import TORCH_OPS, TRITON_OPS  # noqa: E402
from kernels.runtime import HAS_TRITON, INTERPRETING, TRITON_IMPORT_ERROR  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from model.llama import LlamaForCausalLM  # noqa: E402
from model.quantization import apply_precision  # noqa: E402
from model.sequences import Sequences  # noqa: E402

# SmolLM2-135M's shapes (its config.json); the weights are random.
SMOLLM2_135M = dict(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                    rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True)
# The dry run's: the same structure (grouped-query heads, tied head), a few thousand times less work.
TINY = dict(SMOLLM2_135M, vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16, max_position_embeddings=512)
TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 2e-2}  # relative L2 error of a kernel against its reference
LOGIT_TOLERANCE = 2e-3  # fp32 device logits against the CPU's, max abs difference over max abs logit
FUSED = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary", "write_kv_cache")


@dataclass
class Plan:
    """What the run does: the real sizes on a GPU, tiny ones in the dry run."""

    device: torch.device
    dry_run: bool
    model: dict[str, Any]
    batches: tuple[int, ...]
    prompt_len: int
    rounds: int
    steps: int
    timing_s: float
    copy_bytes: int
    kernel_sizes: dict[str, Any]
    # Seconds a decode batch size is let start with when no earlier one says how long one takes
    # (compiles of the 30-layer graph and CUDA graph recordings dominate), and a TensorRT build.
    decode_min_s: float = 60.0
    tensorrt_min_s: float = 150.0


def make_plan(dry_run: bool) -> Plan:
    if dry_run:
        return Plan(torch.device("cpu"), True, TINY, (1, 4), prompt_len=8, rounds=1, steps=2, timing_s=0.02,
                    copy_bytes=8 << 20,
                    kernel_sizes=dict(tokens=8, heads=(4, 2, 16), decode=(2, 40), prefill=(1, 16, 8), int8=(2, 64, 64)),
                    decode_min_s=5.0, tensorrt_min_s=30.0)
    heads = (SMOLLM2_135M["num_heads"], SMOLLM2_135M["num_kv_heads"], SMOLLM2_135M["head_dim"])
    return Plan(torch.device("cuda"), False, SMOLLM2_135M, (1, 64), prompt_len=128, rounds=4, steps=8, timing_s=0.3,
                copy_bytes=1 << 30,
                kernel_sizes=dict(tokens=4096, heads=heads, decode=(64, 2048), prefill=(4, 1024, 1024),
                                  int8=(64, 1536, 576)))


# --- 1. kernels -------------------------------------------------------------------------------------------


@dataclass
class KernelRow:
    kernel: str
    size: str
    dtype: str
    rel_error: float
    passed: bool
    triton_ms: float | None = None
    eager_ms: float | None = None
    speedup: float | None = None
    bandwidth_fraction: float | None = None  # of the measured copy bandwidth (memory-bound kernels)
    error: str | None = None


def kernel_cases(plan: Plan, dtype: torch.dtype) -> list[bench_cases.Case]:
    s = plan.kernel_sizes
    tokens, heads = s["tokens"], s["heads"]
    hidden, intermediate = plan.model["hidden_size"], plan.model["intermediate_size"]
    return [
        *bench_cases.norm_cases(tokens, hidden, dtype),
        bench_cases.swiglu_case(tokens, intermediate, dtype),
        bench_cases.rotary_case(tokens, heads[0], heads[1], heads[2], dtype),
        bench_cases.kv_write_case(tokens, heads[1], heads[2], 16, dtype),
        bench_cases.decode_case(s["decode"][0], s["decode"][1], heads, dtype),
        bench_cases.prefill_case(*s["prefill"], heads, dtype),
        bench_cases.int8_case(*s["int8"], dtype),
    ]


def check_kernels(plan: Plan, bandwidth: float) -> list[KernelRow]:
    rows = []
    for dtype in (torch.float16, torch.bfloat16):
        for case in kernel_cases(plan, dtype):
            name = str(dtype).removeprefix("torch.")
            try:
                # Fresh inputs for each side: some kernels write in place.
                error = relative_error(case.kernel_fn(**case.make_inputs(plan.device)),
                                       case.ref_fn(**case.make_inputs(plan.device)))
                row = KernelRow(case.kernel, case.size, name, error, error <= TOLERANCE[dtype])
                inputs = case.make_inputs(plan.device)
                row.triton_ms = measure_ms(lambda: case.kernel_fn(**inputs), plan.device, plan.timing_s)
                row.eager_ms = measure_ms(lambda: case.ref_fn(**inputs), plan.device, plan.timing_s)
                row.speedup = row.eager_ms / row.triton_ms
                if case.kernel in (*FUSED, "decode_attention"):
                    row.bandwidth_fraction = case.bytes / (row.triton_ms * 1e-3) / bandwidth
            except Exception as exc:  # noqa: BLE001  a failing kernel is a row of the report, not the end of it
                row = KernelRow(case.kernel, case.size, name, float("nan"), False, error=one_line(exc))
            rows.append(row)
            print(f"  kernel {row.kernel} {row.dtype}: {'ok' if row.passed else 'FAIL'}", flush=True)
    return rows


# --- 2. decode --------------------------------------------------------------------------------------------


def random_model(plan: Plan, ops, device: torch.device, seed: int = 0) -> LlamaForCausalLM:
    """fp32 weights drawn from the module's own initialisers (same seed: same weights on every device)."""
    torch.manual_seed(seed)
    config = ModelConfig.from_dict(plan.model)
    with torch.device("cpu"):
        module = LlamaForCausalLM(config, block_size=16, ops=ops)
    with torch.no_grad():
        for norm in [m for m in module.modules() if type(m).__name__ == "RMSNorm"]:
            norm.weight.uniform_(0.5, 1.5)  # not all ones, so a wrong norm weight shows
    return module.to(device).eval().requires_grad_(False)


def decode_models(plan: Plan, notes: dict[str, Any], budget: Budget) -> dict[str, Any]:
    """name -> step model; `notes` get why one is missing."""
    eager = apply_precision(random_model(plan, TRITON_OPS, plan.device), "bf16")
    models: dict[str, Any] = {"eager bf16": eager}
    # Built as a CUDA artifact is (engine/backends/torch_compiled.py): Inductor fuses the references'
    # norms, rotary and SwiGLU, attention is the Triton custom op, with the options a CUDA artifact
    # records, in the dry run too: the same code path, minus the graphs a CPU cannot capture (Inductor
    # skips them and counts the skip).
    cuda = torch.device("cuda")
    compiled_module = apply_precision(random_model(plan, compiled_ops(cuda), plan.device), "bf16")
    models["torch-compile bf16"] = TorchCompiledModel(compiled_module, "bf16", compile_options(cuda),
                                                      max_model_len=decode_max_len(plan), graph_attention=True)
    if budget.left_s() < plan.tensorrt_min_s:
        notes["tensorrt"] = (f"not built: {budget.left_s():.0f} s of the budget left, a build needs about "
                             f"{plan.tensorrt_min_s:.0f}")
        return models
    start = time.perf_counter()
    trt = tensorrt_model(plan, decode_max_len(plan), max(plan.batches), notes)
    if trt is not None:
        models["tensorrt fp16"] = trt
        notes["tensorrt_build_s"] = round(time.perf_counter() - start, 1)
    return models


def decode_max_len(plan: Plan) -> int:
    """At least the longest sequence compare_decode makes (prompt, its warm-up steps, the timed rounds)."""
    return plan.prompt_len + 4 + plan.rounds * plan.steps + 1


def first_steps_s(model, plan: Plan, batch: int) -> float:
    """Seconds of a prompt step and two decode steps at `batch` sequences: a compiled model's compiles
    and CUDA graph recording at this batch size (the second decode step records the graph), so the
    timed rounds after it measure replays only."""
    start = time.perf_counter()
    prompts = torch.randint(0, plan.model["vocab_size"], (batch, plan.prompt_len),
                            generator=torch.Generator().manual_seed(2)).tolist()
    seqs = Sequences(model, batch, decode_max_len(plan))
    logits = seqs.step(prompts)
    for _ in range(2):
        logits = seqs.step([[t] for t in logits.argmax(dim=-1).tolist()])
    return time.perf_counter() - start


def tensorrt_model(plan: Plan, max_len: int, max_seqs: int, notes: dict[str, Any]):
    missing = [name for name in ("tensorrt", "onnx", "onnxscript") if not _importable(name)]
    if missing or plan.device.type != "cuda":
        notes["tensorrt"] = (f"not run: {', '.join(missing)} not installed" if missing
                             else "not run: TensorRT needs a CUDA device")
        return None
    import tempfile

    from compile.onnx_export import export_for_tensorrt
    from compile.tensorrt_build import build_engine
    from engine.backends.manifest import Manifest
    from engine.backends.tensorrt_runtime import TensorRTModel

    @dataclass
    class BuildOptions:
        precision: str = "fp16"
        max_num_seqs: int = max_seqs
        max_model_len: int = max_len
        block_size: int = 16
        max_num_batched_tokens: int = max_seqs * plan.prompt_len

    try:
        module = random_model(plan, TORCH_OPS, plan.device)
        directory = Path(tempfile.mkdtemp(prefix="ladder-trt-"))
        export_for_tensorrt(module, directory, "fp16")
        build_engine(directory, BuildOptions(), module.config)
        options = BuildOptions()
        manifest = Manifest(backend="tensorrt", precision="fp16", model={"config": module.config.to_dict()},
                            shapes={"max_num_seqs": options.max_num_seqs, "max_model_len": options.max_model_len,
                                    "block_size": 16, "max_num_batched_tokens": options.max_num_batched_tokens},
                            device={"type": "cuda"}, libraries={})
        return TensorRTModel.load(directory, manifest, plan.device)
    except Exception as exc:  # noqa: BLE001
        notes["tensorrt"] = f"failed: {one_line(exc)}"
        return None


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def decode_bytes_per_step(model: LlamaForCausalLM, batch: int, context: int) -> int:
    """What a decode step must read at least: every weight once (the tied head once) and each sequence's
    cached keys and values."""
    weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    cfg = model.config
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * model.kv_cache_dtype.itemsize
    return weights + batch * context * kv


def measure_decode(plan: Plan, report: Report, budget: Budget, save: Callable[[], None]) -> dict[str, Any]:
    """Fills `report.decode` as it goes (a stop mid-section keeps the batch sizes done), saving after each."""
    figures: dict[str, Any] = {"rows": [], "notes": {}, "compile_s": {}, "seconds": {}, "skipped": {}}
    report.decode = figures
    models = decode_models(plan, figures["notes"], budget)
    vocab = plan.model["vocab_size"]
    eager_module = models["eager bf16"]
    needed = plan.decode_min_s
    for i, batch in enumerate(plan.batches):
        if budget.left_s() < needed:
            reason = (f"skipped: {budget.left_s():.0f} s of the {budget.total_s:.0f} s budget left, "
                      f"a batch size needs about {needed:.0f} s")
            for rest in plan.batches[i:]:
                figures["skipped"][str(rest)] = reason
            print(f"  decode batch {batch}: {reason}", flush=True)
            break
        start = time.perf_counter()
        figures["compile_s"][str(batch)] = {name: round(first_steps_s(model, plan, batch), 2)
                                            for name, model in models.items()}
        speeds = compare_decode(models, batch, vocab, plan.prompt_len, plan.rounds, plan.steps)
        context = plan.prompt_len + 4 + plan.rounds * plan.steps // 2  # the middle of the timed steps
        roofline = report.copy_bandwidth_bytes_per_s / decode_bytes_per_step(eager_module, batch, context) * batch
        for name, speed in speeds.items():
            figures["rows"].append({"model": name, "batch": batch, "tokens_per_s": speed.tokens_per_s,
                                    "median_step_ms": speed.median_step_ms, "roofline_tokens_per_s": roofline,
                                    "roofline_fraction": speed.tokens_per_s / roofline})
            print(f"  decode {name} batch {batch}: {speed.tokens_per_s:.1f} tok/s", flush=True)
        figures[f"cuda_graphs_after_batch_{batch}"] = cuda_graph_state(plan.device)
        took = time.perf_counter() - start
        figures["seconds"][str(batch)] = round(took, 1)
        # The next batch size compiles and records its graphs again (a decode graph per size at least).
        needed = max(plan.decode_min_s, took)
        save()
    return figures


# --- 3. parity --------------------------------------------------------------------------------------------


def check_parity(plan: Plan) -> dict[str, Any]:
    """fp32: the device model on the Triton ops against the CPU model on the torch references."""
    reference = random_model(plan, TORCH_OPS, torch.device("cpu"))
    device_model = random_model(plan, TRITON_OPS, plan.device)
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, plan.model["vocab_size"], (2, 2 * 16 + 5), generator=generator).tolist()
    results = {}
    for name, model in (("cpu", reference), ("device", device_model)):
        seqs = Sequences(model, len(prompts), 64)
        prefill = seqs.step(prompts, all_rows=True).cpu()
        decode = seqs.step([[t] for t in prefill.view(2, -1, prefill.shape[-1])[:, -1].argmax(-1).tolist()]).cpu()
        results[name] = (prefill, decode)
    prefill_diff = (results["cpu"][0] - results["device"][0]).abs().max().item()
    decode_diff = (results["cpu"][1] - results["device"][1]).abs().max().item()
    scale = results["cpu"][0].abs().max().item()
    greedy_equal = bool(torch.equal(results["cpu"][0].argmax(-1), results["device"][0].argmax(-1))
                        and torch.equal(results["cpu"][1].argmax(-1), results["device"][1].argmax(-1)))
    worst = max(prefill_diff, decode_diff) / scale
    return {"prefill_max_abs_diff": prefill_diff, "decode_max_abs_diff": decode_diff, "max_abs_logit": scale,
            "relative": worst, "greedy_equal": greedy_equal, "passed": worst <= LOGIT_TOLERANCE and greedy_equal,
            "speculative": verify_against_decode(device_model, prompts[0])}


def verify_against_decode(model, prompt: list[int], num_drafts: int = 4) -> dict[str, Any]:
    """Speculative decoding's premise on the device: the rows of one verify chunk (the last token and
    `num_drafts` drafts) against decoding the same tokens one at a time. Bit-equal on the CPU path; on the
    device the chunk runs the prefill kernel where decodes run the decode kernel."""
    decode = Sequences(model, 1, 64)
    decode.step([prompt[:-1]])  # the prompt but its last token, cached
    tokens = [prompt[-1]]
    decoded = []
    for _ in range(num_drafts + 1):
        logits = decode.step([[tokens[-1]]]).cpu()
        decoded.append(logits[0])
        tokens.append(int(logits[0].argmax()))
    verify = Sequences(model, 1, 64)
    verify.step([prompt[:-1]])
    chunk = verify.step([tokens[:num_drafts + 1]], all_rows=True).cpu()
    diff = (chunk - torch.stack(decoded)).abs().max().item()
    return {"verify_vs_decode_max_abs_diff": diff,
            "greedy_equal": bool(torch.equal(chunk.argmax(-1), torch.stack(decoded).argmax(-1))),
            "bit_equal": diff == 0.0}


# --- the run ----------------------------------------------------------------------------------------------


@dataclass
class Report:
    dry_run: bool
    device: str
    environment: dict[str, Any]
    sections: list[str] = field(default_factory=list)  # requested, in the order they run
    budget_s: float = 0.0
    copy_bandwidth_bytes_per_s: float = 0.0
    kernels: list[KernelRow] = field(default_factory=list)
    parity: dict[str, Any] = field(default_factory=dict)
    decode: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # section -> why it did not run
    seconds: dict[str, float] = field(default_factory=dict)
    recompiles: list[str] = field(default_factory=list)  # Dynamo's recompile messages, each with its guard
    running: str | None = None  # the section under way when the results were written
    stopped: str | None = None  # the signal that ended the run early
    complete: bool = False

    @property
    def passed(self) -> bool:
        return (not self.errors and not self.skipped and not self.stopped and all(k.passed for k in self.kernels)
                and (not self.parity or self.parity["passed"]))


@dataclass
class Budget:
    """Seconds the whole check may take, counted from the start of the run."""

    total_s: float
    start: float = field(default_factory=time.monotonic)

    def left_s(self) -> float:
        return self.total_s - (time.monotonic() - self.start)


class RecompileLog(logging.Handler):
    """Keeps the records of Dynamo's `recompiles` log (each names the function and the failed guard)."""

    def __init__(self, report: Report) -> None:
        super().__init__(logging.DEBUG)
        self.report = report

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.endswith("__recompiles"):
            self.report.recompiles.append(" ".join(record.getMessage().split()))


def capture_recompiles(report: Report) -> None:
    try:
        torch._logging.set_logs(recompiles=True)
    except Exception as exc:  # noqa: BLE001  a torch without the artifact: say so, measure anyway
        report.recompiles.append(f"not captured: {one_line(exc)}")
        return
    # The artifact logger (torch._dynamo.guards.__recompiles) propagates to its package's logger.
    logging.getLogger("torch._dynamo").addHandler(RecompileLog(report))


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


def environment(plan: Plan) -> dict[str, Any]:
    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "triton": None, "triton_mode": "absent" if not HAS_TRITON else "interpreter" if INTERPRETING else "compiled",
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if HAS_TRITON:
        import triton

        env["triton"] = triton.__version__
    if plan.device.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(plan.device)
        env["gpu"] = f"{props.name}, sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB"
    else:
        env["gpu"] = None
    return env


SECTIONS = ("bandwidth", "kernels", "parity", "decode")  # the order they run: cheapest, most telling first
DEFAULT_BUDGET_S = 240.0  # with start-up and a stopped section's write, inside a 5-minute device run


def write_results(report: Report, out: Path) -> None:
    """gpu_check.json and gpu_check.txt, each written to a temporary file and renamed over the old one,
    so a reader (or a kill mid-write) never sees half a file."""
    out.mkdir(parents=True, exist_ok=True)
    data = asdict(report)
    data["passed"] = report.passed
    for name, text in (("gpu_check.json", json.dumps(data, indent=2, default=str)),
                       ("gpu_check.txt", format_report(report) + "\n")):
        temporary = out / f".{name}.{os.getpid()}.tmp"
        temporary.write_text(text, encoding="utf-8")
        os.replace(temporary, out / name)


def stop_on_signals(report: Report, out: Path) -> None:
    """On SIGTERM (timeout) or SIGINT: record the interrupted section, write what is done, exit 128 + signal."""
    started = time.monotonic()

    def handler(signum: int, frame) -> None:
        name = signal.Signals(signum).name
        report.stopped = name
        if report.running is not None:
            report.errors[report.running] = f"stopped by {name} after {time.monotonic() - started:.0f} s of the run"
        try:
            write_results(report, out)
            print(f"gpu_check: {name}: partial results in {out / 'gpu_check.json'}", flush=True)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(128 + signum)  # no unwinding through torch's handlers: the results are written

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, handler)


def run(plan: Plan, only: tuple[str, ...] = SECTIONS, out: Path | None = None,
        budget_s: float = DEFAULT_BUDGET_S, sections: dict[str, Callable[[], Any]] | None = None,
        report: Report | None = None) -> Report:
    """The sections in SECTIONS order (bandwidth always: the others' fractions are of it), writing the
    results to `out` after each. `sections` replaces the real ones (tests); a section's return value
    becomes the report field of its name (bandwidth: copy_bandwidth_bytes_per_s)."""
    if report is None:
        report = Report(plan.dry_run, str(plan.device), environment(plan))
    budget = Budget(budget_s)
    report.budget_s = budget_s
    report.sections = [name for name in SECTIONS if name == "bandwidth" or name in only]

    def save() -> None:
        if out is not None:
            write_results(report, out)

    if sections is None:
        sections = {"bandwidth": lambda: copy_bandwidth(plan.device, plan.copy_bytes, plan.timing_s),
                    "kernels": lambda: check_kernels(plan, report.copy_bandwidth_bytes_per_s),
                    "parity": lambda: check_parity(plan),
                    "decode": lambda: measure_decode(plan, report, budget, save)}
        capture_recompiles(report)  # torch's logging is process-wide: not for fake sections in a test process
    for name in report.sections:
        if name != "bandwidth" and budget.left_s() <= 0:
            report.skipped[name] = f"skipped: the {budget_s:.0f} s budget was spent"
            save()
            continue
        print(f"== {name}", flush=True)
        report.running = name
        save()
        start = time.perf_counter()
        try:
            value = sections[name]()
            setattr(report, "copy_bandwidth_bytes_per_s" if name == "bandwidth" else name, value)
        except Exception as exc:  # noqa: BLE001  the other sections still run and report
            traceback.print_exc()
            report.errors[name] = one_line(exc)
        report.seconds[name] = round(time.perf_counter() - start, 2)
        report.running = None
        save()
    report.complete = True
    save()
    return report


def _cell(value: float | None, fmt: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, fmt) + suffix


def format_report(report: Report) -> str:
    env = report.environment
    title = "ladder GPU check"
    if report.dry_run:
        title += " (DRY RUN: CPU tensors, tiny shapes, Triton interpreted; times mean nothing)"
    lines = [title,
             f"device {report.device} {env.get('gpu') or ''} | torch {env['torch']} (CUDA {env['cuda']}) | "
             f"triton {env['triton']} ({env['triton_mode']}) | python {env['python']} | {env['date']}",
             f"copy bandwidth {report.copy_bandwidth_bytes_per_s / 1e9:.1f} GB/s", ""]
    head = (f"{'kernel':<20} {'dtype':<9} {'size':<34} {'rel err':>8} {'ok':>4} {'triton ms':>9} {'eager ms':>9} "
            f"{'x eager':>7} {'of copy bw':>10}")
    lines += [head, "-" * len(head)]
    for k in report.kernels:
        fraction = None if k.bandwidth_fraction is None else 100 * k.bandwidth_fraction
        lines.append(f"{k.kernel:<20} {k.dtype:<9} {k.size:<34} {k.rel_error:8.1e} {'yes' if k.passed else 'NO':>4} "
                     f"{_cell(k.triton_ms, '.3f'):>9} {_cell(k.eager_ms, '.3f'):>9} {_cell(k.speedup, '.2f'):>7} "
                     f"{_cell(fraction, '.1f', '%'):>10}" + (f"  {k.error}" if k.error else ""))
    lines.append("")
    if report.decode:
        head = (f"{'decode model':<22} {'batch':>5} {'tok/s':>10} {'step ms':>9} {'roofline tok/s':>14} "
                f"{'of roofline':>11}")
        lines += [head, "-" * len(head)]
        for r in report.decode.get("rows", []):
            lines.append(f"{r['model']:<22} {r['batch']:>5} {r['tokens_per_s']:10.1f} {r['median_step_ms']:9.3f} "
                         f"{r['roofline_tokens_per_s']:14.1f} {100 * r['roofline_fraction']:10.1f}%")
        for key, value in report.decode.items():
            if key.startswith("cuda_graphs"):
                lines.append(f"{key.replace('_', ' ')}: last step {value['last_step']}, skipped graphs "
                             f"{value['skipped_graphs']}")
        for batch, seconds in report.decode.get("compile_s", {}).items():
            lines.append(f"batch {batch} first steps (compiles, graph recording), s: "
                         + ", ".join(f"{name} {value:.1f}" for name, value in seconds.items()))
        for batch, reason in report.decode.get("skipped", {}).items():
            lines.append(f"batch {batch}: {reason}")
        for key, value in report.decode.get("notes", {}).items():
            lines.append(f"{key}: {value}")
        lines.append("")
    if report.parity:
        p = report.parity
        lines.append(f"fp32 parity, device vs CPU: max |logit diff| prefill {p['prefill_max_abs_diff']:.2e}, decode "
                     f"{p['decode_max_abs_diff']:.2e} (max |logit| {p['max_abs_logit']:.2f}), greedy equal "
                     f"{p['greedy_equal']}: {'pass' if p['passed'] else 'FAIL'}")
        if "speculative" in p:
            v = p["speculative"]
            lines.append(f"speculative verify chunk vs one-at-a-time decodes, fp32 on the device: max |logit diff| "
                         f"{v['verify_vs_decode_max_abs_diff']:.2e}, greedy equal {v['greedy_equal']}, bit equal "
                         f"{v['bit_equal']}")
    for name, error in report.errors.items():
        lines.append(f"section {name} FAILED: {error}")
    for name, reason in report.skipped.items():
        lines.append(f"section {name} {reason}")
    lines.append(f"recompiles: {len(report.recompiles)}")
    lines += [f"  {message}" for message in report.recompiles]
    lines.append(f"seconds: {', '.join(f'{k} {v:.1f}' for k, v in report.seconds.items())} "
                 f"(budget {report.budget_s:.0f})")
    if not report.complete:
        running = report.running or "between sections"
        lines.append(f"PARTIAL: {f'stopped by {report.stopped}' if report.stopped else f'in progress ({running})'}")
    lines.append(f"overall: {'PASS' if report.passed else 'FAIL'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/gpu_check.py", description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU tensors, tiny shapes, Triton interpreted: shows the check runs end to end")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "benchmarks/results/gpu-check")),
                        help="directory for gpu_check.json and gpu_check.txt (default: $OUT)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated sections to run (default: all of {', '.join(SECTIONS)})")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help="seconds the check may take; decode batch sizes that would not fit are skipped "
                             f"with the reason recorded (default {DEFAULT_BUDGET_S:.0f})")
    args = parser.parse_args(argv)
    only = tuple(name.strip() for name in args.sections.split(",") if name.strip())
    if unknown := set(only) - set(SECTIONS):
        parser.error(f"unknown section(s) {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    if args.budget_s <= 0:
        parser.error("--budget-s must be positive")
    plan = make_plan(args.dry_run)
    report = Report(plan.dry_run, str(plan.device), environment(plan))
    refusal = None
    if not HAS_TRITON:
        refusal = f"triton is not importable ({TRITON_IMPORT_ERROR})"
    elif not args.dry_run and not torch.cuda.is_available():
        refusal = "torch sees no CUDA device (use --dry-run to check the code on a CPU)"
    elif not args.dry_run and INTERPRETING:
        refusal = "TRITON_INTERPRET is set: the kernels would be interpreted, not compiled"
    if refusal is not None:
        # Still a result file: the run's record says what did not run and why.
        report.sections = [name for name in SECTIONS if name == "bandwidth" or name in only]
        report.skipped = {name: f"not run: {refusal}" for name in report.sections}
        report.budget_s = args.budget_s
        report.complete = True
        write_results(report, args.out)
        print(f"gpu_check: error: {refusal}", file=sys.stderr)
        return 2
    stop_on_signals(report, args.out)
    run(plan, only, args.out, args.budget_s, report=report)
    print(format_report(report))
    print(f"wrote {args.out / 'gpu_check.json'}")
    return 0 if report.passed else 1

if __name__ == "__main__":
    sys.exit(main())
