"""benchmarks/gpu_check.py keeps its figures: results written after every section, on SIGTERM, and when it
refuses to run; sections in their fixed order; decode batch sizes skipped, with a reason, when the
budget is short. Fake sections stand in for the CUDA ones, so all of it runs on a CPU in seconds."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


@functools.cache
def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


def read(out: Path) -> dict:
    return json.loads((out / "gpu_check.json").read_text())


def test_results_are_written_after_every_section_in_the_fixed_order(tmp_path):
    gc = load_gpu_check()
    plan = gc.make_plan(dry_run=True)
    seen = []

    def section(name, value):
        def run():
            if seen:  # what the previous section produced is already on disk
                on_disk = read(tmp_path)
                assert on_disk["running"] == name and seen[-1] in on_disk["seconds"], on_disk
                assert not list(tmp_path.glob(".*.tmp"))  # written by rename: no temporary left behind
            seen.append(name)
            return value
        return run

    def broken():
        seen.append("parity")
        raise RuntimeError("no device")

    fakes = {"bandwidth": section("bandwidth", 1e9), "kernels": section("kernels", []), "parity": broken,
             "decode": section("decode", {"rows": []})}
    report = gc.run(plan, ("decode", "parity", "kernels"), tmp_path, 100.0, sections=fakes)
    assert seen == ["bandwidth", "kernels", "parity", "decode"]  # cheapest first, whatever the order asked
    data = read(tmp_path)
    assert data["complete"] and data["running"] is None and data["copy_bandwidth_bytes_per_s"] == 1e9
    assert data["errors"] == {"parity": "RuntimeError: no device"} and not data["passed"] and not report.passed
    assert "section parity FAILED: RuntimeError: no device" in (tmp_path / "gpu_check.txt").read_text()


def test_sections_past_the_budget_are_skipped_with_the_reason(tmp_path):
    gc = load_gpu_check()
    fakes = {name: (lambda: time.sleep(0.05) or []) for name in gc.SECTIONS}
    fakes["bandwidth"] = lambda: time.sleep(0.05) or 1e9
    gc.run(gc.make_plan(dry_run=True), gc.SECTIONS, tmp_path, 0.01, sections=fakes)
    data = read(tmp_path)
    assert list(data["seconds"]) == ["bandwidth"]
    assert data["skipped"] == {name: "skipped: the 0 s budget was spent" for name in ("kernels", "parity", "decode")}


def test_decode_skips_the_batch_sizes_that_no_longer_fit(tmp_path, monkeypatch):
    gc = load_gpu_check()
    plan = gc.make_plan(dry_run=True)
    plan.batches, plan.decode_min_s = (1, 4, 8), 0.0

    class Speed:
        tokens_per_s, median_step_ms = 10.0, 100.0

    def compare_decode(models, batch, *args):
        time.sleep(0.6)  # a batch size's compiles and rounds
        return {"fake": Speed()}

    monkeypatch.setattr(gc, "decode_models", lambda plan, notes, budget: {"eager bf16": None, "fake": None})
    monkeypatch.setattr(gc, "first_steps_s", lambda model, plan, batch: 0.25)
    monkeypatch.setattr(gc, "compare_decode", compare_decode)
    monkeypatch.setattr(gc, "decode_bytes_per_step", lambda model, batch, context: 1000)
    monkeypatch.setattr(gc, "cuda_graph_state", lambda device: {"last_step": "none", "skipped_graphs": 0})
    report = gc.Report(True, "cpu", gc.environment(plan), copy_bandwidth_bytes_per_s=1e6)
    saves = []
    figures = gc.measure_decode(plan, report, gc.Budget(1.0), lambda: saves.append(len(report.decode["rows"])))
    assert report.decode is figures and [row["batch"] for row in figures["rows"]] == [1]
    assert saves == [1]  # saved after the batch size it measured
    assert figures["compile_s"] == {"1": {"eager bf16": 0.25, "fake": 0.25}}
    assert set(figures["skipped"]) == {"4", "8"}
    assert figures["skipped"]["4"].startswith("skipped: ") and "of the 1 s budget left" in figures["skipped"]["4"]
    assert "batch 4: skipped" in gc.format_report(report)


STOPPED_RUN = """
import importlib.util, sys, time
from pathlib import Path
spec = importlib.util.spec_from_file_location("gpu_check_under_test", sys.argv[1])
gc = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gc)
out = Path(sys.argv[2])
plan = gc.make_plan(dry_run=True)
report = gc.Report(True, "cpu", gc.environment(plan))
gc.stop_on_signals(report, out)

def stuck():
    (out / "started").write_text("")
    time.sleep(60)

fakes = {"bandwidth": lambda: 2e9, "kernels": lambda: [], "parity": stuck, "decode": lambda: {}}
gc.run(plan, gc.SECTIONS, out, 100.0, sections=fakes, report=report)
"""


def test_sigterm_writes_what_is_done_and_exits_nonzero(tmp_path):
    process = subprocess.Popen([sys.executable, "-c", STOPPED_RUN, str(SCRIPT), str(tmp_path)], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "started").exists():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[0]
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM, output
    data = read(tmp_path)
    assert data["stopped"] == "SIGTERM" and not data["complete"] and not data["passed"]
    assert data["copy_bandwidth_bytes_per_s"] == 2e9 and list(data["seconds"]) == ["bandwidth", "kernels"]
    assert data["errors"]["parity"].startswith("stopped by SIGTERM after")
    assert "PARTIAL: stopped by SIGTERM" in (tmp_path / "gpu_check.txt").read_text()


def test_without_a_gpu_the_check_still_writes_why_nothing_ran(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no device, even on a GPU machine
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, str(SCRIPT), "--sections", "parity", "--out", str(tmp_path)], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    data = read(tmp_path)
    assert data["sections"] == ["bandwidth", "parity"] and not data["passed"]
    assert set(data["skipped"]) == {"bandwidth", "parity"}
    assert all(reason.startswith("not run: ") for reason in data["skipped"].values())
