import os

import pytest

from tests.zoo.harness import results_path

# The HF models are built from configs in code; nothing may be downloaded. Set before the
# rank processes are spawned, so they inherit it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session", autouse=True)
def zoo_results_file():
    """Start each session's results file empty; ranks append one line per case (harness.record)."""
    path = results_path()
    if os.path.exists(path):
        os.remove(path)
    yield path
    if os.path.exists(path):
        print(f"\nzoo results: {path}")
