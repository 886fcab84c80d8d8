"""SIGTERM's drain waits for every HTTP request already in, also one that has not reached the engine yet
(still being tokenized): `ladder serve`'s DrainingServer in a thread of the test, over a tiny model."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import uvicorn
from in_process_server import make_state
from server_process import free_port
from waiting import wait_until

from ladder.serve import DrainingServer
from server.app import create_app


def test_the_drain_waits_for_a_request_still_being_tokenized(tiny_dir):
    state = make_state(tiny_dir)
    port = free_port()
    # A short graceful timeout: once the drain lets go, uvicorn cancels what is left within 0.2 s, so a
    # drain that let go too early would cut the request below.
    config = uvicorn.Config(create_app(state), port=port, log_level="warning", timeout_graceful_shutdown=0.2)
    server = DrainingServer(config, state, shutdown_timeout=60)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    tokenizer = state.engine.info.tokenizer
    entered, release = threading.Event(), threading.Event()
    real = tokenizer.encode

    def slow_encode(text, *args, **kwargs):  # the request sits in tokenization until the test releases it
        entered.set()
        release.wait(60)
        return real(text, *args, **kwargs)

    answers: list[httpx.Response | Exception] = []

    def send() -> None:
        try:
            answers.append(httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3,
                                                                     "ignore_eos": True}, timeout=60))
        except httpx.HTTPError as error:
            answers.append(error)

    try:
        wait_until(lambda: server.started, what="uvicorn started")
        tokenizer.encode = slow_encode
        sender = threading.Thread(target=send)
        sender.start()
        assert entered.wait(30), "the request never reached the tokenizer"
        assert state.engine.num_in_flight == 0  # not in the engine yet: the old drain ended here
        server.handle_exit(signal.SIGTERM, None)
        assert httpx.get(url + "/ready", timeout=10).status_code == 503  # draining
        time.sleep(1.0)  # long enough for a drain that ignored the request to have stopped the server
        assert not server.should_exit and thread.is_alive()
        release.set()
        sender.join(60)
        thread.join(30)
    finally:
        release.set()
        del tokenizer.encode  # the class's method again
        server.should_exit = True
        thread.join(30)
        state.engine.shutdown()
    assert len(answers) == 1 and isinstance(answers[0], httpx.Response), answers
    assert answers[0].status_code == 200 and answers[0].json()["usage"]["completion_tokens"] == 3
    assert not thread.is_alive()  # and then the drain let the server stop
