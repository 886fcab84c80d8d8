"""The side-by-side table of benchmarks/peer_llamacpp.sh: one row per concurrency, llama.cpp's server and
ladder serve, from the results.json each `ladder loadtest` run wrote; also writes peer_table.json.

    python benchmarks/peer_table.py OUT_DIR 1 4 16 32
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SERVERS = ("llamacpp", "ladder")


def point(out: Path, server: str, users: int) -> dict | None:
    path = out / f"{server}-c{users}" / "results.json"
    if not path.is_file():
        return None
    summary = json.loads(path.read_text())["points"][0]["summary"]

    def median(key: str) -> float | None:
        return summary[key]["median"] if summary.get(key) else None

    return {"ok": summary["num_ok"], "failed": summary["num_failed"], "output_tok_s": summary["output_throughput"],
            "ttft_p50_ms": median("ttft_ms"), "ttft_p99_ms": summary["ttft_ms"]["p99"] if summary.get("ttft_ms") else None,
            "tpot_p50_ms": median("tpot_ms")}


def fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def main(out: Path, levels: list[int]) -> None:
    rows = []
    print("| concurrency | server | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | ok/failed |")
    print("|---|---|---|---|---|---|---|")
    for users in levels:
        points = {server: point(out, server, users) for server in SERVERS}
        for server, p in points.items():
            if p is None:
                continue
            print(f"| {users} | {server} | {fmt(p['output_tok_s'], 1)} | {fmt(p['ttft_p50_ms'])} | "
                  f"{fmt(p['ttft_p99_ms'])} | {fmt(p['tpot_p50_ms'], 1)} | {p['ok']}/{p['failed']} |")
        ours, peer = points["ladder"], points["llamacpp"]
        ratio = None
        if ours and peer and peer["output_tok_s"]:
            ratio = ours["output_tok_s"] / peer["output_tok_s"]
            ttft = (ours["ttft_p50_ms"] / peer["ttft_p50_ms"]) if ours["ttft_p50_ms"] and peer["ttft_p50_ms"] else None
            print(f"| {users} | ladder / llama.cpp | {ratio:.2f}x | {fmt(ttft, 2)}x | | | |")
        rows.append({"concurrency": users, **{server: points[server] for server in SERVERS},
                     "throughput_ratio": ratio})
    (out / "peer_table.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {out / 'peer_table.json'}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), [int(v) for v in sys.argv[2:]])
