"""How the benchmarks time a generation and what they record of it: one timer, one record shape."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


def percentile(values: list[float], fraction: float) -> float:
    """The nearest-rank percentile `fraction` (0.95 for p95) of `values`: the smallest value with that share at most."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered), -(-round(100 * fraction) * len(ordered) // 100)) - 1)]


def provenance(root: Path | None = None) -> dict:
    """
    When, on which revision of this repository and on how many cores a result was measured, as every result file
    records it (`utils/render_results.py` shows it beside the table). The revision ends in `+dirty` where the work
    tree had uncommitted changes to tracked files, and is `None` outside a git checkout.

    Args:
        root (`Path`, *optional*): the checkout whose revision to record (this repository by default).
    """
    root = root or Path(__file__).resolve().parent.parent

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    revision = git("rev-parse", "--short=7", "HEAD")
    if revision and git("status", "--porcelain", "--untracked-files=no"):
        revision += "+dirty"
    return {
        "date": datetime.datetime.now(datetime.UTC).date().isoformat(),
        "revision": revision,
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
    }


def _cpuinfo(field: str) -> str | None:
    """The value of a `/proc/cpuinfo` field for the first CPU, or `None` where there is no such file or field."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith(field)), None)


def cpu_model() -> str:
    """The CPU's model name, as `/proc/cpuinfo` gives it (the platform's processor name elsewhere)."""
    return _cpuinfo("model name") or platform.processor()


def native_half_precision(device: torch.device, cpu_flags: str | None = None) -> str | None:
    """
    `"bfloat16"` (or `"float16"`) where `device` computes it natively, else `None`: a CPU without bf16 instructions
    emulates it, slower than float32.

    Args:
        cpu_flags (`str`, *optional*): the CPU's feature flags (read from `/proc/cpuinfo` when not given).
    """
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    if device.type != "cpu":
        return None
    cpu_flags = cpu_flags if cpu_flags is not None else _cpuinfo("flags")
    if cpu_flags is None:
        return None
    flags = set(cpu_flags.replace(":", " ").split())
    return "bfloat16" if flags & {"avx512_bf16", "amx_bf16"} else None


@dataclass
class Run:
    """
    One generation of one prompt (or one batch) by one method. The fields after `identical_to_greedy` say where the
    run belongs, for the benchmarks that have it; a record (`record`) leaves out the ones a benchmark does not set.
    """

    prompt_id: str | None
    method: str
    repeat: int
    new_tokens: int
    seconds: float
    forward_seconds: float
    forward_passes: int
    identical_to_greedy: bool | None = None
    category: str | None = None
    temperature: float | None = None
    batch_size: int | None = None
    batch: int | None = None
    workload: str | None = None

    def record(self) -> dict:
        """The run as the JSON files hold it."""
        optional = ("prompt_id", "category", "temperature", "batch_size", "batch", "workload")
        return {key: value for key, value in asdict(self).items() if value is not None or key not in optional}


class ForwardTimer:
    """
    Counts the model's forward passes and their time, through module hooks (for every method alike); `passes` holds
    each pass's `(query tokens, seconds)` (`None` tokens where the pass took no `input_ids`), `spans` its start and
    end (`perf_counter`), so that the host's time between passes can be read too.
    """

    def __init__(self, model):
        self.model = model
        self.reset()
        model.register_forward_pre_hook(self._start, with_kwargs=True)
        model.register_forward_hook(self._stop, with_kwargs=True)

    def reset(self):
        self.calls, self.seconds, self._began = 0, 0.0, 0.0
        self.passes: list[tuple[int | None, float]] = []
        self.spans: list[tuple[float, float]] = []
        self._tokens: int | None = None

    def generate(self, *args, **kwargs):
        """
        `model.generate(*args, **kwargs)` timed end to end, the device synchronised, with this timer's counts reset
        first (so `calls` and `seconds` are that call's): returns the output and the wall seconds.
        """
        self.reset()
        start = time.perf_counter()
        out = self.model.generate(*args, **kwargs)
        self._sync()
        return out, time.perf_counter() - start

    def _sync(self):
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)

    def _start(self, module, args, kwargs):
        self._sync()
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._tokens = ids.shape[-1] if isinstance(ids, torch.Tensor) else None
        self._began = time.perf_counter()

    def _stop(self, module, args, kwargs, output):
        self._sync()
        ended = time.perf_counter()
        elapsed = ended - self._began
        self.calls += 1
        self.seconds += elapsed
        self.passes.append((self._tokens, elapsed))
        self.spans.append((self._began, ended))
