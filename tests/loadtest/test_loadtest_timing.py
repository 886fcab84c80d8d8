"""loadtest's figures in virtual time: TTFT, TPOT, ITL, E2E, throughput, the arrival process, send lag
under the concurrency cap, timeouts and duration bounds, checked exactly.

The fake server of fake_openai_server.py runs inside the test's own event loop, behind a Unix socket, and
the client reads that loop's clock. The loop's clock stands still while anything is ready to run and
then jumps to the next timer, so the server's token deadlines, the open loop's schedule and every
timestamp the client takes fall exactly where they are due, however fast or busy the machine is. How
close the real clock comes to them is a benchmark's question, not a test's.
"""

from __future__ import annotations

import asyncio
import math
import selectors
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from fake_openai_server import MODEL, FakeServer

from loadtest.arrivals import arrival_offsets
from loadtest.client import OpenAIClient
from loadtest.config import LoadShape, Slo, WorkloadConfig
from loadtest.metrics import Summary, summarize
from loadtest.progress import Progress
from loadtest.runner import RunResult, run_shape
from loadtest.workload import build_workload

# Far from zero, so that a figure that forgot to subtract the run's origin would show.
VIRTUAL_START = 1000.0
# With no timer due the loop can only wait for another thread; none of these tests has one.
DEADLOCK_SECONDS = 10.0

TTFT, ITL, OUTPUT_LEN = 0.2, 0.02, 16
E2E = TTFT + (OUTPUT_LEN - 1) * ITL  # 0.5 s


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock stands still while a callback is ready or a socket is readable, and
    otherwise jumps to the next timer. Sound because all I/O stays in this process on Unix sockets,
    where a write is readable at the other end as soon as it returns: a socket that is not ready now can
    only become ready through this loop's own work, never while the clock jumps."""

    def __init__(self) -> None:
        self.virtual_now = VIRTUAL_START
        super().__init__(selector=JumpingSelector(self))

    def time(self) -> float:
        return self.virtual_now


class JumpingSelector(selectors.DefaultSelector):
    def __init__(self, loop: VirtualTimeLoop) -> None:
        super().__init__()
        self.loop = loop

    def select(self, timeout: float | None = None) -> list:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:  # nothing ready and no timer: only another thread could wake the loop
            ready = super().select(DEADLOCK_SECONDS)
            if not ready:
                raise RuntimeError("deadlock: no callback, socket or timer will ever be ready")
            return ready
        self.loop.virtual_now += timeout
        return []


