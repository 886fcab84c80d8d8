"""One batch-1 decode step of the engine taken apart: each kind of operation timed on the real modules,
the linears' bytes against the machine's copy bandwidth, and the roofline floor of the whole step.

One request at a time runs through real `LLMEngine.step()` calls, and its decode steps alternate between
instrumented and bare. An instrumented step times, with `time.perf_counter` around each call: the linear
layers by kind (forward hooks, summed over the layers), a mixture of experts' blocks (router, routing and
the k experts a token reads, whose bytes the row counts), the RMSNorms and the embedding (hooks), the
attention backend's plan and forward (a wrapper installed with `model.attention.install`), the rotary and
SiLU-times-up ops (a timed copy of the layers' `Ops`, plus the rotary cos/sin the decoder computes once a
step) and the request's `TextStream.push` (detokenizing). Where the layers run as one C++ call
(model/cpu_step.py), as `ladder serve` runs a W4A8 model on a CPU, the step times its own parts inside
that call (norms, each linear, rotary, attention with the cache write, SiLU x up) and the same rows report
them; the attention wrapper and the timed ops are then left out, so both kinds of step run the C++ call. A bare step runs untouched and gives the step's
wall time and the engine's own split of it (EngineStats: schedule, prepare, forward, sample). With
medians over each kind of step,

    python between ops in forward = bare forward - the timed ops in it
    python in the rest of the step = bare step - scheduler - input building - forward - sampler - detokenize

so the rows add up to the bare step's median. The server's per-token SSE chunk (JSON of one delta) is
timed apart on the step's texts, by a serializer the caller passes in: the server does it on its event
loop, outside the engine step. On CUDA each timed call is bracketed by synchronizations, so the rows are
device time plus launch, and the instrumented steps are slower than the bare ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.throughput import BenchConfig, make_workload
from kernels.ops import Ops
from kernels.timing import synchronize
from model import llama
from model.attention.base import BaseAttention
from model.attention.install import wrapped
from model.block_embedding import BlockEmbedding
from model.cpu_step import CpuDecoderStep
from model.linear_attention import GatedDeltaNet
from model.moe import (
    GptOssMoeBlock,
    Int8GptOssMoeBlock,
    Int8SparseMoeBlock,
    SparseMoeBlock,
    W4A8GptOssMoeBlock,
    W4A8SparseMoeBlock,
)
from model.quantization import packed_twins

MOE_BLOCKS = (SparseMoeBlock, Int8SparseMoeBlock, W4A8SparseMoeBlock, GptOssMoeBlock, Int8GptOssMoeBlock,
              W4A8GptOssMoeBlock)

# The decoder's linear modules by the last part of their name -> the kind the breakdown reports.
# (in_proj and out_proj: Qwen3.5's linear-attention layers')
LINEAR_KINDS = {"qkv_proj": "qkv", "o_proj": "o", "gate_up_proj": "gate_up", "down_proj": "down", "lm_head": "lm_head",
                "in_proj": "linear_in", "out_proj": "linear_out"}
FORWARD_OPS = (*LINEAR_KINDS.values(), "experts", "attention", "attention plan", "gated delta", "rms_norm",
               "rotary", "silu_and_mul", "embedding")
ENGINE_PHASES = ("schedule", "prepare", "forward", "sample")  # EngineStats.seconds, per step
LABELS = {
    "qkv": "linear qkv", "o": "linear o", "gate_up": "linear gate_up", "down": "linear down",
    "lm_head": "linear lm_head", "linear_in": "linear in_proj (linear attention)",
    "linear_out": "linear out_proj (linear attention)", "gated delta": "gated delta rule (conv, state, norm)",
    "experts": "MoE router + k experts", "attention": "attention",
    "attention plan": "attention metadata",
    "rms_norm": "RMSNorm", "rotary": "rotary", "silu_and_mul": "SiLU (GELU) x up", "embedding": "embedding",
    "forward python": "python between ops (forward)", "forward": "model forward (not split)",
    "schedule": "scheduler", "prepare": "input building",
    "sample": "sampler", "detokenize": "detokenize (TextStream)", "step python": "python, rest of step",
}


@dataclass(frozen=True)
class Phase:
    name: str  # a key of LABELS
    seconds: float  # median per step
    calls: int = 0  # calls per step (0: not a timed call, a remainder or an engine phase)
    weight_bytes: int | None = None  # linears: bytes of the tensors their kernels read, all layers

    @property
    def label(self) -> str:
        return LABELS.get(self.name, self.name)

    def bytes_per_s(self) -> float | None:
        return self.weight_bytes / self.seconds if self.weight_bytes and self.seconds > 0 else None

    def to_dict(self, memory_bandwidth: float, step_seconds: float) -> dict:
        rate = self.bytes_per_s()
        return {"name": self.name, "label": self.label, "seconds": self.seconds, "calls": self.calls,
                "share_of_step": self.seconds / step_seconds if step_seconds > 0 else None,
                "weight_bytes": self.weight_bytes, "bytes_per_s": rate,
                "fraction_of_copy_bandwidth": None if rate is None else rate / memory_bandwidth}


@dataclass(frozen=True)
class StepBreakdown:
    quantization: str  # the linears the steps ran: none, int8, w8a8 or w4a8 (or an artifact's precision)
    num_steps: int  # bare steps measured, and about as many instrumented ones
    contexts: tuple[int, int]  # fewest and most cached tokens before a measured step
    step_seconds: float  # median bare engine.step()
    instrumented_step_seconds: float  # median instrumented engine.step(): the instrumentation's cost shows here
    coverage: float  # median share of an instrumented forward inside the timed ops
    memory_bandwidth: float  # bytes/s, the machine's copy (doctor/machine.py)
    phases: list[Phase]  # in the engine step; they add up to step_seconds
    sse_seconds: float | None = None  # the server's SSE chunk per token, outside the step (None: not measured)
    notes: list[str] = field(default_factory=list)

    @property
    def linears(self) -> list[Phase]:
        return [p for p in self.phases if p.weight_bytes is not None]

    @property
    def weight_bytes(self) -> int:
        """Bytes of linear weights one step reads (each once, whatever the batch)."""
        return sum(p.weight_bytes for p in self.linears)

    @property
    def floor_seconds(self) -> float:
        """The roofline's least time for the step: its weight bytes at the copy bandwidth."""
        return self.weight_bytes / self.memory_bandwidth

    @property
    def floor_fraction(self) -> float:
        return self.floor_seconds / self.step_seconds

    @property
    def python_seconds(self) -> float:
        """The step's wall time outside every timed op and engine phase."""
        return sum(p.seconds for p in self.phases if p.name in ("forward python", "step python"))

    def phase(self, name: str) -> Phase:
        return next(p for p in self.phases if p.name == name)

    def to_dict(self) -> dict:
        return {"quantization": self.quantization, "batch": 1, "num_steps": self.num_steps,
                "contexts": list(self.contexts), "step_seconds": self.step_seconds,
                "instrumented_step_seconds": self.instrumented_step_seconds, "coverage": self.coverage,
                "memory_bandwidth": self.memory_bandwidth,
                "phases": [p.to_dict(self.memory_bandwidth, self.step_seconds) for p in self.phases],
                "python_dispatch_seconds": self.python_seconds, "weight_bytes": self.weight_bytes,
                "roofline_floor_seconds": self.floor_seconds, "roofline_floor_fraction": self.floor_fraction,
                "sse_chunk_seconds": self.sse_seconds,
                "per_token_seconds": self.step_seconds + (self.sse_seconds or 0.0), "notes": self.notes}


