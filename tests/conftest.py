import os

import pytest

# Tests run on the CPU with gloo even where an accelerator exists, so results do not depend on the machine.
os.environ.setdefault("LMT_DEVICE", "cpu")


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

