"""The verdict: which layer bounds this deployment, the numbers behind it, and the next step.

`classify` is a pure function of measured figures, so its rules are tested on any figures at all. The
rules go top down, as the five layers do: time spent talking between ranks (parallelism), time spent
waiting for a slot (runtime), then the step itself, which is either mostly outside the model's maths
(Python overhead: scheduling, building inputs, dispatching small kernels) or under one of the roofs.
The next step is for the configuration measured: its precision (`--quantization` as resolved, or an
artifact's), so a model already serving int8 or 4-bit weights is not told to quantize them again.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from model.precision import PRECISIONS
from model.quantization import W4A8_BYTES_AT_MOST

BOUNDS = ("communication", "queue", "overhead", "memory", "compute")
COMMUNICATION_SHARE = 0.3  # of step time in collectives
QUEUE_SHARE = 0.5  # of a request's life spent waiting to be scheduled
OVERHEAD_SHARE = 0.5  # of engine step time outside the model's forward
MIN_ROOF_FRACTION = 0.1  # forward time the roofline explains; below it the forward is mostly dispatch
FULL_BATCH = 0.9  # occupancy from which the batch counts as full


@dataclass(frozen=True)
class Evidence:
    """The measured figures the verdict is drawn from (None: not measured)."""

    queue_share: float | None = None
    occupancy: float | None = None
    max_num_seqs: int | None = None
    num_preemptions: float | None = None
    overhead_share: float | None = None
    roof_fraction: float | None = None  # achieved fraction of the roofline at the operating point
    roof: str | None = None  # "memory" or "compute": the roof over the operating point
    operating_label: str = "the load's steps"
    communication_share: float | None = None
    num_ranks: int = 1
    weight_bytes: float | None = None
    precision: str | None = None  # what the linears run in (model/precision.py); None: not known
    is_artifact: bool = False  # a compiled artifact: its precision changes by compiling another one
    compilable: bool = True  # False: `ladder compile` refuses the model (Gemma 3's per-layer windows)
    # A quantized GGUF's W4A8 bytes a step over W8A8's (model/quantization.linear_bytes_of); None: no such file.
    w4a8_bytes_ratio: float | None = None
    faster_kinds: dict[str, float] = field(default_factory=dict)  # matmul kind -> peak ratio to the model's kind


@dataclass(frozen=True)
class Verdict:
    bound: str  # one of BOUNDS
    reasons: list[str]  # the numbers behind it
    next_step: str

    def to_dict(self) -> dict:
        return asdict(self)


def pct(value: float) -> str:
    return f"{value:.0%}"


def classify(e: Evidence) -> Verdict:
    if e.num_ranks > 1 and e.communication_share is not None and e.communication_share >= COMMUNICATION_SHARE:
        return Verdict("communication", [
            f"{pct(e.communication_share)} of step time is spent in collectives across {e.num_ranks} ranks "
            f"(threshold {pct(COMMUNICATION_SHARE)})"],
            "use fewer tensor-parallel ranks for this model size, or put the ranks on a faster link; "
            "overlap the all-reduce with the next layer's compute")
    if e.queue_share is not None and e.queue_share >= QUEUE_SHARE:
        return Verdict("queue", [f"requests spend {pct(e.queue_share)} of their time waiting to be scheduled "
                                 f"(threshold {pct(QUEUE_SHARE)})", *occupancy_reasons(e)], queue_step(e))
    if e.overhead_share is not None and e.overhead_share >= OVERHEAD_SHARE:
        return Verdict("overhead", [f"{pct(e.overhead_share)} of engine step time is outside the model's forward "
                                    "(scheduling, building inputs, sampling)"], overhead_step(e))
    if e.roof_fraction is None or e.roof is None:
        raise ValueError("no step was measured: the verdict needs the roofline of at least one step")
    if e.roof_fraction < MIN_ROOF_FRACTION:
        return Verdict("overhead", [
            f"{e.operating_label} reach {pct(e.roof_fraction)} of the roofline (threshold "
            f"{pct(MIN_ROOF_FRACTION)}): most of the forward is per-operation dispatch, not bytes or FLOPs"],
            overhead_step(e))
    reasons = [f"{e.operating_label} sit under the {e.roof} roof and reach {pct(e.roof_fraction)} of it"]
    if e.roof == "memory":
        weights = f"{e.weight_bytes / 1e6:.0f} MB of weights" if e.weight_bytes else "the weights"
        return Verdict("memory", reasons, f"each step reads {weights}: batch more sequences per step so the same "
                       f"bytes serve more tokens (raise --max-num-seqs){fewer_bytes_step(e)}. For one stream, "
                       "speculative decoding makes one read yield several tokens where answers copy their input "
                       "(`--speculative-tokens 8`, docs/speculative.md)")
    faster = {k: r for k, r in e.faster_kinds.items() if r > 1.2}
    if faster:
        best = max(faster, key=faster.get)
        step = (f"run the matmuls in {best} (this machine's {best} peak is {faster[best]:.1f}x the "
                f"{e.precision or 'current'} one): {precision_change(e, 'w8a8' if best == 'int8' else 'bf16')}")
    else:
        step = "the matmuls already run at this machine's best precision: a faster device (a GPU) is next"
    return Verdict("compute", reasons, step)


def precision_change(e: Evidence, target: str) -> str:
    """How this configuration gets to `target`: another artifact, or another precision at load."""
    if e.is_artifact:
        return f"`ladder compile --precision {target}`"
    if target in ("bf16", "fp16"):
        return f"`--dtype {target} --quantization none`"
    return f"`--quantization {target}` (applied at load, as `ladder serve` takes it)"


def fewer_bytes_step(e: Evidence) -> str:
    """The clause after the batching advice: a precision that reads fewer bytes, if this one has any."""
    if e.precision is None:
        return ", and quantize the weights (int8 and w8a8 read a quarter of fp32's bytes)"
    current = PRECISIONS[e.precision]
    if current.name == "w4a8":
        return ("; the weights are already the file's 4- to 8-bit blocks (w4a8): batching is what spreads "
                "their bytes over more tokens")
    if current.quantized:
        if e.is_artifact:
            return f"; the weights are already {current.name} (1 byte per weight)"
        ratio = e.w4a8_bytes_ratio
        if ratio is None:
            return (f"; the weights are already {current.name} (1 byte per weight): a GGUF of 4- or 5-bit blocks "
                    "(Q4_K_M, Q5_K_M, Q4_0, ...) served with `--quantization w4a8` reads 5/8 to 3/4 of that")
        if ratio <= W4A8_BYTES_AT_MOST:
            return (f"; the weights are already {current.name} (1 byte per weight): this file's own blocks, "
                    f"`--quantization w4a8`, read {ratio:.2f}x of that")
        return (f"; the weights are already {current.name} (1 byte per weight), and this file's own blocks "
                f"would read {ratio:.2f}x of that in w4a8: not enough to pay for its float work per 32 weights")
    share = {4: "a quarter", 2: "half"}.get(int(current.weight_bytes), "fewer")
    return f", and quantize the weights: {precision_change(e, 'w8a8')} reads {share} of {current.name}'s bytes"


def overhead_step(e: Evidence) -> str:
    step = ("fewer, larger steps: batch more sequences per step (raise --max-num-seqs, more concurrent "
            "requests)")
    if e.is_artifact:
        return step + "; on a GPU, graph capture removes the launch cost"
    if not e.compilable:
        return (step + "; `ladder compile` takes one attention window per step and this model's layers have two, so "
                "the Python between the eager step's operations (the step breakdown) is what is left to cut")
    if e.precision is not None and not PRECISIONS[e.precision].compiled:
        return (step + f"; `ladder compile` builds no {e.precision} artifact, so the Python between the eager "
                "step's operations (the step breakdown) is what is left to cut")
    if e.precision in (None, "fp32"):
        compiled = "compile the model (`ladder compile --backend torch-compile`)"
    else:  # the same precision, compiled: not a change of precision
        compiled = (f"compile it in the same precision (`ladder compile --backend torch-compile --precision "
                    f"{e.precision}`)")
    return step + f", and {compiled} to fuse small operations; on a GPU, graph capture removes the launch cost"


def occupancy_reasons(e: Evidence) -> list[str]:
    reasons = []
    if e.occupancy is not None and e.max_num_seqs:
        reasons.append(f"the batch ran {pct(e.occupancy)} full ({e.occupancy * e.max_num_seqs:.1f} of "
                       f"--max-num-seqs {e.max_num_seqs} sequences per step)")
    if e.num_preemptions:
        reasons.append(f"{e.num_preemptions:.0f} preemptions: the KV cache ran out of blocks")
    return reasons


def queue_step(e: Evidence) -> str:
    if e.num_preemptions:
        return "give the KV cache more memory (--kv-cache-memory) so admitted requests are not preempted"
    if e.occupancy is not None and e.occupancy >= FULL_BATCH and e.max_num_seqs is not None:
        return (f"every slot is taken: raise --max-num-seqs above {e.max_num_seqs} while the step stays "
                "under its roof, or add replicas behind the endpoint")
    return "the engine is busy with the requests it has: add replicas behind the endpoint"