class Stopwatch:
    """Seconds and calls per phase over one step, taken only while `active`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.active = False
        self.seconds: Counter = Counter()
        self.calls: Counter = Counter()
        self.started: dict[int, float] = {}

    def now(self) -> float:
        synchronize(self.device)  # CUDA kernels run asynchronously: time from an idle device to a finished one
        return time.perf_counter()

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds
        self.calls[phase] += 1

    def wrap(self, phase: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            if not self.active:
                return fn(*args, **kwargs)
            start = self.now()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(phase, self.now() - start)
        return timed

    def hooks(self, module: nn.Module, phase: str) -> list:
        def before(sub, args):
            self.started[id(sub)] = self.now()

        def after(sub, args, output):
            self.add(phase, self.now() - self.started.pop(id(sub)))
        return [module.register_forward_pre_hook(before), module.register_forward_hook(after)]


class TimedAttention(BaseAttention):
    """Another backend's plan and forward, timed."""

    def __init__(self, inner: BaseAttention, stopwatch: Stopwatch) -> None:
        super().__init__(inner.block_size, inner.sliding_window)
        self.inner = inner
        self.plan = stopwatch.wrap("attention plan", inner.plan)
        self.forward = stopwatch.wrap("attention", inner.forward)


def phase_of(name: str, module: nn.Module) -> str | None:
    """The breakdown's phase of a submodule timed by hooks (None: not timed on its own)."""
    if isinstance(module, MOE_BLOCKS):  # inside the C++ step, a part it times (its hooks do not run there)
        return "experts"
    if isinstance(module, llama.RMSNorm):
        return "rms_norm"
    if isinstance(module, nn.Embedding | BlockEmbedding):  # a float table, or a GGUF file's rows (W4A8)
        return "embedding"
    return LINEAR_KINDS.get(name.rsplit(".", 1)[-1])


