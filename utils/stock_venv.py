"""
A virtual environment holding stock torch and Transformers (with Transformers' serving extras) and nothing of ours:
where a Hub user runs the strategy. Built once per pin set and kept under the assets' cache directory; used by
`tests/test_hub_repo.py` and `utils/hub_benchmark.py`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from utils.assets import default_cache_dir, exclusive  # noqa: E402


def stock_pins() -> list[str]:
    """The packages the venv holds: the torch and Transformers releases this suite runs with, nothing else of ours."""
    torch_version = importlib.metadata.version("torch").split("+")[0]
    transformers_version = importlib.metadata.version("transformers")
    return [f"torch=={torch_version}", f"transformers[serving]=={transformers_version}"]


def stock_python(timeout: float = 900) -> Path:
    """
    The interpreter of the stock venv, built on first use and again whenever the pins change (its folder is named by
    their hash). `pins.json` is written last: a venv without it was not finished, and is built again.
    """
    pins = stock_pins()
    digest = hashlib.sha256(json.dumps([sys.version_info[:2], pins]).encode()).hexdigest()[:12]
    folder = default_cache_dir() / f"stock-venv-{digest}"
    python = folder / "bin" / "python"
    with exclusive(folder):
        if not (folder / "pins.json").is_file():
            # Built in place: a venv's scripts (`bin/transformers`) name the interpreter by its absolute path.
            shutil.rmtree(folder, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True, timeout=300)
            # The pinned torch first, alone: asked for through another package, pip would take a multi-GB CUDA build.
            for requirement in pins:
                subprocess.run(
                    [str(python), "-m", "pip", "install", "--quiet", requirement], check=True, timeout=timeout
                )
            (folder / "pins.json").write_text(json.dumps(pins))
    return python


def run_in_stock_venv(script: Path, job: dict, timeout: float = 600) -> dict:
    """
    Runs `script` with `job` (as one JSON argument) in the stock venv, from an empty folder so that nothing of this
    repository is importable, and returns the JSON of the last line it printed.
    """
    python = stock_python()
    with tempfile.TemporaryDirectory() as empty:
        result = subprocess.run(
            [str(python), str(script), json.dumps(job)],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=empty,
            check=False,
        )
    if result.returncode != 0:
        raise RuntimeError(f"{script.name} failed in the stock venv ({result.returncode}):\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])
