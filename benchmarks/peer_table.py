"""The side-by-side table of benchmarks/peer_llamacpp.sh: one row per concurrency, llama.cpp's server and
ladder serve, from the results.json each `ladder loadtest` run wrote; also writes peer_table.json. Its
header names the host (CPU model, cores, ISA flags) and llama.cpp's build (version, cmake options), which
the script records first in OUT_DIR/host.json: the ratios hold on that CPU and that build only.

    python benchmarks/peer_table.py OUT_DIR 1 4 16 32
    python benchmarks/peer_table.py --record-host OUT_DIR --threads 2 --llamacpp-python 0.3.36 \
        --server-version "$(llama-server --version 2>&1)" --ggml-options FILE -- -DGGML_NATIVE=ON ...
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

SERVERS = ("llamacpp", "ladder")
# The ISA features the int8/4-bit kernels of both servers dispatch on.
ISA_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "amx_tile", "amx_int8", "amx_bf16")


def cpuinfo_fields(text: str) -> dict[str, str]:
    """The first processor's `key: value` lines of /proc/cpuinfo."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def lscpu_fields() -> dict[str, str]:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in text.splitlines()) if v}


def physical_cores(lscpu: dict[str, str]) -> int | None:
    try:
        return int(lscpu["Core(s) per socket"]) * int(lscpu.get("Socket(s)", "1"))
    except (KeyError, ValueError):
        return None


def host_info(threads: int | None) -> dict:
    """This machine's CPU as the results should name it: /proc/cpuinfo, lscpu where it says more."""
    try:
        cpu = cpuinfo_fields(Path("/proc/cpuinfo").read_text())
    except OSError:
        cpu = {}
    lscpu = lscpu_fields()
    flags = set((cpu.get("flags") or lscpu.get("Flags", "")).split())
    return {
        "cpu_model": cpu.get("model name") or lscpu.get("Model name"),
        "vendor": cpu.get("vendor_id") or lscpu.get("Vendor ID"),
        "cpu_family": cpu.get("cpu family") or lscpu.get("CPU family"),
        "cpu_model_number": cpu.get("model") or lscpu.get("Model"),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cores": physical_cores(lscpu),
        "threads_per_core": lscpu.get("Thread(s) per core"),
        "hypervisor": lscpu.get("Hypervisor vendor") or ("yes" if "hypervisor" in flags else None),
        "isa": {flag: flag in flags for flag in ISA_FLAGS},
        "threads": threads,
    }


def ggml_options(path: Path) -> dict[str, bool] | None:
    """`GGML_AVX512:BOOL=ON` lines of the build's CMakeCache (kept beside the binary) -> {name: on}."""
    if not path.is_file():
        return None
    found = (re.match(r"(GGML_[A-Z0-9_]+):BOOL=(\w+)", line) for line in path.read_text().splitlines())
    return {m[1]: m[2].upper() in ("ON", "TRUE", "1", "YES") for m in found if m}


def record_host(args: argparse.Namespace) -> None:
    build = {"llama_cpp_python": args.llamacpp_python, "server_version": " ".join(args.server_version.split()),
             "cmake_flags": args.cmake_flags, "ggml_options": ggml_options(Path(args.ggml_options))}
    path = Path(args.record_host) / "host.json"
    path.write_text(json.dumps({"host": host_info(args.threads), "llamacpp_build": build,
                                "ladder_cpu_cflags": args.ladder_cflags}, indent=1) + "\n")
    print("\n".join(header_lines(json.loads(path.read_text()))))


def header_lines(recorded: dict) -> list[str]:
    host, build = recorded.get("host") or {}, recorded.get("llamacpp_build") or {}
    if not host:
        return ["host: not recorded (no host.json beside the results)"]
    isa = " ".join(flag for flag, on in host.get("isa", {}).items() if on) or "none of " + ", ".join(ISA_FLAGS)
    family = f", family {host['cpu_family']} model {host['cpu_model_number']}" if host.get("cpu_family") else ""
    virtual = f", {host['hypervisor']} guest" if host.get("hypervisor") else ""
    cores = f" ({host['cores']} cores)" if host.get("cores") else ""
    lines = [f"host: {host.get('cpu_model') or 'unknown CPU'}{family}; {host.get('usable_cpus')} of "
             f"{host.get('logical_cpus')} logical CPUs{cores}{virtual}; {host.get('threads')} threads per server",
             f"ISA: {isa}"]
    if build:
        on = [name.removeprefix("GGML_") for name, value in (build.get("ggml_options") or {}).items() if value]
        lines.append(f"llama.cpp: llama-cpp-python {build.get('llama_cpp_python')} ({build.get('server_version')}); "
                     f"cmake {' '.join(build.get('cmake_flags') or [])}")
        lines.append("GGML options on: " + (" ".join(on) if build.get("ggml_options") is not None
                                             else "not recorded (binary built before they were kept)"))
    if recorded.get("ladder_cpu_cflags"):
        lines.append(f"ladder's kernels built with LADDER_CPU_CFLAGS={recorded['ladder_cpu_cflags']}")
    return lines


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
    recorded = json.loads((out / "host.json").read_text()) if (out / "host.json").is_file() else {}
    print("\n".join(header_lines(recorded)))
    print()
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
    table = {"host": recorded.get("host"), "llamacpp_build": recorded.get("llamacpp_build"), "rows": rows}
    (out / "peer_table.json").write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {out / 'peer_table.json'}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--record-host":
        parser = argparse.ArgumentParser(prog="peer_table.py --record-host")
        parser.add_argument("--record-host", required=True, help="the results folder to write host.json into")
        parser.add_argument("--threads", type=int, default=None)
        parser.add_argument("--llamacpp-python", default=None, help="the llama-cpp-python sources' version")
        parser.add_argument("--server-version", default="", help="what `llama-server --version` printed")
        parser.add_argument("--ggml-options", default="", help="the GGML_* lines of the build's CMakeCache.txt")
        parser.add_argument("--ladder-cflags", default="", help="LADDER_CPU_CFLAGS of ladder's kernel build")
        parser.add_argument("cmake_flags", nargs="*", help="the -D options cmake was given (after --)")
        record_host(parser.parse_args())
    else:
        main(Path(sys.argv[1]), [int(v) for v in sys.argv[2:]])