def linear_weight_bytes(module: nn.Module) -> int:
    """Bytes of the tensors a linear's kernel reads: its parameters and buffers, less the int8 `weight` of a
    module that computes from its `packed` layout (model/quantization.py `packed_twins`)."""
    skip = set(packed_twins(module))
    tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
    return sum(t.numel() * t.element_size() for name, t in tensors if t is not None and name not in skip)


def all_experts_bytes(block: nn.Module) -> int:
    """Bytes of a MoE block's E experts' weights, in their kernel's layout where they have one (the router
    is not counted)."""
    tensors = dict([*block.named_parameters(recurse=False), *block.named_buffers(recurse=False)])
    skip = set(packed_twins(block))
    return sum(t.numel() * t.element_size() for name, t in tensors.items() if t is not None and name not in skip)


def experts_weight_bytes(block: nn.Module) -> int:
    """Bytes a batch-1 step reads of a MoE block: its router, and top_k of its E experts' weights (their
    kernel's layout where it has one, as `linear_weight_bytes` counts a linear's)."""
    num_experts = block.gate.out_features  # the router's E
    return linear_weight_bytes(block.gate) + all_experts_bytes(block) * block.top_k // num_experts


def matmul_weight_bytes(module: nn.Module) -> tuple[int, int]:
    """Bytes of a decoder's matmul weights as its kernels read them: (every linear, the head and the MoE
    routers; all the experts). Over `ModelCost.dense_params` and `expert_params`, the bytes a weight takes."""
    dense = experts = 0
    for name, sub in module.named_modules():
        if name.rsplit(".", 1)[-1] in LINEAR_KINDS:
            dense += linear_weight_bytes(sub)
        elif isinstance(sub, MOE_BLOCKS):
            dense += linear_weight_bytes(sub.gate)
            experts += all_experts_bytes(sub)
    return dense, experts


def cpu_step_of(module: object) -> CpuDecoderStep | None:
    """The C++ step a decoder's decode steps run (model/cpu_step.py), or None: the eager layers."""
    if isinstance(module, llama.LlamaForCausalLM) and module.use_cpu_step:
        return module.decoder_step()
    return None


@contextlib.contextmanager
def instrumented(module: nn.Module, stopwatch: Stopwatch) -> Iterator[None]:
    """Every op of the decoder timed into `stopwatch`, for the length of the block."""
    handles, swapped = [], []
    patched_rotary = None
    cpu_step = cpu_step_of(module)
    with contextlib.ExitStack() as stack:
        try:
            # An artifact runtime's forward is no module tree: nothing in it to hook.
            for name, sub in module.named_modules() if isinstance(module, nn.Module) else ():
                if (phase := phase_of(name, sub)) is not None:
                    handles += stopwatch.hooks(sub, phase)  # inside the C++ step only the head's and embedding's run
                ops = getattr(sub, "ops", None)
                if isinstance(ops, Ops) and cpu_step is None:  # rotary and the gated activation run inside attention and MLP modules
                    swapped.append((sub, ops))
                    sub.ops = dataclasses.replace(
                        ops, apply_rotary=stopwatch.wrap("rotary", ops.apply_rotary),
                        silu_and_mul=stopwatch.wrap("silu_and_mul", ops.silu_and_mul),
                        gelu_tanh_and_mul=stopwatch.wrap("silu_and_mul", ops.gelu_tanh_and_mul))
            if cpu_step is not None:
                cpu_step.set_profiling(True)
                stack.callback(cpu_step.set_profiling, False)
                for backend in {id(b): b for b in (module.attention, module.local_attention) if b is not None}.values():
                    backend.plan = stopwatch.wrap("attention plan", backend.plan)  # the plans stay Python's
                    stack.callback(vars(backend).pop, "plan")
            elif isinstance(module, nn.Module) and isinstance(getattr(module, "attention", None), BaseAttention):
                stack.enter_context(wrapped(module, lambda backend: TimedAttention(backend, stopwatch)))
            for sub in module.modules() if isinstance(module, nn.Module) else ():  # Qwen3.5's linear attention
                if isinstance(sub, GatedDeltaNet):
                    sub.decode, sub.prompt = stopwatch.wrap("gated delta", sub.decode), stopwatch.wrap("gated delta",
                                                                                                    sub.prompt)
                    stack.callback(vars(sub).pop, "decode")
                    stack.callback(vars(sub).pop, "prompt")
            if isinstance(module, llama.LlamaForCausalLM):  # the cos/sin tables, once a step
                patched_rotary = llama.rotary_cos_sin_ref
                llama.rotary_cos_sin_ref = stopwatch.wrap("rotary", patched_rotary)
            stopwatch.active = True
            yield
            if cpu_step is not None:  # the parts timed inside the C++ call, with the calls the eager layers make
                config = module.config
                sparse = sum(config.is_sparse_layer(i) for i in range(config.num_layers))
                calls = {"rms_norm": sum(isinstance(m, llama.RMSNorm) for m in module.modules()),  # once a step
                         "experts": sparse, "gate_up": config.num_layers - sparse,
                         "silu_and_mul": config.num_layers - sparse, "down": config.num_layers - sparse,
                         "rotary": config.num_layers - len(config.linear_layers)}  # (attention layers' only)
                for part, seconds in cpu_step.take_profile().items():
                    if calls.get(part, config.num_layers):
                        stopwatch.seconds[part] += seconds
                        stopwatch.calls[part] += calls.get(part, config.num_layers)
        finally:
            stopwatch.active = False
            if patched_rotary is not None:
                llama.rotary_cos_sin_ref = patched_rotary
            for sub, ops in swapped:
                sub.ops = ops
            for handle in handles:
                handle.remove()


