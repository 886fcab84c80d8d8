"""The dashboard in a real headless browser: Debian's Chromium driven by Playwright, against a real
`ladder serve` of a tiny model. `make setup` installs both; elsewhere the test says what is missing."""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

import httpx
import pytest

from server_process import API_KEY

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]

pytestmark = [
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium (make setup)"),
    pytest.mark.skipif(importlib.util.find_spec("playwright") is None,
                       reason="needs the playwright package (pip install -e '.[test]')"),
]


@pytest.fixture(scope="module")
def server(tiny_dir):
    from engine.async_engine import AsyncLLMEngine
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from in_process_server import InProcessServer
    from server.app import ServerSettings, ServerState

    state = ServerState(ServerSettings(api_key=API_KEY))
    state.attach(AsyncLLMEngine(LLMEngine(EngineConfig(model=str(tiny_dir), kv_cache_memory_gib=0.02,
                                                       max_model_len=512))))
    running = InProcessServer(state)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser, server):
    page = browser.new_page(viewport={"width": 1280, "height": 860})
    page.goto(server.url + "/")
    yield page
    page.close()


# Records the assistant text each time it changes, so the test sees the words arrive one update at a time.
WATCH_ANSWER = """() => {
  window.answerLengths = [];
  new MutationObserver(() => {
    const answers = document.querySelectorAll('.message.assistant .text');
    if (answers.length) window.answerLengths.push(answers[answers.length - 1].textContent.length);
  }).observe(document.getElementById('transcript'), {childList: true, subtree: true, characterData: true});
}"""


def test_the_chat_box_streams_the_answer_and_asks_for_the_key(page):
    page.fill("#max-tokens", "48")
    page.fill("#question", "What is the capital of France?")
    page.press("#question", "Enter")
    page.wait_for_function("document.getElementById('chat-error').textContent.length > 0")
    assert "API key" in page.inner_text("#chat-error")  # the server wants a key and the page says so

    page.fill("#api-key", API_KEY)
    page.evaluate(WATCH_ANSWER)
    page.fill("#question", "What is the capital of France?")
    page.click("#send")
    page.wait_for_selector(".message.assistant.done >> nth=1", timeout=30_000)
    lengths = page.evaluate("window.answerLengths")
    growing = sorted({n for n in lengths if n > 0})
    assert len(growing) >= 2, f"the answer arrived in one piece: {lengths}"
    answer = page.locator(".message.assistant .text").nth(1).inner_text()
    assert len(answer) == growing[-1] and page.inner_text("#chat-error") == ""
    assert page.locator(".message.user").nth(1).inner_text().endswith("What is the capital of France?")


def test_the_tokens_per_second_panel_moves_under_load(page, server, tmp_path):
    page.fill("#api-key", API_KEY)  # a server with a key protects /stats, which the panels read
    page.wait_for_function("document.getElementById('status').textContent === 'ready'")
    page.wait_for_function("document.getElementById('tokens-per-s').textContent !== '–'")  # two polls in
    idle = float(page.inner_text("#tokens-per-s"))
    stop = threading.Event()

    def stream_until_stopped(max_tokens: int) -> None:
        # A new stream as soon as one ends: on a fast host 400 tokens are over before the next poll. The
        # streams' lengths differ, so that they do not all end in the same step and leave the engine idle
        # for the moment the next ones take to arrive.
        body = {"prompt": "Count to a thousand:", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        while not stop.is_set():
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60,
                              headers={"Authorization": f"Bearer {API_KEY}"}) as response:
                for _ in response.iter_lines():
                    if stop.is_set():
                        return  # closing the stream aborts the request

    workers = [threading.Thread(target=stream_until_stopped, args=(n,)) for n in (400, 461, 523)]
    for worker in workers:
        worker.start()
    try:
        # One poll's two panels, read together: tokens/s above idle and streams running in the engine.
        seen = page.wait_for_function(
            """idle => {
                const busy = parseFloat(document.getElementById('tokens-per-s').textContent);
                const running = parseInt(document.getElementById('running').textContent);
                return busy > idle && running >= 1 ? [busy, running] : false;
            }""", arg=idle, timeout=30_000)
        busy, running = seen.json_value()
        page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
    finally:
        stop.set()
        for worker in workers:
            worker.join(60)
    assert busy > idle
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
    assert running >= 1  # the same poll saw the streams in the engine
    phases = page.locator("#phases .row")
    assert phases.count() == 4 and "forward" in phases.nth(2).inner_text()
