"""Who may read /metrics and /stats: with an API key they need it (by default), and /stats names no
filesystem path. Tiny model, in-process servers."""

from __future__ import annotations

import httpx
import pytest
from in_process_server import InProcessServer, make_state

from server.app import ServerSettings

KEY = "metrics-key-1"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROTECTED = ("/metrics", "/stats")


@pytest.fixture(scope="module")
def keyed(tiny_dir):
    running = InProcessServer(make_state(tiny_dir, api_key=KEY))
    yield running
    running.stop()


def test_with_a_key_metrics_and_stats_need_it_by_default(keyed):
    for path in PROTECTED:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            refused = httpx.get(keyed.url + path, headers=headers, timeout=10)
            assert refused.status_code == 401, path
            assert refused.json()["error"]["code"] == "invalid_api_key"
            assert "prefix" not in refused.text  # nothing of the figures
        assert httpx.get(keyed.url + path, headers=AUTH, timeout=10).status_code == 200, path
    assert "ladder_prefix_cache_hits_total" in httpx.get(keyed.url + "/metrics", headers=AUTH, timeout=10).text
    # Probes and the page itself stay open: orchestrators and browsers reach them without a key.
    for path in ("/health", "/ready", "/", "/static/dashboard.js"):
        assert httpx.get(keyed.url + path, timeout=10).status_code == 200, path


def test_the_open_choice_and_no_key_leave_them_open(keyed):
    keyed.state.settings.protect_metrics = False
    try:
        for path in PROTECTED:
            assert httpx.get(keyed.url + path, timeout=10).status_code == 200, path
    finally:
        keyed.state.settings.protect_metrics = None
    assert httpx.get(keyed.url + "/stats", timeout=10).status_code == 401  # the default again
    assert not ServerSettings().metrics_need_key and ServerSettings(api_key=KEY).metrics_need_key
    with pytest.raises(ValueError, match="protect_metrics needs an api_key"):
        ServerSettings(protect_metrics=True)


def test_stats_names_no_filesystem_path(keyed, tiny_dir):
    stats = httpx.get(keyed.url + "/stats", headers=AUTH, timeout=10)
    model = stats.json()["model"]
    assert model["name"] == tiny_dir.name and "path" not in model
    assert str(tiny_dir) not in stats.text and str(tiny_dir.parent) not in stats.text


def test_protect_metrics_without_a_key_is_refused_in_one_line(capsys, monkeypatch):
    from ladder.cli import main

    monkeypatch.delenv("LADDER_API_KEY", raising=False)
    assert main(["serve", "--protect-metrics"]) == 1
    assert capsys.readouterr().err.strip() == ("ladder serve: error: --protect-metrics needs an API key "
                                               "(--api-key or $LADDER_API_KEY)")


def test_the_doctor_reads_a_protected_server_with_its_key(keyed):
    from doctor.remote import fetch, read_stats

    assert read_stats(keyed.url, KEY)["model"]["config"]["hidden_size"] == 32
    assert b"ladder_engine_alive" in fetch(keyed.url + "/metrics", KEY)
    with pytest.raises(ValueError, match="answered 401"):
        read_stats(keyed.url)
