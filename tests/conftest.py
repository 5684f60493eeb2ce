import os
import sys
import tempfile

import pytest

# Tests run on the CPU with gloo even where an accelerator exists, so results do not depend on the machine.
os.environ.setdefault("LMT_DEVICE", "cpu")
# One intra-op thread in this process and in the processes it starts (as each spawned rank of a 2-core machine
# has, and as torchrun sets): the tests' tiny ops gain nothing from a second OpenMP thread, and crawl when other
# jobs hold the cores (a 12-step one-process run: 2 s on one thread, 30 s on two under load).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Raw --data is prepared once into a cache keyed by content: one per test session, not the user's ~/.cache.
SESSION_DATA_CACHE = None if "LMT_DATA_CACHE" in os.environ else tempfile.mkdtemp(prefix="lmt-test-data-")
os.environ.setdefault("LMT_DATA_CACHE", SESSION_DATA_CACHE or "")
if "torch" in sys.modules:  # imported before this file (by a plugin): too late for the variable
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> str:
    """~200 KB of real Python source (a few stdlib modules): quick to load on every rank."""
    from large_model_training.data.sources import stdlib_files

    files = [
        f
        for f in stdlib_files()
        if os.path.basename(f) in ("argparse.py", "dataclasses.py", "functools.py", "textwrap.py", "typing.py")
    ]
    path = tmp_path_factory.mktemp("corpus") / "corpus"
    path.mkdir()
    for f in files:
        (path / os.path.basename(f)).write_bytes(open(f, "rb").read())
    return str(path)


@pytest.fixture(scope="session")
def transformers():
    """The real package (a test dependency: the `test` extra), offline. Imported on first use, not at module
    level, so the spawned ranks, which import the test modules, do not pay for it."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    module = pytest.importorskip("transformers")
    module.utils.logging.disable_progress_bar()
    module.utils.logging.set_verbosity_error()
    return module


@pytest.fixture
def one_thread():
    """One intra-op thread for this test: tiny ops on two OpenMP threads crawl when other jobs hold the cores."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_sessionfinish(session, exitstatus):
    if SESSION_DATA_CACHE:
        import shutil

        shutil.rmtree(SESSION_DATA_CACHE, ignore_errors=True)
