import os
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


# Files that take minutes (Inductor compiles) go first, so that under pytest-xdist (`make test` runs two
# workers, a file per worker) they overlap the many short files instead of running last on their own.
# test_ray_serve.py (a local Ray instance, about a minute of waiting on it) follows them for the same reason.
FIRST = ("test_compile_default.py", "test_compile.py", "test_ray_serve.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))  # stable: the rest keep their order


def pytest_configure(config):
    # Each xdist worker takes its share of the cores: two workers of two torch threads each on a
    # 2-core machine spin against each other and run several times slower than one.
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))
