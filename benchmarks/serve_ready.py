"""Time from `ladder serve --artifact DIR` to `/ready` answering 200: a CPU torch-compile artifact served
from its AOTInductor package (new) against the same artifact without it, compiled by Inductor at start
(old: the format 1 path), started in turn in one run.

    python benchmarks/serve_ready.py [--precision w8a8,int8] [--runs 3] [--artifact-root DIR]

For each precision the artifact of the default model is compiled once (`ladder compile --backend
torch-compile --no-bench`, timed) unless `--artifact-root` already holds it as <root>/<precision>; the old
form is a copy of it (hard links) whose manifest drops the package, as an artifact written before
packages were. Each start is a fresh process; the load average beside each figure says how busy the shared
machine was. Prints a table and writes JSON (default benchmarks/results/serve_ready/serve_ready.json).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
PACKAGE, MANIFEST = "step.pt2", "manifest.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def compile_artifact(precision: str, out: Path, log: Path) -> float:
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "ladder.cli", "compile", "--backend", "torch-compile", "--precision", precision,
           "--no-bench", "--out", str(out)]
    with log.open("w") as f:
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    return time.perf_counter() - start


def without_package(new: Path, old: Path) -> None:
    """`old`: `new`'s files (hard links) with a format 1 manifest that lists no package."""
    if old.exists():
        return
    old.mkdir(parents=True)
    for path in new.rglob("*"):
        target = old / path.relative_to(new)
        if path.is_dir():
            target.mkdir(exist_ok=True)
        elif path.name not in (PACKAGE, MANIFEST):
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(path, target)
    manifest = json.loads((new / MANIFEST).read_text())
    manifest["files"].pop(PACKAGE)
    manifest.pop("package")
    manifest["format_version"] = 1
    (old / MANIFEST).write_text(json.dumps(manifest, indent=2))


def seconds_to_ready(artifact: Path, log: Path, timeout: float = 600.0) -> float:
    """Wall seconds from starting `ladder serve --artifact` to /ready answering 200; the server is stopped."""
    port = free_port()
    cmd = [sys.executable, "-m", "ladder.cli", "serve", "--artifact", str(artifact), "--port", str(port)]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        while time.perf_counter() - start < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"ladder serve exited with {proc.returncode}: {log.read_text()[-1500:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                    return time.perf_counter() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"not ready after {timeout} s: {log.read_text()[-1500:]}")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", default="w8a8,int8", help="comma-separated precisions")
    parser.add_argument("--runs", type=int, default=3, help="starts of each path, old and new in turn")
    parser.add_argument("--artifact-root", type=Path, default=ROOT / "benchmarks/results/serve_ready/artifacts")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/serve_ready/serve_ready.json")
    args = parser.parse_args()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    logs = args.json.parent / "logs"
    logs.mkdir(exist_ok=True)
    results = []
    for precision in args.precision.split(","):
        new = args.artifact_root / precision
        compile_s = None
        if not new.exists():
            compile_s = compile_artifact(precision, new, logs / f"compile-{precision}.log")
        old = args.artifact_root / f"{precision}-no-package"
        without_package(new, old)
        starts: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
        for run in range(args.runs):
            for path, artifact in (("old", old), ("new", new)):
                load = load_average()
                seconds = seconds_to_ready(artifact, logs / f"serve-{precision}-{path}-{run}.log")
                starts[path].append({"seconds": seconds, "loadavg_1m": load})
                print(f"{precision} {path} run {run}: ready in {seconds:.1f} s (load {load:.2f})", file=sys.stderr)
        row = {"precision": precision, "compile_s": compile_s,
               "package_bytes": (new / PACKAGE).stat().st_size, "starts": starts}
        for path in starts:
            row[f"{path}_median_s"] = statistics.median(s["seconds"] for s in starts[path])
        row["speedup"] = row["old_median_s"] / row["new_median_s"]
        results.append(row)
    print(f"{'precision':<10}{'old: compile at start (s)':>27}{'new: AOTI package (s)':>23}{'ratio':>8}"
          f"{'loadavg':>14}{'compile (s)':>13}")
    for row in results:
        loads = [s["loadavg_1m"] for path in row["starts"].values() for s in path]
        compiled = "-" if row["compile_s"] is None else f"{row['compile_s']:.0f}"
        print(f"{row['precision']:<10}{row['old_median_s']:>27.1f}{row['new_median_s']:>23.1f}"
              f"{row['speedup']:>7.1f}x{min(loads):>7.2f}-{max(loads):<6.2f}{compiled:>13}")
    args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "runs": args.runs, "nproc": os.cpu_count(),
                                     "results": results}, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
