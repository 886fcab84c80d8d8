"""How closely `ladder loadtest` reads a server's true timing on this machine.

    python benchmarks/loadtest_accuracy.py [--out benchmarks/results/loadtest_accuracy.json]

The test server (tests/support/fake_openai_server.py, a process of its own) answers with a known time to first
token and inter-token latency; the load test runs against it closed loop and open loop, and the table
gives each figure's median beside the true value and their ratio. The excess is the client's and the
machine's. The tests check the same logic exactly on a virtual clock (tests/loadtest/test_loadtest_timing.py);
this is the wall-clock side, which depends on how busy the machine is and so is no test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

from fake_openai_server import FakeServerProcess  # noqa: E402

from loadtest.cli import add_parser, config_from_args  # noqa: E402
from loadtest.measure import measure  # noqa: E402

TTFT, ITL, OUTPUT_LEN = 0.2, 0.02, 16
RUNS = {
    "closed loop, 4 users": ["--max-concurrency", "4", "--num-requests", "32"],
    "open loop, 10 req/s": ["--request-rate", "10", "--burstiness", "1000", "--num-requests", "40"],
}


def run(url: str, flags: list[str]):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["loadtest", "--base-url", url, "--quiet", "--input-len", "32",
                              "--output-len", str(OUTPUT_LEN), *flags])
    [point] = asyncio.run(measure(config_from_args(args))).points
    return point.summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/loadtest_accuracy.json"))
    out = parser.parse_args().out
    truth = {"ttft": TTFT * 1e3, "tpot": ITL * 1e3, "itl": ITL * 1e3, "e2e": (TTFT + (OUTPUT_LEN - 1) * ITL) * 1e3}
    server = FakeServerProcess()
    rows = []
    try:
        for name, flags in RUNS.items():
            server.configure(ttft=TTFT, itl=ITL)
            summary = run(server.url, flags)
            for metric, true_ms in truth.items():
                median = getattr(summary, f"{metric}_ms").median
                rows.append({"run": name, "metric": metric, "true_ms": true_ms, "median_ms": median,
                             "ratio": median / true_ms})
            if summary.send_lag_ms is not None:
                rows.append({"run": name, "metric": "send lag", "true_ms": 0.0,
                             "median_ms": summary.send_lag_ms.median, "ratio": None})
    finally:
        server.close()
    print(f"{'run':<22} {'metric':<9} {'true ms':>8} {'median ms':>10} {'ratio':>7}")
    for row in rows:
        ratio = "" if row["ratio"] is None else f"{row['ratio']:.3f}"
        print(f"{row['run']:<22} {row['metric']:<9} {row['true_ms']:>8.1f} {row['median_ms']:>10.2f} {ratio:>7}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
