"""`ladder loadtest --endpoint responses` against a real ladder server (the tiny chat model, in process): every
request streams OpenAI's Responses events, and the run counts the same tokens as the chat endpoint's run of
the same workload, from the servers' own usage."""

from __future__ import annotations

import argparse
import asyncio

import pytest
from in_process_server import InProcessServer, make_state

from loadtest.cli import add_parser, config_from_args
from loadtest.measure import measure


@pytest.fixture(scope="module")
def server(tiny_dir):
    server = InProcessServer(make_state(tiny_dir, max_model_len=512))
    yield server
    server.stop()


def run(server, endpoint: str):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["loadtest", "--base-url", server.url, "--quiet", "--endpoint", endpoint,
                              "--num-requests", "6", "--max-concurrency", "3", "--input-len", "24",
                              "--output-len", "8"])
    return asyncio.run(measure(config_from_args(args))).points[0].run.records


def test_the_responses_endpoint_is_measured_like_chat(server):
    responses, chat = run(server, "responses"), run(server, "chat")
    assert all(r.ok for r in responses), [r.error for r in responses]
    for record in responses:
        assert record.output_tokens == 8 and record.output_tokens_source == "usage"
        assert record.prompt_tokens_source == "usage" and record.finish_reason == "length"
        assert record.ttft is not None and record.e2e >= record.ttft and len(record.chunk_times) == 8
    assert [r.prompt_tokens for r in responses] == [r.prompt_tokens for r in chat]
