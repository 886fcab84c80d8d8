"""Three structured-output grammar engines on the default model's tokenizer, in one run: llguidance,
xgrammar and outlines-core, to choose the engine for constrained decoding.

    .venv/bin/python benchmarks/grammar_engines.py [--json /tmp/grammar_bench/grammar_engines.json]
        [--cap-s 20] [--rss-cap-mb 6000] [--min-steps 600] [--batch 32] [--skip-pathological] [--skip-imports]

ladder depends on llguidance only; install the other two first: `.venv/bin/pip install xgrammar==0.2.8
outlines-core==0.2.14`.

The tokenizer is SmolLM2-135M-Instruct's, read from the default GGUF (vocabulary 49,152, stop ids 0 and 2).
Every engine writes the same bitmask (int32 words, bit i of word j is token 32j+i) into a CPU tensor, so
mask times are comparable. JSON schemas compile in compact form (no whitespace, "," and ":"), the form
the valid texts are written in, so the engines' allowed sets can be compared token for token; json_object
mode keeps each engine's default whitespace, as it is usually served (xgrammar's compact form is broken
for values of any type: see the probes).

Per workload and engine: compile time cold and a second time (xgrammar's compiler caches; llguidance and
outlines-core have no cache, so their second time is a recompile), the cost of a fresh matcher from the
compiled form (what a server pays per request once the grammar is cached), then the per-token mask time
along a real accepted token sequence (the text tokenized as the server would): median, p99 and max over
several walks, in wall time and in the thread's CPU time (the CPU figures leave out preemption by other
processes, which sets most wall maxima on a shared machine; the first walk's maximum is in the JSON).
Correct means: every token of the valid text is in the mask and is consumed, the final mask allows a stop
token (only stop tokens where the grammar is complete), and an invalid next token is both absent from the
mask and refused.
The allowed-token count at every step is compared across engines (stop ids left out, as outlines-core takes
one EOS id only), and disagreements are listed with example tokens.

Pathological inputs (a 2,000-deep nested schema, an enum of 100,000 strings) compile in a forked child
killed after --cap-s or past --rss-cap-mb of growth; its peak RSS growth is read from /proc while it runs.
The batch section times masks for --batch rows of the small schema, rows staggered along the text, per
decode step.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import multiprocessing
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root, for its packages

from bench_report import write_report  # noqa: E402
from model.default import default_model_path  # noqa: E402
from model.gguf_checkpoint import GGUFCheckpoint  # noqa: E402
from model.tokenizer import Tokenizer  # noqa: E402

VOCAB = 49_152
STOP_IDS = (0, 2)  # <|endoftext|>, <|im_end|>
OUTLINES_EOS = 2  # outlines-core's Vocabulary takes a single EOS id


class Unsupported(Exception):
    """The engine has no way to express this workload."""


# ---------------------------------------------------------------------------------------------- workloads

SMALL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "level": {"enum": ["beginner", "intermediate", "expert"]},
        "scores": {"type": "array", "items": {"type": "number"}},
    },
    "required": ["name", "age", "level", "scores"],
    "additionalProperties": False,
}
SMALL_TEXT = {"name": "Ada Lovelace", "age": 36, "level": "expert", "scores": [9.5, 7, -3.25, 100]}


def closed(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


LARGE_SCHEMA = closed({
    "id": {"type": "integer", "minimum": 1},
    "name": {"type": "string", "minLength": 1, "maxLength": 40},
    "email": {"type": "string", "pattern": "^[a-z0-9._%+-]+@[a-z0-9.-]+\\.[a-z]{2,}$"},
    "created_at": {"type": "string", "format": "date-time"},
    "active": {"type": "boolean"},
    "score": {"type": "number"},
    "level": {"enum": ["bronze", "silver", "gold", "platinum"]},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    "nickname": {"type": ["string", "null"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "country": {"type": "string"},
    "address": closed({"street": {"type": "string"}, "city": {"type": "string"},
                       "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                       "geo": closed({"lat": {"type": "number"}, "lon": {"type": "number"}})}),
    "phone": {"type": "string"},
    "verified": {"type": "boolean"},
    "balance": {"type": "number"},
    "preferences": closed({"theme": {"enum": ["light", "dark"]}, "notifications": {"type": "boolean"},
                           "language": {"type": "string"}}),
    "roles": {"type": "array", "items": {"enum": ["admin", "editor", "viewer"]}},
    "orders": {"type": "array", "items": closed({"order_id": {"type": "integer"}, "item": {"type": "string"},
                                                  "quantity": {"type": "integer"}, "price": {"type": "number"},
                                                  "shipped": {"type": "boolean"}})},
    "notes": {"type": ["string", "null"]},
    "version": {"type": "integer"},
})
LARGE_TEXT = {
    "id": 4211, "name": "Grace Hopper", "email": "grace.hopper@navy.mil", "created_at": "2024-05-17T08:30:00Z",
    "active": True, "score": 98.25, "level": "platinum", "tags": ["cobol", "compilers", "navy"], "nickname": None,
    "age": 85, "country": "United States",
    "address": {"street": "1 Main St", "city": "Zürich", "zip": "10001", "geo": {"lat": 40.7128, "lon": -74.006}},
    "phone": "+1-555-0100", "verified": False, "balance": -12.5,
    "preferences": {"theme": "dark", "notifications": True, "language": "en-US"},
    "roles": ["admin", "viewer"],
    "orders": [{"order_id": 1, "item": "keyboard", "quantity": 2, "price": 49.99, "shipped": True},
               {"order_id": 2, "item": "monitor", "quantity": 1, "price": 199.0, "shipped": False},
               {"order_id": 3, "item": "cable", "quantity": 10, "price": 3.5, "shipped": True}],
    "notes": "call before noon", "version": 3,
}
OBJECT_TEXT = {"title": "report", "pages": 12, "draft": False, "authors": ["ann", "bo"],
               "meta": {"ratio": 0.75, "reviewed": None, "labels": {"x": 1}}}

DATE_TIME = r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z"
EMAIL = r"[a-zA-Z0-9._%+-]+@[a-zA-Z0-9-]+(\.[a-zA-Z0-9-]+)*\.[a-zA-Z]{2,}"
CHOICES = ["strongly positive", "somewhat positive", "neutral", "somewhat negative", "strongly negative"]
ARITHMETIC_LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""
ARITHMETIC_EBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9]+
"""


def compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


# name: (kind, payload, valid text, (valid prefix, invalid continuation), whether the text completes the grammar)
WORKLOADS: dict[str, tuple[str, Any, str, tuple[str, str], bool]] = {
    "1 small schema": ("json_schema", SMALL_SCHEMA, compact(SMALL_TEXT), ('{"name":"Ada","age":', '"36"'), True),
    "2 large schema": ("json_schema", LARGE_SCHEMA, compact(LARGE_TEXT),
                       ('{"id":4211,"name":"G","email":"g@x.io","created_at":"2024-05-17T08:30:00Z","active":',
                        '"yes"'), True),
    "3 any JSON object": ("json_object", None, compact(OBJECT_TEXT), ('{"a":1', ']'), True),
    "4a regex date-time": ("regex", DATE_TIME, "2024-05-17T08:30:00Z", ("2024-05-17", " "), True),
    "4b regex email": ("regex", EMAIL, "john.doe+news@mail.example.com", ("john.doe", " "), False),
    "5 choice of 5": ("choice", CHOICES, "somewhat negative", ("somewhat", " neutral"), True),
    "6 arithmetic CFG": ("grammar", (ARITHMETIC_LARK, ARITHMETIC_EBNF), "(12+3)*4-56/(7+1)", ("(12+", ")"), False),
}


# ------------------------------------------------------------------------------------------------ engines

def gpt2_byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-printable-character table that byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def byte_vocab(backend) -> list[bytes | None]:
    """Each token id's bytes; None for special tokens (the added tokens marked special)."""
    special = {t["id"] for t in json.loads(backend.to_str())["added_tokens"] if t.get("special")}
    decode = gpt2_byte_decoder()
    out: list[bytes | None] = [None] * VOCAB
    for text, i in backend.get_vocab(with_added_tokens=True).items():
        if i < VOCAB and i not in special:
            out[i] = bytes(decode[c] for c in text)
    return out


class BaseEngine:
    """One grammar engine behind the calls the benchmark makes; masks go into row 0 of a (1, VOCAB/32) tensor."""
    name = ""

    def forget(self) -> None:
        """Drops any cache of compiled grammars, so that the next compile is cold."""

    def compile(self, kind: str, payload: Any) -> Any:
        raise NotImplementedError

    def matcher(self, compiled: Any) -> Any:
        raise NotImplementedError

    def fill(self, m: Any, mask: torch.Tensor) -> None:
        raise NotImplementedError

    def consume(self, m: Any, token: int) -> bool:
        raise NotImplementedError


class LLGuidance(BaseEngine):
    name = "llguidance"

    def __init__(self, backend) -> None:
        import llguidance
        self.llg = llguidance
        self.tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=VOCAB, eos_token=list(STOP_IDS))

    def grammar(self, kind: str, payload: Any) -> str:
        matcher = self.llg.LLMatcher
        if kind == "json_schema":
            return matcher.grammar_from_json_schema(schema_text(payload), overrides={"whitespace_flexible": False})
        if kind == "json_object":  # the engine's default whitespace, as json_object mode is served
            return matcher.grammar_from_json_schema('{"type": "object"}')
        if kind == "regex":
            return matcher.grammar_from_regex(payload)
        if kind == "choice":
            return self.llg.grammar_from("choice", json.dumps(payload))
        if kind == "grammar":
            return matcher.grammar_from_lark(payload[0])
        raise Unsupported(kind)

    def compile(self, kind: str, payload: Any) -> Any:
        m = self.llg.LLMatcher(self.tokenizer, self.grammar(kind, payload), log_level=0)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return m

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, m: Any, mask: torch.Tensor) -> None:
        m.unsafe_compute_mask_ptr(mask.data_ptr(), mask.shape[1] * 4)

    def consume(self, m: Any, token: int) -> bool:
        return m.consume_token(token)