class LoopClock:
    """The running event loop's clock as a loadtest Clock. The client's timeouts run on the loop's
    clock as well, so in a VirtualTimeLoop they are exact too."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


@dataclass
class VirtualRun:
    result: RunResult
    summary: Summary
    server: FakeServer


def run_virtual(shape: LoadShape, behaviour: dict, endpoint: str = "completions", timeout: float = 300.0,
                workload: WorkloadConfig = WorkloadConfig(input_len=16, output_len=OUTPUT_LEN), seed: int = 0,
                slo: Slo | None = None) -> VirtualRun:
    """One load shape against the fake server with `behaviour`, all in virtual time."""

    async def main() -> VirtualRun:
        clock = LoopClock()
        server = FakeServer(clock)
        server.configure(behaviour)
        with tempfile.TemporaryDirectory() as folder:  # short: a socket path has a length limit
            path = str(Path(folder) / "server.sock")
            listener = await asyncio.start_unix_server(server.handle, path)
            client = OpenAIClient("http://fake-server", None, endpoint, timeout, clock=clock,
                                  connector=lambda: aiohttp.UnixConnector(path, limit=0))
            client.model = MODEL
            async with listener, client:
                result = await run_shape(client, build_workload(workload), shape, 0, seed,
                                         Progress(shape.label, None, None, enabled=False))
        return VirtualRun(result, summarize(result, slo), server)

    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(main())


def exactly(expected):
    """Equal but for float rounding (the clock reads about 1000 s, where a double resolves 1e-13 s)."""
    return pytest.approx(expected, rel=1e-9, abs=1e-9)


def check_distribution(distribution, value_ms, count):
    assert distribution.count == count
    for figure in (distribution.mean, distribution.median, distribution.p90, distribution.p99, distribution.max):
        assert figure == exactly(value_ms)


def test_virtual_time_jumps_to_the_next_timer_at_once():
    async def main():
        loop = asyncio.get_running_loop()
        before = loop.time()
        await asyncio.gather(asyncio.sleep(3600.0), asyncio.sleep(60.0))
        return loop.time() - before

    wall = time.perf_counter()
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        assert runner.run(main()) == 3600.0
    assert time.perf_counter() - wall < DEADLOCK_SECONDS  # an hour passed without being waited for


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_closed_loop_figures_are_the_servers_timing(endpoint):
    # Chat streams a role event with no text first: it must not count as the first token.
    run = run_virtual(LoadShape(max_concurrency=4, num_requests=16), {"ttft": TTFT, "itl": ITL}, endpoint)
    s, records = run.summary, run.result.records
    assert (s.num_ok, s.num_failed) == (16, 0)
    for r in records:
        assert r.chunk_times == exactly([TTFT + i * ITL for i in range(OUTPUT_LEN)])
        assert (r.ttft, r.tpot, r.e2e) == exactly((TTFT, ITL, E2E))
        assert r.itls == exactly([ITL] * (OUTPUT_LEN - 1))
    check_distribution(s.ttft_ms, TTFT * 1000, 16)
    check_distribution(s.tpot_ms, ITL * 1000, 16)
    check_distribution(s.itl_ms, ITL * 1000, 16 * (OUTPUT_LEN - 1))
    check_distribution(s.e2e_ms, E2E * 1000, 16)
    # Four users, each sending its next request the moment the previous one ends: four rounds.
    assert sorted(r.sent for r in records) == exactly([k * E2E for k in range(4) for _ in range(4)])
    assert s.duration_s == exactly(4 * E2E)
    assert s.request_throughput == exactly(4 / E2E)
    assert s.output_throughput == exactly(4 * OUTPUT_LEN / E2E)
    assert s.max_in_flight == 4 and run.server.max_in_flight == 4
    assert s.send_lag_ms is None and s.offered_rate is None


def test_open_loop_sends_each_request_exactly_when_it_is_due():
    run = run_virtual(LoadShape(request_rate=10, num_requests=20), {"ttft": TTFT, "itl": ITL}, seed=5)
    s, records = run.summary, run.result.records
    offsets = arrival_offsets(10, 20, 1.0, seed=5)
    assert [r.scheduled for r in records] == offsets
    assert [r.sent for r in records] == exactly(offsets)
    arrivals = np.array(run.server.arrivals)
    assert (arrivals - arrivals[0]).tolist() == exactly(offsets)
    check_distribution(s.send_lag_ms, 0.0, 20)
    assert s.offered_rate == 10 and s.achieved_arrival_rate == exactly(10.0)
    # Requests overlap, and each still sees the server's timing exactly.
    check_distribution(s.ttft_ms, TTFT * 1000, 20)
    check_distribution(s.itl_ms, ITL * 1000, 20 * (OUTPUT_LEN - 1))
    check_distribution(s.e2e_ms, E2E * 1000, 20)
    # The last request is sent last and takes as long as the others: the run ends E2E after it.
    assert s.duration_s == exactly(offsets[-1] + E2E)
    assert s.request_throughput == exactly(20 / (offsets[-1] + E2E))
    assert s.output_throughput == exactly(20 * OUTPUT_LEN / (offsets[-1] + E2E))


@pytest.mark.parametrize("burstiness", [1.0, 0.25])
def test_requests_reach_the_server_as_a_gamma_process_at_the_offered_rate(burstiness):
    run = run_virtual(LoadShape(request_rate=100, burstiness=burstiness, num_requests=200),
                      {"ttft": 0.001, "itl": 0.001}, workload=WorkloadConfig(input_len=8, output_len=2), seed=3)
    assert run.summary.num_ok == 200 and run.summary.achieved_arrival_rate == exactly(100.0)
    gaps = np.diff(run.server.arrivals)
    assert gaps.tolist() == exactly(np.diff(arrival_offsets(100, 200, burstiness, seed=3)).tolist())
    assert 199 / gaps.sum() == exactly(100.0)
    # A gamma gap of shape k has a coefficient of variation of 1/sqrt(k); 199 sampled gaps come
    # within 25% of it (Poisson, k = 1: exponential gaps, not even ones).
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.25)


def test_capped_open_loop_counts_the_wait_for_a_free_slot_as_send_lag():
    ttft, itl, output_len = 0.01, 0.002, 8
    e2e = ttft + (output_len - 1) * itl
    run = run_virtual(LoadShape(request_rate=math.inf, max_concurrency=3, num_requests=12), {"ttft": ttft, "itl": itl},
                      workload=WorkloadConfig(input_len=16, output_len=output_len))
    s = run.summary
    assert s.num_ok == 12 and s.max_in_flight == 3 and run.server.max_in_flight == 3
    # All twelve are due at 0; three at a time get a slot, each the moment a request before it ends.
    assert sorted(r.lag for r in run.result.records) == exactly([k // 3 * e2e for k in range(12)])
    assert s.send_lag_ms.max == exactly(3 * e2e * 1000)
    assert s.duration_s == exactly(4 * e2e)
    check_distribution(s.e2e_ms, e2e * 1000, 12)  # the wait for a slot is lag, not latency


def test_failures_are_counted_by_kind_and_a_hung_request_times_out_exactly_on_time():
    faults = ["ok", "500", "ok", "429", "ok", "hang", "ok", "break", "ok", "error_event", "ok", "close", "ok", "json"]
    ttft, itl, output_len = 0.01, 0.005, 8
    run = run_virtual(LoadShape(max_concurrency=4, num_requests=28), {"ttft": ttft, "itl": itl, "faults": faults},
                      timeout=0.5, workload=WorkloadConfig(input_len=16, output_len=output_len))
    s, records = run.summary, run.result.records
    assert s.failures == {"http_500": 2, "http_429": 2, "timeout": 2, "broken_stream": 2, "error_event": 2,
                          "connection_error": 2, "bad_response": 2}
    assert (s.num_ok, s.num_failed) == (14, 14)
    assert [r.finished - r.sent for r in records if r.error_kind == "timeout"] == exactly([0.5, 0.5])
    # Failed requests stay out of the latency figures and do not disturb the others'.
    check_distribution(s.ttft_ms, ttft * 1000, 14)
    check_distribution(s.e2e_ms, (ttft + (output_len - 1) * itl) * 1000, 14)


def test_open_loop_duration_sends_the_arrivals_due_within_it():
    run = run_virtual(LoadShape(request_rate=20, duration=0.5), {"ttft": 0.01, "itl": 0.005},
                      workload=WorkloadConfig(input_len=16, output_len=4))
    records = run.result.records
    assert run.summary.num_ok == len(records) == 11  # one at 0, then one every 1/20 s on average up to 0.5 s
    assert records[-1].scheduled == exactly(0.5) and records[-1].sent == exactly(0.5)


def test_closed_loop_sends_nothing_once_its_duration_is_over():
    # Each request takes 0.01 + 3 * 0.005 = 0.025 s; the duration ends between the sends at 0.3 and 0.325 s.
    run = run_virtual(LoadShape(max_concurrency=2, duration=0.31), {"ttft": 0.01, "itl": 0.005},
                      workload=WorkloadConfig(input_len=16, output_len=4))
    records = run.result.records
    assert run.summary.num_ok == len(records) == 26
    assert sorted(r.sent for r in records) == exactly([k * 0.025 for k in range(13) for _ in range(2)])
    # The requests sent in time are waited for: the run ends with the last of them.
    assert run.summary.duration_s == exactly(13 * 0.025)


def test_goodput_counts_the_requests_that_meet_every_objective():
    # Output lengths spread over 8..24 tokens, so E2E = TTFT + (n - 1) * ITL is at most 410 ms for
    # n <= 11 tokens and more beyond.
    workload = WorkloadConfig(input_len=16, output_len=16, range_ratio=0.5, seed=2)
    run = run_virtual(LoadShape(max_concurrency=4, num_requests=16), {"ttft": TTFT, "itl": ITL}, workload=workload,
                      slo=Slo({"e2e": 410}))
    s, records = run.summary, run.result.records
    meeting = sum(r.max_tokens <= 11 for r in records)
    assert 0 < meeting < 16
    assert [r.e2e for r in records] == exactly([TTFT + (r.max_tokens - 1) * ITL for r in records])
    assert s.slo_attainment == meeting / 16
    assert s.goodput == exactly(meeting / s.duration_s)
