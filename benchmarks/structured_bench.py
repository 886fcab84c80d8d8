"""What structured outputs cost: decode tokens/s of JSON-schema-guided requests against unguided ones,
and the time to first token with a cached schema against none, on the same engine in one run.

    .venv/bin/python benchmarks/structured_bench.py [--model PATH] [--quantization auto] [--batches 1,32]
                                                    [--tokens 64] [--rounds 3] [--out benchmarks/results/structured.json]

Every request decodes exactly --tokens tokens: unguided ones ignore EOS, guided ones follow a schema (a
list of records) that cannot be complete sooner, so both kinds do the same steps; a guided row pays its
mask (computed on a worker thread while the forward pass runs) and its masked sampling. Rounds alternate
unguided and guided; the table gives medians over rounds and the ratio. TTFT: one request alone, prompt
of ~40 tokens, 1 output token, guided by a schema already compiled (its compile is timed separately),
alternated with unguided, median over --ttft-reps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from bench_report import write_report  # benchmarks/, this script's directory
from engine.config import EngineConfig
from engine.guide import Guide, GuideCompiler
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

RECORDS = {
    "type": "array", "minItems": 64,
    "items": {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "tags"],
              "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                             "tags": {"type": "array", "items": {"type": "string"}}}},
}
PROMPT = ("Write a JSON list of people, each with a name, an age, a city and some tags, for a test database of "
          "a small company's customers.")


def run_batch(engine: LLMEngine, batch: int, params: SamplingParams) -> tuple[float, int]:
    """Seconds and output tokens for `batch` copies of the prompt decoded together."""
    ids = engine.tokenizer.encode(PROMPT)
    for i in range(batch):
        engine.add_request(f"b{time.monotonic_ns()}-{i}", ids, params.replace(seed=i))
    tokens = 0
    start = time.perf_counter()
    while engine.has_unfinished():
        for delta in engine.step():
            tokens += len(delta.token_ids)
            if delta.error:
                raise RuntimeError(delta.error)
    return time.perf_counter() - start, tokens


def first_token_seconds(engine: LLMEngine, params: SamplingParams) -> float:
    ids = engine.tokenizer.encode(PROMPT)
    start = time.perf_counter()
    engine.add_request(f"t{time.monotonic_ns()}", ids, params)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF directory or GGUF file (default: the embedded model)")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ttft-reps", type=int, default=15)
    parser.add_argument("--out", default="benchmarks/results/structured.json")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    engine = LLMEngine(EngineConfig(model=args.model, quantization=args.quantization,
                                    max_num_seqs=max(batches), kv_cache_memory_gib=0.5))
    guide = Guide.json_schema(RECORDS)
    cold = time.perf_counter()
    engine.guides.compile(guide)
    cold = time.perf_counter() - cold
    fresh = GuideCompiler(engine.tokenizer, engine.model.config.vocab_size)
    fresh.compile(Guide.regex("x"))  # its tokenizer built, so the next line times the schema alone
    compile_only = time.perf_counter()
    fresh.compile(guide)
    compile_only = time.perf_counter() - compile_only
    cached = time.perf_counter()
    engine.guides.compile(guide)
    cached = time.perf_counter() - cached

    plain = SamplingParams(temperature=0.8, max_tokens=args.tokens, ignore_eos=True)
    guided = plain.replace(ignore_eos=False, guide=guide)
    run_batch(engine, 2, plain)  # warm-up
    run_batch(engine, 2, guided)
    rows = []
    print(f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}; schema compile: first "
          f"{cold * 1e3:.1f} ms (with the vocabulary's set-up), alone {compile_only * 1e3:.2f} ms, "
          f"cached {cached * 1e6:.0f} us")
    header = f"{'batch':>5} {'unguided tok/s':>15} {'guided tok/s':>13} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    for batch in batches:
        rates = {"unguided": [], "guided": []}
        for _ in range(args.rounds):
            for name, params in (("unguided", plain), ("guided", guided)):
                seconds, tokens = run_batch(engine, batch, params)
                if tokens != batch * args.tokens:
                    raise RuntimeError(f"{name}: {tokens} tokens, expected {batch * args.tokens}")
                rates[name].append(tokens / seconds)
        unguided, guided_rate = statistics.median(rates["unguided"]), statistics.median(rates["guided"])
        rows.append({"batch": batch, "unguided_tok_s": unguided, "guided_tok_s": guided_rate,
                     "ratio": guided_rate / unguided, "rounds": rates})
        print(f"{batch:>5} {unguided:>15.1f} {guided_rate:>13.1f} {guided_rate / unguided:>5.2f}x")

    one = SamplingParams(temperature=0.0, max_tokens=1)
    ttft = {"unguided": [], "guided": []}
    for _ in range(args.ttft_reps):
        ttft["unguided"].append(first_token_seconds(engine, one))
        ttft["guided"].append(first_token_seconds(engine, one.replace(guide=guide)))
    plain_ttft, guided_ttft = statistics.median(ttft["unguided"]), statistics.median(ttft["guided"])
    print(f"TTFT (1 request, cached schema): unguided {plain_ttft * 1e3:.1f} ms, guided {guided_ttft * 1e3:.1f} ms, "
          f"+{(guided_ttft - plain_ttft) * 1e3:.1f} ms")
    write_report(args.out, rows, tokens=args.tokens, compile_first_ms=cold * 1e3, compile_ms=compile_only * 1e3,
                 compile_cached_us=cached * 1e6, ttft_unguided_ms=plain_ttft * 1e3, ttft_guided_ms=guided_ttft * 1e3,
                 ttft_samples=ttft, quantization=engine.model.quantization)


if __name__ == "__main__":
    main()
