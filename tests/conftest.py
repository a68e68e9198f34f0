"""Keeps the test suite hermetic: cost tables measured by `"auto"` go to a temporary directory of this run."""

import os
import shutil
import tempfile

from transformers_lookahead.cost_model import COST_DIR_VARIABLE

_created: list[str] = []


def pytest_configure(config):
    directory = tempfile.mkdtemp(prefix="lookahead-cost-tables-")
    _created.append(directory)
    os.environ[COST_DIR_VARIABLE] = directory


def pytest_unconfigure(config):
    for directory in _created:
        shutil.rmtree(directory, ignore_errors=True)
