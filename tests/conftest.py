"""
Keeps the test suite hermetic (cost tables measured by `"auto"` go to a temporary directory of this run) and lets it
run on several workers (`pytest -n 2`, as `make test` does): each worker takes its share of the cores, and the tests
of a class that sets up shared state (`setUpClass`: a model, its greedy references, a server, a venv) stay in one
worker, so that the state is built once.
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
        # A worker with a thread per core would fight the others for them; the processes a test starts (servers,
        # the stock venv) inherit the share through `OMP_NUM_THREADS`.
        threads = max(1, len(os.sched_getaffinity(0)) // int(workers))
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # Before xdist reads the groups (`--dist loadgroup`); without xdist the mark is inert.
    for item in items:
        if item.cls is not None and "setUpClass" in vars(item.cls):
            item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}.{item.cls.__name__}"))


def pytest_unconfigure(config):
    directory = config.stash.get(_DIRECTORY, None)
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)
