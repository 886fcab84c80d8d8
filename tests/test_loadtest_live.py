"""loadtest against a fake OpenAI server with known timing: the figures, the arrival process, the
concurrency cap and failure counting.

This machine's scheduler can stall a process for several milliseconds, so single values are
noisy; the figures are checked where they are robust (medians, and means over many tokens).
"""

import argparse
import asyncio

import numpy as np
import pytest
from loadtest_server import ServerProcess

from loadtest.cli import add_parser, config_from_args
from loadtest.measure import measure

TTFT, ITL, OUTPUT_LEN = 0.2, 0.02, 16
E2E = TTFT + (OUTPUT_LEN - 1) * ITL  # 0.5 s


@pytest.fixture(scope="module")
def server():
    process = ServerProcess()
    yield process
    process.close()


def run(server, *flags):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["loadtest", "--base-url", server.url, "--quiet", *flags])
    return asyncio.run(measure(config_from_args(args))).points


def within(value, expected, tolerance=0.05):
    return abs(value - expected) <= tolerance * expected


def check_latencies(s):
    assert within(s.ttft_ms.median, TTFT * 1000) and within(s.ttft_ms.mean, TTFT * 1000)
    assert within(s.tpot_ms.median, ITL * 1000) and within(s.tpot_ms.mean, ITL * 1000)
    assert within(s.itl_ms.median, ITL * 1000) and within(s.itl_ms.mean, ITL * 1000)
    assert within(s.e2e_ms.median, E2E * 1000) and within(s.e2e_ms.mean, E2E * 1000)
    assert s.itl_ms.count == s.num_ok * (OUTPUT_LEN - 1)


def test_closed_loop_figures(server):
    server.configure(ttft=TTFT, itl=ITL)
    [point] = run(server, "--max-concurrency", "4", "--num-requests", "16", "--input-len", "32",
                  "--output-len", str(OUTPUT_LEN))
    s = point.summary
    assert (s.num_ok, s.num_failed) == (16, 0)
    check_latencies(s)
    # Four users, each finishing a request every E2E seconds.
    assert within(s.request_throughput, 4 / E2E)
    assert within(s.output_throughput, 4 * OUTPUT_LEN / E2E)
    assert s.input_tokens == 16 * 32 and s.output_tokens == 16 * OUTPUT_LEN
    assert s.token_sources == {"input": {"usage": 16}, "output": {"usage": 16}}
    assert s.max_in_flight == 4 and server.stats()["max_in_flight"] == 4
    assert s.send_lag_ms is None and s.offered_rate is None


def test_open_loop_figures(server):
    server.configure(ttft=TTFT, itl=ITL)
    # A very large gamma shape makes the gaps nearly equal, so the throughput is known: 20 requests
    # 0.1 s apart, the last one over E2E after it was sent.
    [point] = run(server, "--request-rate", "10", "--burstiness", "1000", "--num-requests", "20",
                  "--output-len", str(OUTPUT_LEN), "--input-len", "16")
    s = point.summary
    assert (s.num_ok, s.num_failed) == (20, 0)
    check_latencies(s)
    assert within(s.duration_s, 1.9 + E2E)
    assert within(s.request_throughput, 20 / (1.9 + E2E))
    assert within(s.output_throughput, 20 * OUTPUT_LEN / (1.9 + E2E))
    assert within(s.achieved_arrival_rate, 10.0)
    assert s.send_lag_ms.median < 5.0


def test_poisson_arrival_rate_over_200_requests(server):
    server.configure(ttft=0.001, itl=0.001)
    [point] = run(server, "--request-rate", "100", "--num-requests", "200", "--output-len", "2",
                  "--input-len", "8", "--seed", "3")
    s = point.summary
    assert s.num_ok == 200
    assert within(s.achieved_arrival_rate, 100.0, 0.10)
    arrivals = np.array(server.stats()["arrivals"])
    assert len(arrivals) == 200
    assert within(199 / (arrivals[-1] - arrivals[0]), 100.0, 0.10)
    # Poisson, not evenly spaced: exponential gaps have a coefficient of variation of 1.
    gaps = np.diff(arrivals)
    assert 0.75 < gaps.std() / gaps.mean() < 1.25


def test_closed_loop_never_exceeds_its_concurrency(server):
    server.configure(ttft=0.005, itl=0.002)
    [point] = run(server, "--max-concurrency", "5", "--num-requests", "40", "--output-len", "8")
    assert point.summary.num_ok == 40
    assert point.summary.max_in_flight == 5 and server.stats()["max_in_flight"] == 5


def test_capped_open_loop_queues_and_reports_the_lag(server):
    server.configure(ttft=0.01, itl=0.002)
    [point] = run(server, "--request-rate", "inf", "--max-concurrency", "3", "--num-requests", "12",
                  "--output-len", "8")
    s = point.summary
    assert s.num_ok == 12 and server.stats()["max_in_flight"] == 3 and s.max_in_flight == 3
    # Requests 4 to 12 waited for a free slot: at least one request's time (10 + 7 * 2 ms) each.
    assert s.send_lag_ms.max > 3 * 24.0


def test_failures_are_counted_by_kind_and_the_run_completes(server):
    server.configure(ttft=0.01, itl=0.005,
                     faults=["ok", "500", "ok", "429", "ok", "hang", "ok", "break", "ok", "error_event",
                             "ok", "close", "ok", "json"])
    [point] = run(server, "--max-concurrency", "4", "--num-requests", "28", "--output-len", "8",
                  "--timeout", "0.5")
    s = point.summary
    assert s.failures == {"http_500": 2, "http_429": 2, "timeout": 2, "broken_stream": 2, "error_event": 2,
                          "connection_error": 2, "bad_response": 2}
    assert (s.num_ok, s.num_failed) == (14, 14)
    assert s.ttft_ms.count == 14 and s.e2e_ms.count == 14
    failed = [r for r in point.run.records if not r.ok]
    assert all(r.error for r in failed)
    assert {r.error for r in failed if r.error_kind == "http_429"} == {"HTTP 429: injected 429"}


def test_duration_bounds_both_loops(server):
    server.configure(ttft=0.01, itl=0.005)
    [point] = run(server, "--request-rate", "20", "--duration", "0.5", "--output-len", "4")
    assert point.summary.num_requests == 11  # one at 0, then one every 1/20 s up to 0.5 s
    [point] = run(server, "--max-concurrency", "2", "--duration", "0.3", "--output-len", "4")
    records = point.run.records
    assert records and max(r.sent for r in records) < 0.3 <= point.summary.duration_s
    assert point.summary.num_ok == len(records)
