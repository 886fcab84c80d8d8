"""The server's resident memory (RSS) under 40 concurrent chat requests whose bodies are as large as the
limits allow, against the same server idle.

    python benchmarks/request_memory.py [--root CHECKOUT] [--scenarios many-parts,max-body] [--concurrency 40]

Each scenario starts a fresh `ladder serve` of a tiny random model with SmolLM2's real tokenizer and chat
template (tests/support/tiny_models.py), so the figures are the server's, not a model's. Scenarios:
- `many-parts`: about 155,000 empty text parts (`{"type": "text", "text": ""}`) filling a 4 MiB body,
  spread over 152 messages (the per-message bounds allowed that; the per-request bound refuses it);
- `max-body`: the most content parts one request may carry (server/protocol.py MAX_TOTAL_CONTENT_PARTS),
  plus an ignored field that fills the body up to the 4 MiB limit.
The 40 requests are sent at once (non-streaming, `ignore_eos`); the engine runs 4 at a time, so the rest
wait in its queue and all of them are held together. RSS is sampled every 20 ms from /proc: "held" is its
median once every request is in the engine (running or waiting, from /metrics), what the server keeps
through the generation; "done" is the RSS once every response is out (what the allocator kept). `--root`
runs the server from another checkout (e.g. `git archive` of an older commit unpacked somewhere, for a
before/after pair). Prints a table and writes JSON (default benchmarks/results/request_memory/<label>.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))

from server_process import free_port

BODY_LIMIT = 4 << 20
PART = {"type": "text", "text": ""}


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def compact(body: dict) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def many_parts_body(max_tokens: int) -> bytes:
    """As many empty parts as a 4 MiB body holds, 1,020 a message."""
    per_message, num_messages = 1020, 152
    message = {"role": "user", "content": [PART] * per_message}
    body = compact({"messages": [message] * num_messages, "max_tokens": max_tokens, "ignore_eos": True})
    assert len(body) <= BODY_LIMIT, len(body)
    return body


def max_body_body(max_tokens: int, num_parts: int) -> bytes:
    """`num_parts` empty parts over two messages, padded to just under the body limit with an ignored field."""
    half = num_parts // 2
    messages = [{"role": "user", "content": [PART] * half}, {"role": "user", "content": [PART] * (num_parts - half)}]
    body = {"messages": messages, "max_tokens": max_tokens, "ignore_eos": True, "padding": ""}
    room = BODY_LIMIT - len(compact(body)) - 64
    body["padding"] = "x" * room
    return compact(body)


class Sampler:
    """RSS of `pid` every `interval` seconds on a thread, with the time of each sample."""

    def __init__(self, pid: int, interval: float = 0.02) -> None:
        self.pid, self.interval = pid, interval
        self.samples: list[tuple[float, int]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.samples.append((time.monotonic(), rss_bytes(self.pid)))
            except (OSError, RuntimeError):
                return
            time.sleep(self.interval)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()

    def peak(self) -> int:
        return max(rss for _, rss in self.samples)

    def since(self, start: float) -> list[int]:
        return [rss for t, rss in self.samples if t >= start]


def in_engine(url: str) -> float:
    """Requests running or waiting in the engine; 0 while the server is too busy to answer (parsing)."""
    try:
        text = httpx.get(url + "/metrics", timeout=30).text
    except httpx.HTTPError:
        return 0.0
    total = 0.0
    for line in text.splitlines():
        if line.startswith(("ladder_num_requests_running ", "ladder_num_requests_waiting ")):
            total += float(line.split()[1])
    return total


async def send_all(url: str, body: bytes, concurrency: int) -> list[int]:
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def one() -> int:
            response = await client.post(url + "/v1/chat/completions", content=body,
                                         headers={"content-type": "application/json"})
            return response.status_code

        return list(await asyncio.gather(*(one() for _ in range(concurrency))))


def run_scenario(name: str, body: bytes, args: argparse.Namespace, model: Path, log: Path) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "ladder.cli", "serve", "--model", str(model), "--port", str(port),
           "--max-model-len", "1024", "--kv-cache-memory", "0.05", "--max-num-seqs", str(args.max_num_seqs),
           "--quantization", "none", "--log-level", "warning"]
    env = {k: v for k, v in os.environ.items() if k != "LADDER_API_KEY"}
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=args.root, env=env)
    try:
        deadline = time.monotonic() + 900  # a first start may build the CPU kernels
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"ladder serve exited with {proc.returncode}: {log.read_text()[-1500:]}")
            try:
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"not ready: {log.read_text()[-1500:]}")
            time.sleep(0.2)
        # One small request first, so that first-use allocations (tokenizer caches, torch workspaces)
        # count as idle, not as the load's.
        httpx.post(url + "/v1/chat/completions", timeout=120,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        time.sleep(1.0)
        idle = rss_bytes(proc.pid)
        sampler = Sampler(proc.pid)
        result: dict = {}
        sender = threading.Thread(target=lambda: result.update(
            statuses=asyncio.run(send_all(url, body, args.concurrency))), daemon=True)
        start = time.monotonic()
        sender.start()
        all_in = None
        while sender.is_alive():
            if all_in is None and in_engine(url) >= args.concurrency:
                all_in = time.monotonic()
            time.sleep(0.05)
        sender.join()
        sampler.close()
        time.sleep(1.0)
        done = rss_bytes(proc.pid)  # what the allocator kept once every response is out
        held = sampler.since(all_in) if all_in is not None else []
        statuses = result.get("statuses", [])
        return {
            "scenario": name, "body_bytes": len(body), "concurrency": args.concurrency,
            "statuses": {str(s): statuses.count(s) for s in sorted(set(statuses))},
            "idle_rss_mib": idle / 2**20, "peak_rss_mib": sampler.peak() / 2**20,
            "held_rss_mib": (sorted(held)[len(held) // 2] / 2**20) if held else None,
            "done_rss_mib": done / 2**20,
            "all_in_engine_after_s": (all_in - start) if all_in is not None else None,
            "seconds": time.monotonic() - start,
        }
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose server runs (default: this one)")
    parser.add_argument("--label", default="current", help="names the JSON file")
    parser.add_argument("--scenarios", default="many-parts,max-body")
    parser.add_argument("--concurrency", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=200, help="tokens each request generates")
    parser.add_argument("--max-num-seqs", type=int, default=4,
                        help="sequences the engine runs at once: the rest of the requests wait in its queue, so all "
                             "of them are held by the server together however long parsing them takes")
    parser.add_argument("--num-parts", type=int, default=2048, help="content parts of the max-body scenario")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/request_memory")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.out / "tiny-chat"
    if not (model / "config.json").exists():
        from tiny_models import make_tiny_chat_model

        make_tiny_chat_model(model)
    bodies = {"many-parts": lambda: many_parts_body(args.max_tokens),
              "max-body": lambda: max_body_body(args.max_tokens, args.num_parts)}
    rows = []
    for name in args.scenarios.split(","):
        rows.append(run_scenario(name, bodies[name](), args, model, args.out / f"{args.label}-{name}.log"))
    print(f"{'scenario':<12} {'body MiB':>8} {'statuses':<14} {'idle MiB':>9} {'held MiB':>9} {'held-idle':>9} "
          f"{'peak MiB':>9} {'done MiB':>9}")
    for r in rows:
        idle, held = r["idle_rss_mib"], r["held_rss_mib"]
        held_text, grown = ("-", "-") if held is None else (f"{held:.0f}", f"{held - idle:.0f}")
        print(f"{r['scenario']:<12} {r['body_bytes'] / 2**20:>8.2f} {json.dumps(r['statuses']):<14} "
              f"{idle:>9.0f} {held_text:>9} {grown:>9} {r['peak_rss_mib']:>9.0f} {r['done_rss_mib']:>9.0f}")
    path = args.out / f"{args.label}.json"
    path.write_text(json.dumps({"label": args.label, "root": str(args.root), "rows": rows}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
