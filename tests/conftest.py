import os
import sys

import pytest

# Tests run on the CPU with gloo even where an accelerator exists, so results do not depend on the machine.
os.environ.setdefault("LMT_DEVICE", "cpu")
# One intra-op thread in this process and in the processes it starts (as each spawned rank of a 2-core machine
# has, and as torchrun sets): the tests' tiny ops gain nothing from a second OpenMP thread, and crawl when other
# jobs hold the cores (a 12-step one-process run: 2 s on one thread, 30 s on two under load).
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:  # imported before this file (by a plugin): too late for the variable
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> str:
    """~200 KB of real Python source (a few stdlib modules): quick to load on every rank."""
    from large_model_training.data.corpus import stdlib_files

    files = [f for f in stdlib_files() if os.path.basename(f) in
             ("argparse.py", "dataclasses.py", "functools.py", "textwrap.py", "typing.py")]
    path = tmp_path_factory.mktemp("corpus") / "corpus"
    path.mkdir()
    for f in files:
        (path / os.path.basename(f)).write_bytes(open(f, "rb").read())
    return str(path)

