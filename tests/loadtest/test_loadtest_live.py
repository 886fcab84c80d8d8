"""loadtest against the fake OpenAI server in a process of its own, over real TCP: what holds however
fast or busy the machine is. Request and token counts, the concurrency cap, failure counting by kind,
the sources of token counts, that runs complete, and the order of each request's timestamps.

No assertion here depends on the machine's speed: latencies are only bounded from below by what the
server enforces (it cannot send a token before its deadline), never compared with a figure. The
figures themselves are checked exactly in virtual time, in test_loadtest_timing.py.
"""

import argparse
import asyncio

import pytest
from fake_openai_server import FakeServerProcess

from loadtest.arrivals import arrival_offsets
from loadtest.cli import add_parser, config_from_args
from loadtest.measure import measure

TTFT, ITL, OUTPUT_LEN = 0.02, 0.005, 16
MIN_E2E = TTFT + (OUTPUT_LEN - 1) * ITL
# Float rounding of differences between clock readings; nothing to do with the machine's speed.
ROUNDING = 1e-9


@pytest.fixture(scope="module")
def server():
    process = FakeServerProcess()
    yield process
    process.close()


def run(server, *flags):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["loadtest", "--base-url", server.url, "--quiet", *flags])
    return asyncio.run(measure(config_from_args(args))).points


def check_records(records, ttft, itl, output_len):
    """Every successful request: one timestamp per token, in order, between its send and its end; and no
    latency below the server's (the server runs on the same system-wide monotonic clock and sends
    token i no sooner than ttft + i * itl after the request arrived, which is after it was sent)."""
    for r in records:
        assert r.ok and r.output_tokens == output_len
        assert len(r.chunk_times) == output_len and r.chunk_times == sorted(r.chunk_times)
        assert r.chunk_times[0] == r.ttft and r.chunk_times[-1] <= r.e2e <= r.finished - r.sent + ROUNDING
        assert all(t >= ttft + i * itl - ROUNDING for i, t in enumerate(r.chunk_times))
        assert r.tpot == pytest.approx((r.e2e - r.ttft) / (output_len - 1))


def test_closed_loop_counts_every_request_and_token_from_usage(server):
    server.configure(ttft=TTFT, itl=ITL)
    [point] = run(server, "--max-concurrency", "4", "--num-requests", "16", "--input-len", "32",
                  "--output-len", str(OUTPUT_LEN))
    s = point.summary
    assert (s.num_requests, s.num_ok, s.num_failed) == (16, 16, 0) and server.stats()["num_requests"] == 16
    assert s.input_tokens == 16 * 32 and s.output_tokens == s.output_tokens_requested == 16 * OUTPUT_LEN
    assert s.token_sources == {"input": {"usage": 16}, "output": {"usage": 16}}
    assert (s.ttft_ms.count, s.tpot_ms.count, s.e2e_ms.count) == (16, 16, 16)
    assert s.itl_ms.count == 16 * (OUTPUT_LEN - 1)
    check_records(point.run.records, TTFT, ITL, OUTPUT_LEN)
    assert [r.index for r in point.run.records] == list(range(16))
    # The four users all send at once, before any answer can come back.
    assert s.max_in_flight == 4 and server.stats()["max_in_flight"] <= 4
    assert s.send_lag_ms is None and s.offered_rate is None


def test_open_loop_sends_every_request_in_schedule_order(server):
    server.configure(ttft=TTFT, itl=ITL)
    [point] = run(server, "--request-rate", "50", "--num-requests", "20", "--output-len", str(OUTPUT_LEN),
                  "--input-len", "16", "--seed", "4")
    s, records = point.summary, point.run.records
    assert (s.num_ok, s.num_failed) == (20, 0) and server.stats()["num_requests"] == 20
    assert [r.scheduled for r in records] == arrival_offsets(50, 20, 1.0, seed=4)
    # Each request is stamped as sent before the next one is built, so sends follow the schedule's order.
    sent = [r.sent for r in records]
    assert sent == sorted(sent)
    check_records(records, TTFT, ITL, OUTPUT_LEN)
    assert s.offered_rate == 50 and s.send_lag_ms.count == 20 and s.achieved_arrival_rate > 0