class XGrammar(BaseEngine):
    name = "xgrammar"

    def __init__(self, backend) -> None:
        import xgrammar
        self.xgr = xgrammar
        # The encoded (byte-level) vocabulary with special tokens blanked: xgrammar takes empty tokens as special
        # and never allows them; through PreTrainedTokenizerFast it would take them as text (see special_probe).
        encoded = [""] * VOCAB
        specials = {t["id"] for t in json.loads(backend.to_str())["added_tokens"] if t.get("special")}
        for text, i in backend.get_vocab(with_added_tokens=True).items():
            if i < VOCAB and i not in specials:
                encoded[i] = text
        self.info = xgrammar.TokenizerInfo(encoded, xgrammar.VocabType.BYTE_LEVEL, vocab_size=VOCAB,
                                           stop_token_ids=list(STOP_IDS), add_prefix_space=False)
        self.compiler = xgrammar.GrammarCompiler(self.info)

    def forget(self) -> None:
        # The compiler caches whole grammars and, across grammars, the token masks of shared rules: a schema
        # compiles in 0.1 s instead of 1.5 s after another with the same length-bounded string.
        self.compiler = self.xgr.GrammarCompiler(self.info)

    def compile(self, kind: str, payload: Any) -> Any:
        c = self.compiler
        if kind == "json_schema":
            return c.compile_json_schema(schema_text(payload), any_whitespace=False, separators=(",", ":"))
        if kind == "json_object":  # compact any-JSON breaks here: see probes()
            return c.compile_json_schema('{"type": "object"}')
        if kind == "regex":
            return c.compile_regex(payload)
        if kind == "choice":
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in payload))
        if kind == "grammar":
            return c.compile_grammar(payload[1])
        raise Unsupported(kind)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m: Any, mask: torch.Tensor) -> None:
        m.fill_next_token_bitmask(mask, 0)

    def consume(self, m: Any, token: int) -> bool:
        return m.accept_token(token)


