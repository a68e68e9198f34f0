"""Keeps the test suite hermetic: cost tables measured by `"auto"` go to a temporary directory of this run."""

import os
import shutil
import tempfile

import pytest

from transformers_lookahead.cost_measurement import COST_DIR_VARIABLE

_DIRECTORY = pytest.StashKey[str]()


def pytest_configure(config):
    directory = tempfile.mkdtemp(prefix="lookahead-cost-tables-")
    config.stash[_DIRECTORY] = directory
    os.environ[COST_DIR_VARIABLE] = directory


def pytest_unconfigure(config):
    directory = config.stash.get(_DIRECTORY, None)
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)
