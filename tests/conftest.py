"""
Keeps the test suite hermetic (cost tables measured by `"auto"` go to a temporary directory of this run) and lets it
run on several workers (`pytest -n 2 --dist loadscope`, as `make test` does): each worker takes its share of the
cores, a test class runs in one worker (its shared setup once), and the longest tests start first.
"""

import os
import shutil
import tempfile

import pytest
import torch

from transformers_lookahead.cost_measurement import COST_DIR_VARIABLE

_DIRECTORY = pytest.StashKey[str]()


def pytest_configure(config):
    directory = tempfile.mkdtemp(prefix="lookahead-cost-tables-")
    config.stash[_DIRECTORY] = directory
    os.environ[COST_DIR_VARIABLE] = directory
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        # Workers with a thread per core each fight over the cores: two of two threads each on two cores decoded 5x
        # slower than two of one thread (measured). The processes a test starts (servers, the stock venv) inherit
        # the share through `OMP_NUM_THREADS`.
        threads = max(1, len(os.sched_getaffinity(0)) // int(workers))
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


def pytest_collection_modifyitems(config, items):
    # The longest tests first, so that the other workers take everything else meanwhile instead of waiting for them
    # at the end (the order tests run in is otherwise collection order; nothing depends on it).
    items.sort(key=lambda item: item.get_closest_marker("long_running") is None)


def pytest_unconfigure(config):
    directory = config.stash.get(_DIRECTORY, None)
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)
