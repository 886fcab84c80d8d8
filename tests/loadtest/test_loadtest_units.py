"""loadtest's parts without a server: SSE parsing, the clock, arrivals, metrics math, Prometheus, workloads."""

import json
import math
import random
import time

import numpy as np
import pytest

from loadtest.arrivals import arrival_offsets, num_arrivals
from loadtest.client import BROKEN_STREAM, ERROR_EVENT, OpenAIClient, RequestRecord, _StreamState, api_root
from loadtest.config import LoadShape, LoadTestError, Slo, Sweep, WorkloadConfig
from loadtest.metrics import Distribution, meets_slo, summarize
from loadtest.report import json_safe
from loadtest.runner import RunResult
from loadtest.server_metrics import (
    GENERATION_TOKENS,
    PREFILL_SECONDS,
    STEP_SECONDS,
    breakdown,
    histogram_quantile,
    is_ladder,
    parse_prometheus,
)
from loadtest.sse import SseParser
from loadtest.tokens import TokenCounter
from loadtest.words import WORDS
from loadtest.workload import FileWorkload, RandomWorkload, build_workload


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    """A byte-level BPE small enough that most words take several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator([" ".join(WORDS)] * 5, trainer)
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
    return str(path)


# SSE


def test_sse_events_split_anywhere_and_crlf():
    stream = b'data: {"a": 1}\r\n\r\n: comment\n\nevent: x\ndata: line1\ndata: line2\n\ndata: [DONE]\n\n'
    for size in (1, 3, 7, len(stream)):
        parser = SseParser()
        events = []
        for i in range(0, len(stream), size):
            events += parser.feed(stream[i:i + size])
        assert events == ['{"a": 1}', "line1\nline2", "[DONE]"]
        assert not parser.has_partial_event


def stream_of(events, keep_text=False):
    record = RequestRecord(0, None, 0.0, 4)
    state = _StreamState(record, sent_at=10.0, keep_text=keep_text)
    for now, data in events:
        state.handle(data if isinstance(data, str) else json.dumps(data), now)
    return record, state


def test_stream_state_chat_times_only_text_events():
    role = {"choices": [{"delta": {"role": "assistant", "content": ""}}]}
    token = {"choices": [{"delta": {"content": "hi"}}]}
    reasoning = {"choices": [{"delta": {"reasoning_content": "hm"}}]}
    finish = {"choices": [{"delta": {}, "finish_reason": "length"}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}
    record, state = stream_of([(10.01, role), (10.1, reasoning), (10.2, token), (10.3, token),
                               (10.31, finish), (10.32, usage), (10.33, "[DONE]")], keep_text=True)
    state.end(10.4)
    assert record.ok and record.finish_reason == "length"
    assert record.ttft == pytest.approx(0.1)
    assert record.chunk_times == pytest.approx([0.1, 0.2, 0.3])
    assert record.e2e == pytest.approx(0.33)
    assert state.usage == {"prompt_tokens": 7, "completion_tokens": 3}
    assert "".join(state.text) == "hmhihi"


def test_stream_state_failures():
    record, state = stream_of([(10.1, {"choices": [{"text": "a"}]}), (10.2, {"error": {"message": "boom"}})])
    assert not record.ok and record.error_kind == ERROR_EVENT and record.error == "boom"
    record, state = stream_of([(10.1, {"choices": [{"text": "a"}]})])
    state.end(10.2)
    assert record.error_kind == BROKEN_STREAM
    # No [DONE] but a finish_reason and a clean end of the body: complete.
    record, state = stream_of([(10.1, {"choices": [{"text": "a", "finish_reason": "stop"}]})])
    state.end(10.2)
    assert record.ok and record.e2e == pytest.approx(0.2)


def test_api_root():
    assert api_root("http://h:1/v1/") == "http://h:1"
    assert api_root("http://h:1") == "http://h:1"


# clock


def test_a_client_reads_perf_counter_unless_given_another_clock():
    client = OpenAIClient("http://h:1", None, "completions", timeout=1.0)
    before = time.perf_counter()
    now = client.clock.now()
    assert before <= now <= time.perf_counter()


# arrivals


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_arrivals_offer_exactly_the_rate(burstiness):
    offsets = arrival_offsets(8.0, 200, burstiness, seed=1)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert (len(offsets) - 1) / offsets[-1] == pytest.approx(8.0)
    gaps = np.diff(offsets)
    # A gamma gap of shape k has a coefficient of variation 1/sqrt(k).
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.25)
    assert arrival_offsets(8.0, 200, burstiness, seed=1) == offsets
    assert arrival_offsets(8.0, 200, burstiness, seed=2) != offsets


def test_arrivals_edge_cases():
    assert arrival_offsets(math.inf, 3) == [0.0, 0.0, 0.0]
    assert arrival_offsets(5.0, 1) == [0.0]
    assert num_arrivals(2.0, 10.0) == 21


# metrics


def record(index, ttft, chunk_gaps, output_tokens=None, ok=True, kind=None, sent=0.0, scheduled=None):
    times = [ttft]
    for gap in chunk_gaps:
        times.append(times[-1] + gap)
    r = RequestRecord(index, scheduled, sent, max_tokens=len(times), ok=ok, error_kind=kind)
    if ok:
        r.ttft, r.chunk_times, r.e2e = ttft, times, times[-1]
        r.output_tokens, r.output_tokens_source = output_tokens or len(times), "usage"
        r.prompt_tokens, r.prompt_tokens_source = 10, "usage"
    r.finished = sent + (times[-1] if ok else 0.05)
    return r


def test_distribution_matches_numpy():
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    d = Distribution.of(values, scale=1000)
    assert (d.count, d.mean, d.median, d.max) == (5, 3000.0, 3000.0, 5000.0)
    assert d.p90 == pytest.approx(4600.0) and d.p99 == pytest.approx(4960.0)
    assert Distribution.of([]) is None


def test_summary_math():
    records = [
        record(0, 0.1, [0.02, 0.02, 0.02], sent=0.0, scheduled=0.0),  # 4 tokens, e2e 0.16
        record(1, 0.2, [0.01, 0.03], sent=0.5, scheduled=0.499),  # 3 tokens, e2e 0.24
        record(2, 0.3, [0.05], output_tokens=6, sent=1.0, scheduled=0.998),  # 2 chunks, 6 tokens
        record(3, 0, [], ok=False, kind="http_500", sent=1.5, scheduled=1.5),
    ]
    shape = LoadShape(request_rate=2.0, num_requests=4)
    result = RunResult(shape, records, duration=2.0, max_in_flight=2, started_at=0.0)
    s = summarize(result, Slo({"ttft": 250, "tpot": 25}))
    assert (s.num_requests, s.num_ok, s.num_failed, s.failures) == (4, 3, 1, {"http_500": 1})
    assert s.request_throughput == pytest.approx(1.5)
    assert s.output_tokens == 4 + 3 + 6 and s.output_throughput == pytest.approx(13 / 2)
    assert s.input_tokens == 30 and s.total_token_throughput == pytest.approx(43 / 2)
    assert s.ttft_ms.mean == pytest.approx(200.0)
    # TPOT = (e2e - ttft) / (tokens - 1): 60/3, 40/2, 50/5 ms.
    assert s.tpot_ms.mean == pytest.approx((20 + 20 + 10) / 3)
    # ITL pools every gap of every request.
    assert s.itl_ms.count == 6 and s.itl_ms.mean == pytest.approx(150 / 6)
    assert s.e2e_ms.mean == pytest.approx((160 + 240 + 350) / 3)
    assert s.achieved_arrival_rate == pytest.approx(3 / 1.5)
    assert s.send_lag_ms.max == pytest.approx(2.0)
    # Requests 0 and 1 meet ttft <= 250 and tpot <= 25; request 2's TTFT is 300 ms; 3 failed.
    assert s.goodput == pytest.approx(2 / 2.0) and s.slo_attainment == pytest.approx(0.5)
    assert s.token_sources == {"input": {"usage": 3}, "output": {"usage": 3}}


def test_slo_itl_and_e2e():
    r = record(0, 0.1, [0.01, 0.09])
    assert meets_slo(r, Slo({"e2e": 200})) and not meets_slo(r, Slo({"itl": 50}))
    single = record(1, 0.1, [])
    assert single.tpot is None and meets_slo(single, Slo({"tpot": 1}))


# configuration


def test_config_parsing_and_errors():
    assert Sweep.parse("rate=1,2.5,inf").values == (1.0, 2.5, math.inf)
    assert [s.max_concurrency for s in Sweep.parse("concurrency=1,4").shapes(LoadShape(max_concurrency=1,
                                                                                      num_requests=5))] == [1, 4]
    assert Slo.parse("ttft:200, tpot:50").limits_ms == {"ttft": 200.0, "tpot": 50.0}
    for bad in ("rate", "speed=1", "concurrency=1.5", "rate=a"):
        with pytest.raises(LoadTestError):
            Sweep.parse(bad)
    for bad in ("ttft", "ttft:x", "foo:1", "ttft:-1"):
        with pytest.raises(LoadTestError):
            Slo.parse(bad)
    with pytest.raises(LoadTestError):
        LoadShape(max_concurrency=1, num_requests=1, duration=1)
    with pytest.raises(LoadTestError):
        LoadShape(request_rate=math.inf, duration=1)
    with pytest.raises(LoadTestError):
        WorkloadConfig(range_ratio=1.0)


def test_json_safe():
    assert json.dumps(json_safe({"r": math.inf, "n": math.nan, "l": [1.5]})) == '{"r": "inf", "n": null, "l": [1.5]}'


# Prometheus

BEFORE = """# HELP ladder_request_prefill_seconds prefill
# TYPE ladder_request_prefill_seconds histogram
ladder_request_prefill_seconds_bucket{le="0.1"} 1
ladder_request_prefill_seconds_bucket{le="0.2"} 1
ladder_request_prefill_seconds_bucket{le="+Inf"} 1
ladder_request_prefill_seconds_sum 0.05
ladder_request_prefill_seconds_count 1
ladder_engine_step_seconds_total{phase="forward"} 1.0
ladder_engine_step_seconds_total{phase="sample"} 0.5
ladder_generation_tokens_total 10
"""
AFTER = """ladder_request_prefill_seconds_bucket{le="0.1"} 3
ladder_request_prefill_seconds_bucket{le="0.2"} 5
ladder_request_prefill_seconds_bucket{le="+Inf"} 5
ladder_request_prefill_seconds_sum 0.65
ladder_request_prefill_seconds_count 5
ladder_engine_step_seconds_total{phase="forward"} 4.0 1712345678000
ladder_engine_step_seconds_total{phase="sample"} 1.5
ladder_engine_step_seconds_total{phase="schedule"} 0.5
ladder_generation_tokens_total 110
ladder_requests_finished_total{reason="length",model="a \\"b\\""} 4
"""


def test_prometheus_parse_and_breakdown():
    samples = parse_prometheus(AFTER)
    assert samples[(STEP_SECONDS, (("phase", "forward"),))] == 4.0
    assert samples[("ladder_requests_finished_total", (("model", 'a "b"'), ("reason", "length")))] == 4
    assert is_ladder(samples) and not is_ladder(parse_prometheus("process_cpu_seconds_total 3\n"))
    server = breakdown(BEFORE, AFTER)
    prefill = server.phases["prefill"]
    assert prefill.count == 4 and prefill.mean_ms == pytest.approx(150.0)
    # 2 of the 4 new observations lie in (0, 0.1] and 2 in (0.1, 0.2]: the median is at 0.1 s.
    assert prefill.p50_ms == pytest.approx(100.0)
    assert server.step_seconds == pytest.approx({"schedule": 0.5, "forward": 3.0, "sample": 1.0})
    assert list(server.step_seconds) == ["schedule", "forward", "sample"]
    assert server.generation_tokens == 100 and server.prompt_tokens is None
    assert server.finished == {"length": 4}
    assert breakdown(None, AFTER) is None
    assert breakdown("up 1\n", "up 1\n") is None
    assert PREFILL_SECONDS in AFTER and GENERATION_TOKENS in AFTER


def test_histogram_quantile():
    buckets = {0.1: 10.0, 0.5: 20.0, math.inf: 20.0}
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.05)
    assert histogram_quantile(0.75, buckets) == pytest.approx(0.3)
    assert histogram_quantile(0.5, {0.1: 0.0, math.inf: 0.0}) is None
    assert histogram_quantile(0.99, {0.1: 1.0, math.inf: 5.0}) == 0.1


# workloads


def test_random_workload_is_repeatable_and_shaped():
    config = WorkloadConfig(input_len=40, output_len=20, range_ratio=0.5, prefix_len=8, seed=7)
    workload = RandomWorkload(config, None)
    specs = [workload.request(i) for i in range(50)]
    assert [s.prompt for s in specs] == [RandomWorkload(config, None).request(i).prompt for i in range(50)]
    assert RandomWorkload(WorkloadConfig(input_len=40, seed=8), None).request(0).prompt != specs[0].prompt
    prefix = workload.prefix
    assert len(prefix.split()) == 8 and all(s.prompt.startswith(prefix + " ") for s in specs)
    lengths = [len(s.prompt.split()) - 8 for s in specs]
    assert min(lengths) >= 20 and max(lengths) <= 60 and len(set(lengths)) > 10
    assert all(10 <= s.max_tokens <= 30 for s in specs)
    assert all(s.prompt_tokens == len(s.prompt.split()) and s.prompt_tokens_source == "estimate" for s in specs)
    assert len({s.prompt for s in specs}) == 50
    assert specs[0].messages == ({"role": "user", "content": specs[0].prompt},)


def test_several_shared_prefixes_take_turns():
    config = WorkloadConfig(input_len=10, output_len=4, prefix_len=12, num_prefixes=3, seed=2)
    workload = RandomWorkload(config, None)
    assert len(set(workload.prefixes)) == 3 and workload.prefix == workload.prefixes[0]
    # Group 0 is the prefix a single-prefix workload of the same seed has.
    assert workload.prefix == RandomWorkload(WorkloadConfig(input_len=10, prefix_len=12, seed=2), None).prefix
    for i in range(9):
        assert workload.request(i).prompt.startswith(workload.prefixes[i % 3] + " ")
    for bad, message in (({"num_prefixes": 0, "prefix_len": 4}, "at least 1"), ({"num_prefixes": 2}, "--prefix-len")):
        with pytest.raises(LoadTestError, match=message):
            WorkloadConfig(**bad)


def test_exact_lengths_with_a_tokenizer(tiny_tokenizer):
    counter = TokenCounter(tiny_tokenizer)
    rng = random.Random(0)
    for n in (1, 2, 5, 33, 300):
        assert counter.count(counter.exact_text(rng, n)) == n
    workload = RandomWorkload(WorkloadConfig(input_len=37, prefix_len=11, seed=1), counter)
    for i in range(5):
        spec = workload.request(i)
        assert spec.prompt_tokens == counter.count(spec.prompt) == 48 and spec.prompt_tokens_source == "tokenizer"
        assert counter.count(workload.prefix) == 11


def test_tokenizer_errors(tmp_path):
    with pytest.raises(LoadTestError, match="no tokenizer.json"):
        TokenCounter(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(LoadTestError, match="cannot read"):
        TokenCounter(str(tmp_path))


def test_file_workload_formats(tmp_path):
    lines = [
        {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "hello there"},
                           {"from": "gpt", "value": "x" * 40}, {"from": "human", "value": "more"}]},
        {"messages": [{"role": "user", "content": "what is up"}], "max_tokens": 9},
        {"prompt": "complete this"},
        "a bare string",
        {"conversations": [{"from": "gpt", "value": "no human turn"}]},
        {"something": "else"},
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    workload = build_workload(WorkloadConfig(dataset="file", dataset_path=str(path), seed=0))
    assert isinstance(workload, FileWorkload) and len(workload.conversations) == 4
    by_prompt = {s.prompt: s for s in (workload.request(i) for i in range(4))}
    assert set(by_prompt) == {"hello there", "what is up", "complete this", "a bare string"}
    sharegpt = by_prompt["hello there"]
    assert sharegpt.messages == ({"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"})
    assert sharegpt.max_tokens == 10  # the reply's 40 characters, estimated at 4 per token
    assert by_prompt["what is up"].max_tokens == 9
    assert by_prompt["complete this"].max_tokens == 128
    assert workload.request(4).prompt == workload.request(0).prompt  # cycles
    fixed = build_workload(WorkloadConfig(dataset="file", dataset_path=str(path), output_len=5))
    assert {fixed.request(i).max_tokens for i in range(4)} == {5}
    as_list = tmp_path / "data.json"
    as_list.write_text(json.dumps(lines))
    assert len(build_workload(WorkloadConfig(dataset="file", dataset_path=str(as_list))).conversations) == 4


def test_file_workload_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{oops\n')
    with pytest.raises(LoadTestError, match=r"bad.jsonl:2"):
        build_workload(WorkloadConfig(dataset="file", dataset_path=str(bad)))
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"foo": 1}\n')
    with pytest.raises(LoadTestError, match="no usable prompts"):
        build_workload(WorkloadConfig(dataset="file", dataset_path=str(empty)))
    with pytest.raises(LoadTestError, match="needs --dataset-path"):
        WorkloadConfig(dataset="file")