class OutlinesCore(BaseEngine):
    name = "outlines-core"

    def __init__(self, backend) -> None:
        import outlines_core
        self.oc = outlines_core
        by_bytes: dict[bytes, list[int]] = {}
        for i, token in enumerate(byte_vocab(backend)):
            if token is not None:  # special tokens, the EOS among them, stay out: its constructor refuses the EOS
                by_bytes.setdefault(token, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(OUTLINES_EOS, by_bytes)

    def regex(self, kind: str, payload: Any) -> str:
        build = self.oc.json_schema.build_regex_from_schema
        if kind == "json_schema":
            return build(schema_text(payload), "")
        if kind == "json_object":
            return build('{"type": "object"}')
        if kind == "regex":
            return payload
        if kind == "choice":
            return "(" + "|".join(re.escape(s) for s in payload) + ")"
        raise Unsupported("no context-free grammars: regular languages only")

    def compile(self, kind: str, payload: Any) -> Any:
        return self.oc.Index(self.regex(kind, payload), self.vocabulary)

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def fill(self, m: Any, mask: torch.Tensor) -> None:
        m.write_mask_into(mask.data_ptr(), mask.numel(), 4)

    def consume(self, m: Any, token: int) -> bool:
        try:
            m.advance(token, return_tokens=False)
            return True
        except Exception:  # an invalid token raises
            return False


ENGINE_CLASSES = {"llguidance": LLGuidance, "xgrammar": XGrammar, "outlines-core": OutlinesCore}


# ------------------------------------------------------------------------------------------------ helpers

def allowed_ids(mask: torch.Tensor) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")[:VOCAB])


def has_bit(mask: torch.Tensor, row: int, token: int) -> bool:
    return bool((mask[row, token // 32].item() >> (token % 32)) & 1)


def schema_text(payload: Any) -> str:
    # Pathological schemas arrive as text: a 2,000-deep dict passes Python's json recursion limit.
    return payload if isinstance(payload, str) else json.dumps(payload)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def seconds(fn) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def walk(engine: BaseEngine, compiled: Any, tokens: list[int], mask: torch.Tensor, check: bool) -> dict[str, Any]:
    """Masks and consumes `tokens` one by one; with `check`, the allowed sets and the correctness facts too."""
    m = engine.matcher(compiled)
    mask_us, mask_cpu_us, consume_us, allowed, failure = [], [], [], [], None
    for step, token in enumerate(tokens):
        mask.zero_()
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        engine.fill(m, mask)
        t1 = time.perf_counter_ns()
        c1 = time.thread_time_ns()
        mask_us.append((t1 - t0) / 1e3)
        mask_cpu_us.append((c1 - c0) / 1e3)
        if check:
            ids = allowed_ids(mask)
            allowed.append(ids)
            if not has_bit(mask, 0, token):
                failure = failure or f"step {step}: token {token} not in the mask"
        t2 = time.perf_counter_ns()
        ok = engine.consume(m, token)
        consume_us.append((time.perf_counter_ns() - t2) / 1e3)
        if not ok:
            failure = f"step {step}: token {token} refused"
            break
    result: dict[str, Any] = {"mask_us": mask_us, "mask_cpu_us": mask_cpu_us, "consume_us": consume_us,
                              "failure": failure}
    if check:
        final: set[int] = set()
        if failure is None:
            mask.zero_()
            engine.fill(m, mask)
            final = set(allowed_ids(mask).tolist())
        result.update(allowed=allowed, final_allows_stop=bool(final & set(STOP_IDS)),
                      final_only_stop=bool(final) and final <= set(STOP_IDS), final_count=len(final))
    return result


def refuses(engine: BaseEngine, compiled: Any, tok: Tokenizer, prefix: str, bad: str, mask: torch.Tensor) -> str:
    """'yes' when the invalid continuation's first token is absent from the mask and refused, else what happened."""
    m = engine.matcher(compiled)
    for token in tok.encode(prefix, add_special_tokens=False) if prefix else []:
        if not engine.consume(m, token):
            return f"valid prefix {prefix!r} refused"
    bad_token = tok.encode(bad, add_special_tokens=False)[0]
    mask.zero_()
    engine.fill(m, mask)
    in_mask = has_bit(mask, 0, bad_token)
    consumed = engine.consume(m, bad_token)
    if not in_mask and not consumed:
        return "yes"
    return f"no: {tok.backend.id_to_token(bad_token)!r} in mask {in_mask}, consumed {consumed}"


# ------------------------------------------------------------------------------------------------ sections

def run_workload(name: str, engines: dict[str, BaseEngine], tok: Tokenizer, min_steps: int,
                 recompile_below_s: float) -> dict[str, Any]:
    kind, payload, text, (prefix, bad), completes = WORKLOADS[name]
    tokens = tok.encode(text, add_special_tokens=False)
    mask = torch.zeros(1, VOCAB // 32, dtype=torch.int32)
    per_engine: dict[str, dict[str, Any]] = {}
    allowed_by_engine: dict[str, list[np.ndarray]] = {}
    for ename, engine in engines.items():
        row: dict[str, Any] = {"engine": ename}
        per_engine[ename] = row
        engine.forget()
        try:
            cold_s, compiled = seconds(lambda: engine.compile(kind, payload))
        except Unsupported as e:
            row.update(supported=False, notes=f"unsupported: {e}")
            continue
        except Exception as e:
            row.update(supported=False, notes=f"compile error: {type(e).__name__}: {str(e)[:200]}")
            continue
        # Only xgrammar caches compiled grammars; for the others a second compile is a recompile, not repeated
        # when the first took long.
        second_s = seconds(lambda: engine.compile(kind, payload))[0] if cold_s < recompile_below_s else None
        matcher_us = statistics.median(seconds(lambda: engine.matcher(compiled))[0] for _ in range(5)) * 1e6
        first = walk(engine, compiled, tokens, mask, check=True)
        mask_us, mask_cpu_us, consume_us = list(first["mask_us"]), list(first["mask_cpu_us"]), list(first["consume_us"])
        for _ in range(max(4, -(-min_steps // len(tokens))) if first["failure"] is None else 0):
            again = walk(engine, compiled, tokens, mask, check=False)
            mask_us += again["mask_us"]
            mask_cpu_us += again["mask_cpu_us"]
            consume_us += again["consume_us"]
        refused = refuses(engine, compiled, tok, prefix, bad, mask)
        accepted = first["failure"] is None
        correct = (accepted and first["final_allows_stop"] and refused == "yes"
                   and (first["final_only_stop"] or not completes))
        notes = [] if accepted else [first["failure"]]
        if accepted and not first["final_allows_stop"]:
            notes.append(f"no stop allowed at the end ({first['final_count']} tokens)")
        if accepted and completes and not first["final_only_stop"]:
            notes.append(f"end mask has {first['final_count']} tokens, not only stop")
        if refused != "yes":
            notes.append(f"invalid token: {refused}")
        row.update(supported=True, compile_cold_ms=cold_s * 1e3,
                   compile_second_ms=None if second_s is None else second_s * 1e3,
                   matcher_us=matcher_us, mask_median_us=statistics.median(mask_us),
                   mask_p99_us=percentile(mask_us, 0.99), mask_max_us=max(mask_us),
                   mask_cpu_median_us=statistics.median(mask_cpu_us), mask_cpu_p99_us=percentile(mask_cpu_us, 0.99),
                   mask_cpu_max_us=max(mask_cpu_us), first_walk_mask_max_us=max(first["mask_us"]),
                   consume_median_us=statistics.median(consume_us),
                   mask_samples=len(mask_us), accepted=accepted, final_allows_stop=first["final_allows_stop"],
                   final_only_stop=first["final_only_stop"], refuses_invalid=refused, correct=correct,
                   notes="; ".join(notes))
        allowed_by_engine[ename] = first["allowed"]
    return {"workload": name, "kind": kind, "text": text, "num_tokens": len(tokens), "engines": per_engine,
            "disagreements": disagreements(allowed_by_engine, tokens, tok)}


def disagreements(allowed: dict[str, list[np.ndarray]], tokens: list[int], tok: Tokenizer) -> list[dict[str, Any]]:
    """Steps where the engines' allowed (non-stop) counts differ, with up to 4 example tokens only one side allows."""
    names = list(allowed)
    out = []
    for step in range(min((len(v) for v in allowed.values()), default=0)):
        sets = {n: set(allowed[n][step].tolist()) - set(STOP_IDS) for n in names}
        counts = {n: len(s) for n, s in sets.items()}
        if len(set(counts.values())) <= 1:
            continue
        examples = {}
        for a in names:
            for b in names:
                if a < b:
                    for x, y in ((a, b), (b, a)):
                        only = sorted(sets[x] - sets[y])[:4]
                        if only:
                            examples[f"{x} not {y}"] = [tok.backend.id_to_token(i) for i in only]
        out.append({"step": step, "after": tok.decode(tokens[:step])[-24:], "counts": counts, "examples": examples})
    return out


def run_batch(engines: dict[str, BaseEngine], tok: Tokenizer, rows: int, steps: int) -> list[dict[str, Any]]:
    """Masks for `rows` requests of the small schema per decode step, the rows staggered along the text."""
    import llguidance.torch as llg_torch
    kind, payload, text, _, _ = WORKLOADS["1 small schema"]
    tokens = tok.encode(text, add_special_tokens=False)
    threads = len(os.sched_getaffinity(0))
    results = []
    variants = []
    if "llguidance" in engines:
        executor = engines["llguidance"].llg.LLExecutor(num_threads=threads)
        variants.append(("llguidance", f"LLExecutor, {threads} threads",
                         lambda ms, mask: llg_torch.fill_next_token_bitmask_par(executor, [(m, i) for i, m in
                                                                                            enumerate(ms)], mask)))
        variants.append(("llguidance", "loop over rows", None))
    if "xgrammar" in engines:
        batcher = engines["xgrammar"].xgr.BatchGrammarMatcher(max_threads=threads)
        variants.append(("xgrammar", f"BatchGrammarMatcher, {threads} threads",
                         lambda ms, mask: batcher.batch_fill_next_token_bitmask(ms, mask)))
        variants.append(("xgrammar", "loop over rows", None))
    if "outlines-core" in engines:
        variants.append(("outlines-core", "loop over rows", None))
    for ename, how, batched in variants:
        engine = engines[ename]
        compiled = engine.compile(kind, payload)
        mask = torch.zeros(rows, VOCAB // 32, dtype=torch.int32)
        positions = [i % len(tokens) for i in range(rows)]
        matchers = []
        for p in positions:
            m = engine.matcher(compiled)
            for t in tokens[:p]:
                engine.consume(m, t)
            matchers.append(m)
        fill_ms, consume_ms, ok = [], [], True
        for _ in range(steps):
            for i, p in enumerate(positions):
                if p == len(tokens):  # finished: a new request takes the row
                    matchers[i], positions[i] = engine.matcher(compiled), 0
            mask.zero_()
            t0 = time.perf_counter_ns()
            if batched is not None:
                batched(matchers, mask)
            else:
                for i, m in enumerate(matchers):
                    engine.fill(m, mask[i:i + 1])
            t1 = time.perf_counter_ns()
            expected = [tokens[p] for p in positions]
            ok = ok and all(has_bit(mask, i, t) for i, t in enumerate(expected))
            for i, m in enumerate(matchers):
                ok = engine.consume(m, expected[i]) and ok
                positions[i] += 1
            consume_ms.append((time.perf_counter_ns() - t1) / 1e6)
            fill_ms.append((t1 - t0) / 1e6)
        results.append({"engine": ename, "how": how, "rows": rows, "steps": steps,
                        "mask_ms_median": statistics.median(fill_ms), "mask_ms_p99": percentile(fill_ms, 0.99),
                        "consume_ms_median": statistics.median(consume_ms), "all_rows_correct": ok})
    return results


def deep_schema(depth: int) -> str:
    return ('{"type":"object","properties":{"a":' * depth + '{"type":"integer"}'
            + '},"required":["a"],"additionalProperties":false}' * depth)


def big_enum(n: int) -> dict[str, Any]:
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    values = sorted({"".join(rng.choice(letters) for _ in range(rng.randint(6, 14))) for _ in range(n + n // 10)})
    return {"enum": rng.sample(values, n)}


def pathological_child(engine: BaseEngine, schema: str, conn) -> None:
    engine.forget()  # xgrammar: a compiler (and thread pool) of the child's own, none inherited mid-use
    result: dict[str, Any] = {}
    try:
        start = time.perf_counter()
        compiled = engine.compile("json_schema", schema)
        result["compile_s"] = time.perf_counter() - start
        mask = torch.zeros(1, VOCAB // 32, dtype=torch.int32)
        m = engine.matcher(compiled)
        t0 = time.perf_counter()
        engine.fill(m, mask)
        result["first_mask_ms"] = (time.perf_counter() - t0) * 1e3
        result["first_mask_count"] = len(allowed_ids(mask))
        result["outcome"] = "compiled"
    except Exception as e:
        result["outcome"] = f"refused: {type(e).__name__}: {str(e)[:160]}"
        result["refused_after_s"] = time.perf_counter() - start
    conn.send(result)


def vm_kib(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def run_pathological(engines: dict[str, BaseEngine], cap_s: float, rss_cap_mb: float) -> list[dict[str, Any]]:
    cases = {"2,000-deep nested schema": deep_schema(2000), "enum of 100,000 strings": json.dumps(big_enum(100_000))}
    ctx = multiprocessing.get_context("fork")  # the child inherits the built tokenizers instead of rebuilding
    results = []
    for case, schema in cases.items():
        for ename, engine in engines.items():
            receive, send = ctx.Pipe(duplex=False)
            start = time.perf_counter()
            child = ctx.Process(target=pathological_child, args=(engine, schema, send), daemon=True)
            child.start()
            base_kib = vm_kib(child.pid, "VmRSS")
            peak_kib = base_kib
            while child.is_alive() and time.perf_counter() - start < cap_s and not receive.poll():
                peak_kib = max(peak_kib, vm_kib(child.pid, "VmRSS"))
                if (peak_kib - base_kib) / 1024 > rss_cap_mb:
                    break
                time.sleep(0.05)
            wall = time.perf_counter() - start
            if receive.poll(0.5):
                result = receive.recv()
            else:
                over = (peak_kib - base_kib) / 1024 > rss_cap_mb
                result = {"outcome": f"killed past {rss_cap_mb:.0f} MB after {wall:.1f} s" if over
                          else f"no answer after {cap_s:.0f} s: killed" if child.is_alive()
                          else f"child died (exit {child.exitcode})"}
            if child.is_alive():
                child.kill()
            child.join()
            results.append({"case": case, "engine": ename, "wall_s": wall,
                            "peak_rss_growth_mb": (peak_kib - base_kib) / 1024, **result})
    return results


def probes(backend, engines: dict[str, BaseEngine], tok: Tokenizer) -> dict[str, Any]:
    """Four behaviours found while building this benchmark, checked on each run."""
    out: dict[str, Any] = {}
    mask = torch.zeros(1, VOCAB // 32, dtype=torch.int32)

    def accepts(engine: BaseEngine, compiled: Any, text: str) -> bool:
        m = engine.matcher(compiled)
        if not all(engine.consume(m, t) for t in tok.encode(text, add_special_tokens=False)):
            return False
        mask.zero_()
        engine.fill(m, mask)
        return any(has_bit(mask, 0, t) for t in STOP_IDS)

    def allows_after(engine: BaseEngine, compiled: Any, prefix: str, token: int) -> bool:
        m = engine.matcher(compiled)
        for t in tok.encode(prefix, add_special_tokens=False):
            engine.consume(m, t)
        mask.zero_()
        engine.fill(m, mask)
        return has_bit(mask, 0, token)

    # 1. Special tokens as text: may <|im_start|> (id 1) appear inside a JSON string?
    special = {}
    for ename, engine in engines.items():
        special[ename] = allows_after(engine, engine.compile("json_schema", SMALL_SCHEMA), '{"name":"', 1)
    if "xgrammar" in engines:  # set up the way its documentation suggests, through transformers
        import transformers
        xgr = engines["xgrammar"].xgr
        setup_s, info = seconds(lambda: xgr.TokenizerInfo.from_huggingface(
            transformers.PreTrainedTokenizerFast(tokenizer_object=backend), vocab_size=VOCAB,
            stop_token_ids=list(STOP_IDS)))
        via_hf = XGrammar.__new__(XGrammar)
        via_hf.xgr, via_hf.info, via_hf.compiler = xgr, info, xgr.GrammarCompiler(info)
        special["xgrammar via PreTrainedTokenizerFast"] = allows_after(
            via_hf, via_hf.compile("json_schema", SMALL_SCHEMA), '{"name":"', 1)
        out["xgrammar via PreTrainedTokenizerFast"] = {"setup_ms": setup_s * 1e3,
                                                      "special_token_ids": info.special_token_ids}
    out["<|im_start|> allowed inside a JSON string"] = special

    # 2. xgrammar's compact mode (separators "," and ":") for values of any type: is '{"a":"x","b":1}' accepted?
    if "xgrammar" in engines:
        xgr = engines["xgrammar"].xgr
        compiled = engines["xgrammar"].compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                                     separators=(",", ":"))
        got = {}
        for text in ('{"a":"x","b":1}', '{"a":"x", "b":1}'):
            m = xgr.GrammarMatcher(compiled)
            got[text] = m.accept_string(text) and m.is_completed()
        out["xgrammar compact any-object accepts"] = got

    # 3. JSON string rules under minLength/maxLength: an escaped quote is valid JSON, a raw tab is not.
    bounded = closed({"name": {"type": "string", "maxLength": 40}})
    got = {}
    for ename, engine in engines.items():
        compiled = engine.compile("json_schema", bounded)
        got[ename] = {text: accepts(engine, compiled, text) for text in ('{"name":"a\\"b"}', '{"name":"a\tb"}')}
    out["maxLength string accepts (escaped quote, raw tab)"] = got

    # 4. outlines-core drops a token edge that leaves an accepting state for a non-accepting one; a \z anchor
    # is the workaround. Walks a(\.b)* over "a.b" one byte-token at a time.
    if "outlines-core" in engines:
        engine = engines["outlines-core"]
        got = {}
        for regex in (r"a(\.b)*", r"a(\.b)*\z"):
            m, ok = engine.matcher(engine.compile("regex", regex)), True
            for ch in "a.b":
                ok = ok and engine.consume(m, tok.backend.token_to_id(ch))
            got[regex] = ok
        out["outlines-core accepts 'a.b' byte by byte"] = got
    return out


def summarize(disagreeing: list[dict[str, Any]]) -> dict[str, Any]:
    """Per 'x not y' pair: at how many steps x allowed tokens y did not, and some of those tokens."""
    out: dict[str, Any] = {}
    for d in disagreeing:
        for key, tokens in d["examples"].items():
            entry = out.setdefault(key, {"steps": 0, "examples": []})
            entry["steps"] += 1
            entry["examples"] += [t for t in tokens if t not in entry["examples"]][:8 - len(entry["examples"])]
    return out


def import_seconds(module: str) -> float:
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def package_facts() -> dict[str, Any]:
    facts = {}
    for dist in ("llguidance", "xgrammar", "outlines-core"):
        meta = importlib.metadata.distribution(dist)
        facts[dist] = {"version": meta.version,
                       "requires": [r for r in (meta.requires or []) if "extra ==" not in r]}
    return facts


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


# ------------------------------------------------------------------------------------------------ printing

def print_workload(result: dict[str, Any]) -> None:
    print(f"\n{result['workload']} ({result['kind']}, {result['num_tokens']} tokens)")
    header = (f"{'engine':<14} {'compile ms':>10} {'2nd ms':>8} {'matcher us':>10} | {'mask med us':>11} "
              f"{'p99':>7} {'max':>7} | {'cpu p99':>7} {'cpu max':>7} | {'correct':<7} notes")
    print(header)
    print("-" * len(header))
    for row in result["engines"].values():
        if not row["supported"]:
            dashes = f"{'-':>10} {'-':>8} {'-':>10} | {'-':>11} {'-':>7} {'-':>7} | {'-':>7} {'-':>7} | {'-':<7}"
            print(f"{row['engine']:<14} {dashes} {row['notes']}")
            continue
        second = "-" if row["compile_second_ms"] is None else f"{row['compile_second_ms']:.2f}"
        print(f"{row['engine']:<14} {row['compile_cold_ms']:>10.2f} {second:>8} {row['matcher_us']:>10.1f} | "
              f"{row['mask_median_us']:>11.1f} {row['mask_p99_us']:>7.0f} {row['mask_max_us']:>7.0f} | "
              f"{row['mask_cpu_p99_us']:>7.0f} {row['mask_cpu_max_us']:>7.0f} | "
              f"{'yes' if row['correct'] else 'NO':<7} {row['notes']}")
    if not result["disagreements"]:
        print("  allowed counts agree at every step")
        return
    print(f"  allowed counts differ at {len(result['disagreements'])} of {result['num_tokens']} steps:")
    for key, entry in summarize(result["disagreements"]).items():
        print(f"    {key}: at {entry['steps']} steps, e.g. {entry['examples']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="/tmp/grammar_bench/grammar_engines.json")
    parser.add_argument("--cap-s", type=float, default=20.0, help="limit for each pathological compile")
    parser.add_argument("--rss-cap-mb", type=float, default=6000.0, help="RSS growth that kills a pathological child")
    parser.add_argument("--min-steps", type=int, default=600, help="timed mask steps per engine and workload")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--batch-steps", type=int, default=48)
    parser.add_argument("--skip-pathological", action="store_true")
    parser.add_argument("--skip-imports", action="store_true",
                        help="skip timing each engine's import in a fresh python")
    parser.add_argument("--recompile-below-s", type=float, default=2.0,
                        help="time a second compile only when the first took less than this")
    args = parser.parse_args()
    run_start = time.perf_counter()

    load_average_start = os.getloadavg()
    load_s, tok = seconds(lambda: Tokenizer.from_gguf_metadata(GGUFCheckpoint(default_model_path()).metadata,
                                                                "default"))
    print(f"CPU {cpu_name()}, {len(os.sched_getaffinity(0))} cores, torch threads {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.2f}; tokenizer vocab {tok.vocab_size}, "
          f"stop ids {sorted(tok.stop_token_ids)}, loaded from the GGUF in {load_s:.1f} s")
    facts = package_facts()
    imports = {} if args.skip_imports else {m: import_seconds(m) for m in ("llguidance", "xgrammar", "outlines_core")}

    engines: dict[str, BaseEngine] = {}
    setup: dict[str, Any] = {}
    print(f"\n{'engine':<14} {'version':<8} {'import s':>8} {'tokenizer setup ms':>18}  requires")
    for ename, cls in ENGINE_CLASSES.items():
        module = ename.replace("-", "_")
        try:
            importlib.import_module(module)  # imported here so that the setup time below is the setup alone
            setup_s, engines[ename] = seconds(lambda: cls(tok.backend))
            setup[ename] = {"setup_ms": setup_s * 1e3}
            shown = f"{setup_s * 1e3:>18.0f}"
        except Exception as e:
            setup[ename] = {"error": f"{type(e).__name__}: {e}"}
            shown = f"{'FAILED':>18}"
        import_s = imports.get(module)
        print(f"{ename:<14} {facts[ename]['version']:<8} {'-' if import_s is None else f'{import_s:.2f}':>8} "
              f"{shown}  {', '.join(facts[ename]['requires']) or '(none)'}")
        if "error" in setup[ename]:
            print(f"  {ename} could not be set up: {setup[ename]['error']}")

    probe = probes(tok.backend, engines, tok)
    print()
    for key, value in probe.items():
        print(f"{key}: {value}")

    workloads = [run_workload(name, engines, tok, args.min_steps, args.recompile_below_s) for name in WORKLOADS]
    for result in workloads:
        print_workload(result)

    pathological = [] if args.skip_pathological else run_pathological(engines, args.cap_s, args.rss_cap_mb)
    if pathological:
        print(f"\n7 pathological (each in a forked child, killed after {args.cap_s:.0f} s)")
        header = f"{'case':<26} {'engine':<14} {'wall s':>7} {'peak RSS +MB':>12} {'1st mask ms':>11}  outcome"
        print(header)
        print("-" * len(header))
        for r in pathological:
            first_mask = f"{r['first_mask_ms']:.1f}" if "first_mask_ms" in r else "-"
            print(f"{r['case']:<26} {r['engine']:<14} {r['wall_s']:>7.2f} {r['peak_rss_growth_mb']:>12.0f} "
                  f"{first_mask:>11}  {r['outcome']}")

    batch = run_batch(engines, tok, args.batch, args.batch_steps)
    print(f"\nbatch: {args.batch} rows of the small schema, masks per decode step")
    header = f"{'engine':<14} {'how':<36} {'mask ms med':>11} {'p99':>7} {'consume ms':>10} {'correct':>7}"
    print(header)
    print("-" * len(header))
    for r in batch:
        print(f"{r['engine']:<14} {r['how']:<36} {r['mask_ms_median']:>11.3f} {r['mask_ms_p99']:>7.3f} "
              f"{r['consume_ms_median']:>10.3f} {'yes' if r['all_rows_correct'] else 'NO':>7}")

    total_s = time.perf_counter() - run_start
    print(f"\nwhole run {total_s:.0f} s; load average (1, 5, 15 min) at the start {load_average_start}, "
          f"at the end {os.getloadavg()}")
    for result in workloads:  # the first 20 disagreeing steps in full, all of them summarized
        result["disagreement_summary"] = summarize(result["disagreements"])
        result["num_disagreeing_steps"] = len(result["disagreements"])
        result["disagreements"] = result["disagreements"][:20]
    write_report(args.json, workloads, cpu=cpu_name(), packages=facts, import_s=imports, setup=setup,
                 tokenizer_load_s=load_s, probes=probe, pathological=pathological, batch=batch,
                 json_mode="schemas compact (no whitespace, separators ',' and ':'); json_object each engine's default",
                 load_average_start=load_average_start, load_average_end=os.getloadavg(), total_s=total_s)


if __name__ == "__main__":
    main()
