import os
import sys
from pathlib import Path

# Test helpers (tiny model writers, server processes) live in tests/support/: helpers, not test modules.
sys.path.insert(0, str(Path(__file__).parent / "support"))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def ladder_server(tmp_path_factory):
    """One real `ladder serve` of the default model, shared by the end-to-end tests."""
    from server_process import API_KEY, LadderServer

    log = tmp_path_factory.mktemp("serve") / "server.log"
    proc = LadderServer("--api-key", API_KEY, "--kv-cache-memory", "0.25", "--max-model-len", "1024",
                         "--max-body-bytes", "65536", "--max-num-seqs", "32", log=log)
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny random-weight Llama with SmolLM2's tokenizer and chat template, written once per session.
    Tests only read it; one that needs to change a model writes its own."""
    from tiny_models import make_tiny_chat_model

    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny") / "tiny-chat")


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory):
    """`tiny_hf_dir(family)`: a tiny random-weight model of that family (tests/support/tiny_models.py) in a
    directory of its own, written once per session and only read by the tests."""
    from tiny_models import make_hf_model

    directories = {}

    def directory_for(family: str):
        if family not in directories:
            directory = tmp_path_factory.mktemp(family) / "model"
            make_hf_model(family, directory)
            directories[family] = directory
        return directories[family]

    return directory_for


@pytest.fixture(scope="session")
def default_model():
    """The embedded default model in fp32, loaded once for every test that only reads it."""
    import model

    return model.load()


# The slowest files go first, slowest first, so that under pytest-xdist (`make test` runs two workers, a
# file per worker) they overlap the many short files instead of running last on their own: the Inductor
# compiles (minutes each), a local Ray instance (about a minute of waiting on it), then the files of a
# minute or so (the default model in two ranks, `ladder serve` processes, doctor's runs, transformers).
FIRST = (
    "compile/test_compile.py",
    "deploy/test_ray_serve.py",
    "server/test_server.py",
    "e2e/test_default_model.py",
    "parallel/test_tensor_parallel.py",
    "compile/test_compile_default.py",
    "server/test_server_limits.py",
    "server/test_structured_outputs.py",
    "doctor/test_doctor.py",
    "kernels/test_avx2_build.py",
    "server/test_lora_serving.py",
    "engine/test_lora.py",
    "model/test_model_parity.py",
    "model/test_gemma3_file.py",
    "loadtest/test_loadtest_e2e.py",
    "server/test_reliability.py",
)


def pytest_collection_modifyitems(items):
    tests_dir = Path(__file__).parent
    rank = {tests_dir / name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path, len(FIRST)))  # stable: the rest keep their order


def pytest_configure(config):
    # pytest-xdist (3.7 and later) sorts the files by their number of tests before handing them out, which
    # would send the slow files with few tests last; keep the order above instead.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    # Each xdist worker takes its share of the cores: two workers of two torch threads each on a
    # 2-core machine spin against each other and run several times slower than one.
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


@pytest.fixture(autouse=True)
def seeded_random():
    """Each test starts from the same random state, whichever worker runs it and whatever ran before it:
    a test that draws from the global generators (`torch.randn` without a generator) draws the same numbers
    in CI as here, so a tolerance that holds here holds there."""
    import random

    import torch

    random.seed(0)
    torch.manual_seed(0)