def test_closed_loop_never_exceeds_its_concurrency(server):
    server.configure(ttft=0.005, itl=0.002)
    [point] = run(server, "--max-concurrency", "5", "--num-requests", "40", "--output-len", "8")
    assert point.summary.num_ok == 40 and server.stats()["num_requests"] == 40
    assert point.summary.max_in_flight == 5 and server.stats()["max_in_flight"] <= 5


def test_capped_open_loop_queues_requests_beyond_the_cap(server):
    ttft, itl, output_len = 0.01, 0.002, 8
    server.configure(ttft=ttft, itl=itl)
    [point] = run(server, "--request-rate", "inf", "--max-concurrency", "3", "--num-requests", "12",
                  "--output-len", str(output_len))
    s = point.summary
    assert s.num_ok == 12 and s.max_in_flight <= 3 and server.stats()["max_in_flight"] <= 3
    check_records(point.run.records, ttft, itl, output_len)
    # All are due at 0, and a slot frees only when a request ends, no sooner than its E2E after it was
    # sent: so by any time t at most 3 * (t // e2e + 1) requests are out, and the k-th send is late by
    # at least k // 3 request times.
    e2e = ttft + (output_len - 1) * itl
    lags = sorted(r.lag for r in point.run.records)
    assert all(lag >= k // 3 * e2e - ROUNDING for k, lag in enumerate(lags))


def test_failures_are_counted_by_kind_and_the_run_completes(server):
    # A hung request's timeout is checked in virtual time: here any timeout would bet on the speed of the
    # requests that do answer.
    server.configure(ttft=0.01, itl=0.005,
                     faults=["ok", "500", "ok", "429", "ok", "break", "ok", "error_event", "ok", "close", "ok",
                             "json"])
    [point] = run(server, "--max-concurrency", "4", "--num-requests", "24", "--output-len", "8")
    s = point.summary
    assert s.failures == {"http_500": 2, "http_429": 2, "broken_stream": 2, "error_event": 2,
                          "connection_error": 2, "bad_response": 2}
    assert (s.num_ok, s.num_failed) == (12, 12) and server.stats()["num_requests"] == 24
    assert s.ttft_ms.count == 12 and s.e2e_ms.count == 12 and s.output_tokens == 12 * 8
    check_records([r for r in point.run.records if r.ok], 0.01, 0.005, 8)
    failed = [r for r in point.run.records if not r.ok]
    assert all(r.error and r.e2e is None and r.finished >= r.sent for r in failed)
    assert {r.error for r in failed if r.error_kind == "http_429"} == {"HTTP 429: injected 429"}


def test_open_loop_duration_fixes_the_number_of_requests(server):
    server.configure(ttft=0.01, itl=0.005)
    [point] = run(server, "--request-rate", "20", "--duration", "0.5", "--output-len", "4")
    records = point.run.records
    assert point.summary.num_requests == point.summary.num_ok == 11  # one at 0, then one every 1/20 s up to 0.5 s
    assert server.stats()["num_requests"] == 11
    assert max(r.scheduled for r in records) == pytest.approx(0.5)


def test_closed_loop_duration_ends_the_run_and_waits_for_every_request(server):
    server.configure(ttft=0.01, itl=0.005)
    [point] = run(server, "--max-concurrency", "2", "--duration", "0.3", "--output-len", "4")
    records = point.run.records
    assert records and point.summary.num_ok == len(records) == server.stats()["num_requests"]
    assert [r.index for r in records] == list(range(len(records)))
    assert point.summary.duration_s == max(r.finished for r in records)


def test_no_keep_alive_sends_each_request_on_a_connection_of_its_own(server):
    server.configure(ttft=0.01, itl=0.005)
    run(server, "--max-concurrency", "2", "--num-requests", "6", "--output-len", "4", "--no-keep-alive")
    fresh = server.stats()
    server.configure(ttft=0.01, itl=0.005)
    run(server, "--max-concurrency", "2", "--num-requests", "6", "--output-len", "4")
    pooled = server.stats()
    assert fresh["num_requests"] == pooled["num_requests"] == 6
    # Each of the six, the model list (and the metrics read) on its own, plus the stats call itself; pooled:
    # at most one connection per concurrent request besides.
    assert fresh["num_connections"] >= 8 and pooled["num_connections"] <= 5, (fresh, pooled)
