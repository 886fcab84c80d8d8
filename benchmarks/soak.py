"""Soak a real `ladder serve` process at ~80% of its measured capacity with a mix of requests, then
SIGKILL it under load and restart it. Asserts nothing lost; writes soak.json and soak.png.

Mix: of every 20 requests one is bad (it must get a 4xx: malformed, oversized, a lone surrogate, 65,536
empty content parts, 5 MB sent chunked), two are streams the client drops early, and one samples with
values at the schema's edges (it must be answered in full); the rest are streaming, non-streaming, n > 1, stop strings and chat. At the end: 0 unexpected errors, every accepted request
answered in full, 0 KV blocks held, resident memory over the last third (at most 10 minutes) grown < 5%.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
BAD = [  # (body, path): each must be refused with a 4xx
    ({"prompt": ["a"] * 5000, "max_tokens": 1}, "/v1/completions"),
    ({"prompt": [1] * 200_000, "max_tokens": 1}, "/v1/completions"),
    ({"prompt": "hi", "max_tokens": -3}, "/v1/completions"),
    ({"prompt": "hi", "n": 1000}, "/v1/completions"),
    ({"prompt": "hi", "stop": ["x" * 5000]}, "/v1/completions"),
    ({"prompt": "hi", "model": "no-such-model"}, "/v1/completions"),
    ({"messages": [{"role": "user", "content": "a"}] * 5000}, "/v1/chat/completions"),
    ({"messages": [{"role": "wizard", "content": "a"}]}, "/v1/chat/completions"),
    ("{not json", "/v1/completions"),
    ('{"messages": [{"role": "user", "content": "hi \\ud800"}]}', "/v1/chat/completions"),  # a lone surrogate
    ('{"prompt": "a \\udfff b", "max_tokens": 2}', "/v1/completions"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 1024}] * 64},
     "/v1/chat/completions"),  # 65,536 empty content parts
    (b"chunked", "/v1/completions"),  # 5 MB sent chunked, no content-length: 413
]
# Values the schema accepts at its edges, each of which once crashed the sampler or gave garbage: every
# one must be answered in full (200), and the requests around it must not notice.
EXTREME = [
    {"top_p": 0.9, "repetition_penalty": 1e-300},
    {"top_p": 1e-50},
    {"top_p": 5e-324, "temperature": 2.0, "min_p": 1.0},
    {"repetition_penalty": 5e-324, "temperature": 1e-5, "logprobs": 20},
    {"presence_penalty": -2.0, "frequency_penalty": 2.0, "repetition_penalty": 2.0, "top_k": 2**62, "n": 2},
    {"seed": -(2**63), "temperature": 2.0, "top_p": 2.2250738585072014e-308, "logprobs": 5, "stream": True},
]


async def chunked_body(size: int = 5 << 20, chunk: int = 64 << 10):
    """A JSON-looking body of `size` bytes sent in chunks: httpx declares no content-length for it."""
    yield b'{"prompt": "'
    for _ in range(size // chunk):
        yield b"a" * chunk
    yield b'"}'
WORDS = "the of and to in is that for it as was with be by on not he this are or his from at which".split()


class Server:
    def __init__(self, args: argparse.Namespace, log: Path) -> None:
        self.port = args.port
        self.url = f"http://127.0.0.1:{self.port}"
        model = ["--model", args.model] if args.model else []
        cmd = [sys.executable, "-m", "ladder.cli", "serve", "--port", str(self.port), *model,
               "--max-model-len", "512", "--kv-cache-memory", str(args.kv_cache_memory), "--max-queue", "256"]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("a"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited with {self.proc.returncode}; see {log}")
            try:
                if httpx.get(self.url + "/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise SystemExit("server not ready after 300 s")

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def metrics(self) -> dict[str, float]:
        values = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def good_request(rng: random.Random) -> tuple[str, dict, str]:
    """(kind, body, path) of an ordinary request."""
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60)))
    body = {"prompt": prompt, "max_tokens": rng.randint(8, 48), "temperature": rng.choice([0.0, 0.8])}
    kind = rng.choices(["stream", "plain", "n", "stop", "chat"], [40, 25, 10, 10, 15])[0]
    if kind == "stream":
        body["stream"] = True
    elif kind == "n":
        body["n"] = rng.randint(2, 3)
    elif kind == "stop":
        body.update(stop=[" the", " and"], stream=rng.random() < 0.5)
    elif kind == "chat":
        return kind, {"messages": [{"role": "user", "content": prompt}], "max_tokens": body["max_tokens"],
                      "stream": rng.random() < 0.5}, "/v1/chat/completions"
    return kind, body, "/v1/completions"


async def one(client: httpx.AsyncClient, url: str, index: int, rng: random.Random, record: list[dict]) -> None:
    """Request `index` of the run: of every 20, the first is bad and the next two disconnect (5% and 10%)."""
    slot = index % 20
    start = time.perf_counter()
    entry: dict = {"start": start}
    try:
        if slot == 0:
            body, path = rng.choice(BAD)
            content = chunked_body() if body == b"chunked" else body if isinstance(body, str) else json.dumps(body)
            response = await client.post(url + path, content=content, headers={"content-type": "application/json"})
            entry.update(kind="bad", status=response.status_code, ok=400 <= response.status_code < 500)
        elif slot == 3:
            body = {"prompt": " ".join(rng.choice(WORDS) for _ in range(8)), "max_tokens": 16, **rng.choice(EXTREME)}
            entry["kind"] = "extreme"
            if body.get("stream"):
                async with client.stream("POST", url + "/v1/completions", json=body) as response:
                    lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
                entry["status"] = response.status_code
                entry["ok"] = response.status_code == 429 or (
                    response.status_code == 200 and lines[-1] == "data: [DONE]" and '"error"' not in lines[-2])
            else:
                response = await client.post(url + "/v1/completions", json=body)
                entry["status"] = response.status_code
                entry["ok"] = response.status_code == 429 or (
                    response.status_code == 200 and all(c["finish_reason"] for c in response.json()["choices"]))
        elif slot <= 2:
            kind, body, path = good_request(rng)
            body["stream"], body["max_tokens"] = True, 64
            async with client.stream("POST", url + path, json=body) as response:
                entry.update(kind="disconnect", status=response.status_code, ok=response.status_code in (200, 429))
                async for _ in response.aiter_lines():
                    if time.perf_counter() - start > rng.uniform(0.0, 0.5):
                        break  # the client goes away mid-stream
        else:
            kind, body, path = good_request(rng)
            entry["kind"] = kind
            if body.get("stream"):
                async with client.stream("POST", url + path, json=body) as response:
                    lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
                entry["status"] = response.status_code
                entry["ok"] = response.status_code == 429 or (
                    response.status_code == 200 and lines[-1] == "data: [DONE]" and '"error"' not in lines[-2])
            else:
                response = await client.post(url + path, json=body)
                entry["status"] = response.status_code
                entry["ok"] = response.status_code == 429 or (
                    response.status_code == 200 and all(c["finish_reason"] for c in response.json()["choices"]))
    except httpx.HTTPError as error:
        entry.update(status=None, ok=False, error=type(error).__name__)
    entry["seconds"] = time.perf_counter() - start
    record.append(entry)


async def drive(url: str, rate: float | None, concurrency: int, seconds: float, seed: int, on_tick=None
                ) -> list[dict]:
    """Open loop at `rate` req/s (Poisson), or closed loop of `concurrency` users when rate is None."""
    rng = random.Random(seed)
    record: list[dict] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        end = time.perf_counter() + seconds
        tasks: set[asyncio.Task] = set()
        next_tick = time.perf_counter()
        counter = itertools.count()
        if rate is None:
            async def user(i: int) -> None:
                user_rng = random.Random(seed * 1000 + i)
                while time.perf_counter() < end:
                    await one(client, url, next(counter), user_rng, record)

            await asyncio.gather(*(user(i) for i in range(concurrency)))
            return record
        next_send = time.perf_counter()
        while time.perf_counter() < end:
            now = time.perf_counter()
            if now >= next_send:
                task = asyncio.create_task(one(client, url, next(counter), random.Random(rng.random()), record))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                next_send += rng.expovariate(rate)
            if on_tick is not None and now >= next_tick:
                on_tick(record)
                next_tick = now + 2.0
            await asyncio.sleep(max(0.0, min(next_send, next_tick) - time.perf_counter()))
        await asyncio.gather(*tasks)
    return record


def kill_under_load(args: argparse.Namespace, server: Server, out: Path, log: Path) -> dict:
    """SIGKILL the server while `ladder loadtest` drives it; the load test must report the failures, and
    a restarted server must answer."""
    lt = subprocess.Popen([sys.executable, "-m", "loadtest", "--base-url", server.url, "--request-rate", "4",
                           "--duration", "10", "--input-len", "32", "--output-len", "64", "--quiet",
                           "--out", str(out / "killed-loadtest")], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    time.sleep(5)  # the load test's start-up, then a few seconds of load
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(30)
    report, _ = lt.communicate(timeout=300)
    results = json.loads((out / "killed-loadtest" / "results.json").read_text())
    failed_line = next((line for line in report.splitlines() if "failed" in line), "")
    restarted = Server(args, log)
    answer = httpx.post(restarted.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
    restarted.stop()
    failed = re.search(r"(\d+) failed", failed_line)
    text = json.dumps(results)
    reported = failed is not None and int(failed.group(1)) > 0
    return {"loadtest_exit": lt.returncode, "loadtest_requests_line": failed_line.strip(),
            "loadtest_error_kinds_seen": [k for k in ("connection_error", "broken_stream") if k in text],
            "restarted_status": answer.status_code, "ok": reported and answer.status_code == 200}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--model", default=None, help="HF directory or GGUF (default: the embedded default)")
    parser.add_argument("--port", type=int, default=8931)
    parser.add_argument("--kv-cache-memory", type=float, default=0.1)
    parser.add_argument("--capacity-seconds", type=float, default=20.0)
    parser.add_argument("--load", type=float, default=0.8, help="fraction of the measured capacity to offer")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "soak"))
    parser.add_argument("--no-kill", action="store_true", help="skip the SIGKILL-under-load phase")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "server.log"
    log.write_text("")
    server = Server(args, log)
    try:
        warm = asyncio.run(drive(server.url, None, 8, args.capacity_seconds, args.seed + 1))
        served = [r for r in warm if r["kind"] not in ("bad", "disconnect") and r["status"] == 200]
        capacity = len(served) / args.capacity_seconds
        rate = args.load * capacity
        print(f"capacity {capacity:.2f} req/s (8 users, {args.capacity_seconds:.0f} s); soaking at {rate:.2f} req/s "
              f"for {args.minutes:g} min", flush=True)
        samples: list[dict] = []
        t0 = time.perf_counter()

        def tick(record: list[dict]) -> None:
            m = server.metrics()
            recent = sorted(r["seconds"] for r in record if r.get("kind") not in ("bad", "disconnect")
                            and r["start"] > time.perf_counter() - 30)
            samples.append({"t": time.perf_counter() - t0, "rss_mib": server.rss_mib(),
                            "kv_used": m["ladder_kv_cache_blocks"] - m["ladder_kv_cache_free_blocks"],
                            "p50_s": recent[len(recent) // 2] if recent else None,
                            "p99_s": recent[int(len(recent) * 0.99)] if recent else None})

        record = asyncio.run(drive(server.url, rate, 0, args.minutes * 60, args.seed, tick))
        time.sleep(1.0)
        m = server.metrics()
        leaked = m["ladder_kv_cache_blocks"] - m["ladder_kv_cache_free_blocks"]
        window = min(600.0, samples[-1]["t"] / 3)
        tail = [s["rss_mib"] for s in samples if s["t"] >= samples[-1]["t"] - window]
        first, last = statistics.median(tail[:3]), statistics.median(tail[-3:])
        growth = (last - first) / first
        unexpected = [r for r in record if not r["ok"]]
        kinds = {k: sum(r["kind"] == k for r in record) for k in sorted({r.get("kind", "?") for r in record})}
        statuses: dict[str, dict[str, int]] = {}  # kind -> status (or the client's error) -> count
        for r in record:
            status = str(r["status"]) if r["status"] is not None else r.get("error", "none")
            counts = statuses.setdefault(r.get("kind", "?"), {})
            counts[status] = counts.get(status, 0) + 1
        server_errors = sum(1 for r in record if r["status"] is not None and r["status"] >= 500)
        result = {"minutes": args.minutes, "capacity_req_s": capacity, "rate_req_s": rate, "requests": len(record),
                  "kinds": kinds, "statuses": statuses, "server_errors_5xx": server_errors, "refused_429": sum(r["status"] == 429 for r in record),
                  "unexpected": len(unexpected), "unexpected_examples": unexpected[:5],
                  "kv_blocks_held_at_end": leaked, "rss_growth_last_window": growth, "rss_window_s": window,
                  "rss_start_mib": samples[0]["rss_mib"], "rss_end_mib": samples[-1]["rss_mib"], "samples": samples}
    except BaseException:
        server.stop()
        raise
    result["kill"] = None if args.no_kill else kill_under_load(args, server, out, log)
    server.stop()
    checks = {"0 unexpected errors": result["unexpected"] == 0, "0 5xx": result["server_errors_5xx"] == 0,
              "0 KV blocks held": leaked == 0,
              "memory flat (< 5%)": growth < 0.05,
              "SIGKILL reported, restart answers": args.no_kill or result["kill"]["ok"]}
    result["checks"] = checks
    (out / "soak.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(samples, out / "soak.png")
    print(f"{'requests':<34}{len(record)} ({', '.join(f'{k} {v}' for k, v in kinds.items())})")
    print(f"{'refused 429':<34}{result['refused_429']}")
    for kind, counts in statuses.items():
        print(f"{'  ' + kind:<34}{', '.join(f'{k}: {v}' for k, v in sorted(counts.items()))}")
    print(f"{'unexpected errors':<34}{result['unexpected']}")
    print(f"{'KV blocks held at the end':<34}{leaked:.0f}")
    print(f"{'RSS start / end':<34}{samples[0]['rss_mib']:.0f} / {samples[-1]['rss_mib']:.0f} MiB "
          f"(last {window:.0f} s: {growth:+.1%})")
    if result["kill"]:
        print(f"{'SIGKILL under load':<34}loadtest: {result['kill']['loadtest_requests_line']}; restarted server "
              f"answered {result['kill']['restarted_status']}")
    for name, passed in checks.items():
        print(f"{'PASS' if passed else 'FAIL'}  {name}")
    print(f"wrote {out / 'soak.json'} and {out / 'soak.png'}")
    return 0 if all(checks.values()) else 1


def plot(samples: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t"] / 60 for s in samples]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(t, [s["rss_mib"] for s in samples], label="server RSS (MiB)")
    top.set_ylabel("MiB")
    top.legend(loc="lower right")
    bottom.plot(t, [s["p50_s"] for s in samples], label="latency p50 (s, last 30 s)")
    bottom.plot(t, [s["p99_s"] for s in samples], label="latency p99 (s, last 30 s)")
    bottom.set_xlabel("minutes")
    bottom.set_ylabel("seconds")
    bottom.legend(loc="upper right")
    fig.suptitle("ladder soak: memory and latency over time")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