def run_step(engine: LLMEngine, stopwatch: Stopwatch, instrument: bool) -> dict[str, float]:
    """One engine step: its wall time, the engine's phases, and (instrumented) every timed op."""
    module = engine.runner.module
    before = dict(engine.stats.seconds)
    stopwatch.seconds.clear()
    stopwatch.calls.clear()
    with instrumented(module, stopwatch) if instrument else contextlib.nullcontext():
        start = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - start
    after = engine.stats.seconds
    record = {"wall": wall, **{p: after.get(p, 0.0) - before.get(p, 0.0) for p in ENGINE_PHASES}}
    if instrument:
        record.update(stopwatch.seconds)
        record.update({f"calls {k}": v for k, v in stopwatch.calls.items()})
    return record


def measure_breakdown(engine: LLMEngine, memory_bandwidth: float, quantization: str, prompt_len: int,
                      num_steps: int = 48, max_seconds: float = 12.0, seed: int = 0,
                      serialize_token: Callable[[str], object] | None = None,
                      on_progress: Callable[[str], None] = lambda _: None) -> StepBreakdown:
    """`num_steps` bare and as many instrumented batch-1 decode steps (fewer once `max_seconds` have passed),
    over requests of `prompt_len` prompt tokens run one after another. The engine must be idle."""
    if engine.has_unfinished():
        raise ValueError("the step breakdown needs an idle engine")
    module = engine.runner.module
    stopwatch = Stopwatch(module.device)
    limit = engine.max_model_len
    prompt_len = max(1, min(prompt_len, limit // 2))
    special = engine.tokenizer.special_ids if engine.tokenizer else frozenset()
    prompt = make_workload(BenchConfig(num_prompts=1, input_len=prompt_len, output_len=1, seed=seed + 1),
                           engine.model.config.vocab_size, special).prompts[0]
    # Default sampling (temperature 1, no filters), as an API request without options runs.
    params = SamplingParams(max_tokens=limit - prompt_len, ignore_eos=True, seed=seed)
    bare: list[dict] = []
    timed: list[dict] = []
    texts: list[str] = []
    contexts: list[int] = []
    on_progress(f"step breakdown: {num_steps} + {num_steps} batch-1 decode steps")
    start = time.perf_counter()
    number = 0
    while min(len(bare), len(timed)) < num_steps and time.perf_counter() - start < max_seconds:
        request_id = f"doctor-breakdown-{number}"
        number += 1
        engine.add_request(request_id, prompt, params)
        (sample,) = engine.requests[request_id]
        stream = engine.streams[sample]
        stream.push = timed_push(stream.push, stopwatch, texts)
        while not sample.output_token_ids and engine.has_unfinished():  # the prefill, maybe in chunks
            engine.step()
        while engine.has_unfinished():
            if min(len(bare), len(timed)) >= num_steps or time.perf_counter() - start >= max_seconds:
                engine.abort(request_id)
                engine.step()
                continue
            contexts.append(sample.num_tokens - 1)
            instrument = len(timed) < len(bare)
            (timed if instrument else bare).append(run_step(engine, stopwatch, instrument))
    if not bare or not timed:
        raise ValueError("no decode step was measured: raise --max-prefill or lower --input-len so the engine's "
                         "max_model_len leaves room for decoding")
    return summarize(bare, timed, module, quantization, memory_bandwidth, (min(contexts), max(contexts)),
                     sse_seconds(serialize_token, texts))


def timed_push(push: Callable[[int], str], stopwatch: Stopwatch, texts: list[str]) -> Callable[[int], str]:
    """A text stream's `push`, timed as "detokenize" while the stopwatch runs; the texts it releases kept."""
    def push_timed(token_id: int) -> str:
        if not stopwatch.active:
            return push(token_id)
        start = stopwatch.now()
        text = push(token_id)
        stopwatch.add("detokenize", stopwatch.now() - start)
        texts.append(text)
        return text
    return push_timed


def median(records: list[dict], key: str) -> float:
    return statistics.median(r.get(key, 0.0) for r in records)


def summarize(bare: list[dict], timed: list[dict], module: nn.Module, quantization: str, memory_bandwidth: float,
              contexts: tuple[int, int], sse: float | None) -> StepBreakdown:
    weight_bytes: Counter = Counter()
    # Inside the C++ step a linear-attention layer's projections are timed as the qkv and o parts (and its state
    # update as attention's), a shared expert's linears as the experts' part: their bytes go to those rows.
    stepped = cpu_step_of(module) is not None
    in_step = {"linear_in": "qkv", "linear_out": "o"} if stepped else {}
    for name, sub in module.named_modules() if isinstance(module, nn.Module) else ():
        if (kind := LINEAR_KINDS.get(name.rsplit(".", 1)[-1])) is not None:
            shared = stepped and ".shared_expert." in name
            weight_bytes["experts" if shared else in_step.get(kind, kind)] += linear_weight_bytes(sub)
        elif isinstance(sub, MOE_BLOCKS):
            weight_bytes["experts"] += experts_weight_bytes(sub)
    phases = []
    for op in FORWARD_OPS:
        calls = round(median(timed, f"calls {op}"))
        if calls or op in weight_bytes:
            phases.append(Phase(op, median(timed, op), calls, weight_bytes.get(op)))
    notes = []
    ops = sum(p.seconds for p in phases)
    engine_phases = {p: median(bare, p) for p in ENGINE_PHASES}
    detokenize = median(timed, "detokenize")
    step = median(bare, "wall")
    if stepped:
        notes.append("the layers ran as one C++ call a step (model/cpu_step.py): their rows are its parts, timed "
                     "inside it" + ("; the linear-attention layers' projections in the qkv and o rows, their state "
                                    "update in attention's" if in_step and module.config.linear_layers else "")
                     + ("; the shared expert in the experts' row" if module.config.shared_expert_intermediate_size
                        else ""))
    if phases:
        phases.append(Phase("forward python", engine_phases["forward"] - ops))
    else:  # an artifact runtime: no decoder modules in this process to time
        notes.append(f"{type(module).__name__} has no decoder modules to time: its forward is one row")
        phases.append(Phase("forward", engine_phases["forward"]))
    phases += [Phase(p, engine_phases[p]) for p in ("schedule", "prepare", "sample")]
    phases.append(Phase("detokenize", detokenize, round(median(timed, "calls detokenize"))))
    phases.append(Phase("step python", step - sum(engine_phases.values()) - detokenize))
    shares = [sum(r.get(op, 0.0) for op in FORWARD_OPS) / r["forward"] for r in timed if r["forward"] > 0]
    coverage = statistics.median(shares) if shares else 0.0
    return StepBreakdown(quantization, len(bare), contexts, step, median(timed, "wall"), coverage, memory_bandwidth,
                         phases, sse, notes)


def sse_seconds(serialize_token: Callable[[str], object] | None, texts: list[str], reps: int = 20) -> float | None:
    """Median seconds to serialize one token's SSE chunk, over the texts the steps released."""
    if serialize_token is None:
        return None
    texts = texts or [" the"]
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        for text in texts:
            serialize_token(text)
        samples.append((time.perf_counter() - start) / len(texts))
    return statistics.median(samples)
