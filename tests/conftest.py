import sys
from pathlib import Path

# Test helpers (tiny model writers) live beside the tests.
sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def ladder_server(tmp_path_factory):
    """One real `ladder serve` of the default model, shared by the end-to-end tests."""
    from server_process import API_KEY, ServerProcess

    log = tmp_path_factory.mktemp("serve") / "server.log"
    proc = ServerProcess("--api-key", API_KEY, "--kv-cache-memory", "0.25", "--max-model-len", "1024",
                         "--max-body-bytes", "65536", "--max-num-seqs", "32", log=log)
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def default_model():
    """The embedded default model in fp32, loaded once for every test that only reads it."""
    import model

    return model.load()
