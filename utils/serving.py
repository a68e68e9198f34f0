"""
`make serve`: SmolLM2-135M-Instruct behind `transformers serve` on 127.0.0.1, decoding with lookahead, in the dtype
`make bench` measures: bfloat16 where this machine computes it natively, else float32 (it says which).

    python utils/serving.py                   # writes the model folder once, then serves it on 127.0.0.1:8000
    python utils/serving.py --port 8123 --window 7 --dtype float32

Also the server process the tests and the benchmarks start and stop (`ServeProcess`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from utils.assets import default_cache_dir, model_path  # noqa: E402

LOOPBACK = "127.0.0.1"


def lookahead_folder(
    window: int | str = "auto",
    cache_dir: str | Path | None = None,
    plain: bool = False,
    memory: bool = False,
    model: str | None = None,
) -> Path:
    """
    A real model (`model`, a name of `utils.assets.MODELS`; SmolLM2-135M-Instruct by default) saved with
    `save_lookahead_model` (weights, tokenizer, `lookahead_window=window`, and `lookahead_memory=True` where `memory`
    is set, `custom_generate/`), written once per setting; with `plain=True` the same model as stock Transformers
    saves it.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from transformers_lookahead import save_lookahead_model, write_custom_generate
    from transformers_lookahead.model_folder import FOLDER_ENTRY

    source = model_path(model, cache_dir)
    name = "serve-plain" if plain else f"serve-lookahead-{window}" + ("-memory" if memory else "")
    if model not in (None, "smollm2"):
        name = f"{model}-{name}"
    folder = Path(cache_dir or default_cache_dir() / "assets") / name
    if (folder / "config.json").is_file():
        if not plain:
            # The entry point of the installed package, not of the one that wrote the folder.
            write_custom_generate(folder, FOLDER_ENTRY)
        return folder
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source)
    staging = folder.with_name(folder.name + ".part")
    shutil.rmtree(staging, ignore_errors=True)
    if plain:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
    else:
        settings = {"lookahead_memory": True} if memory else {}
        save_lookahead_model(model, staging, tokenizer, lookahead_window=window, **settings)
    staging.rename(folder)
    return folder


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((LOOPBACK, 0))
        return probe.getsockname()[1]


class ServeProcess:
    """
    `transformers serve FOLDER` on 127.0.0.1 and a free port, in its own process group; a context manager that waits
    until the server answers and always stops it (the whole group) on exit.

    Args:
        folder (`Path`): the model folder to serve.
        trust_remote_code (`bool`): load the folder's `custom_generate/` (lookahead decoding).
        threads (`int`, *optional*): torch threads of the server process.
        extra_args (`list[str]`, *optional*): more `transformers serve` options.
        startup_timeout (`float`): seconds to wait for the server to answer.
        environment (`dict[str, str]`, *optional*): environment variables to set for the server (e.g.
            `TRANSFORMERS_LOOKAHEAD_MEMORY_DIR`).
        python (`Path`, *optional*): the interpreter of the environment to serve from (its `transformers` script);
            defaults to this one's.
        dtype (`str`): the dtype the server loads the model in.
        proposed_hook (`bool`): serve through `utils/proposed_serving_hook.py`, which applies the guide's upstream
            proposal (a folder's `init_continuous_batching` bound too), to test it.
    """

    def __init__(
        self,
        folder: Path,
        trust_remote_code: bool = True,
        threads: int | None = None,
        extra_args: list[str] | None = None,
        startup_timeout: float = 240.0,
        environment: dict[str, str] | None = None,
        python: Path | None = None,
        dtype: str = "float32",
        proposed_hook: bool = False,
    ):
        self.folder = folder
        self.port = free_port()
        self.base_url = f"http://{LOOPBACK}:{self.port}/v1"
        self.startup_timeout = startup_timeout
        python = Path(python or sys.executable)
        launcher = [str(python), str(Path(__file__).with_name("proposed_serving_hook.py"))] if proposed_hook else []
        self.command = launcher or [str(python.with_name("transformers"))]
        self.command += ["serve", str(folder), "--host", LOOPBACK, "--port", str(self.port)]
        self.command += ["--device", "cpu", "--dtype", dtype, "--log-level", "warning"]
        if trust_remote_code:
            self.command.append("--trust-remote-code")
        self.command += extra_args or []
        self.environment = {**os.environ, **(environment or {})}
        if threads:
            self.environment.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        self.process: subprocess.Popen | None = None
        self.log_path: Path | None = None

    def __enter__(self) -> ServeProcess:
        import tempfile

        log = tempfile.NamedTemporaryFile(prefix="serve-", suffix=".log", delete=False)
        self.log_path = Path(log.name)
        self.process = subprocess.Popen(
            self.command, stdout=log, stderr=subprocess.STDOUT, env=self.environment, start_new_session=True
        )
        log.close()
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"transformers serve exited with {self.process.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/models", timeout=2):
                    return self
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"transformers serve did not answer within {self.startup_timeout} s:\n{self.log()}")

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def log(self) -> str:
        return self.log_path.read_text()[-5000:] if self.log_path and self.log_path.exists() else ""

    def stop(self) -> None:
        """Stops the server's process group: SIGTERM, then SIGKILL after 15 seconds."""
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=15)
        except ProcessLookupError:
            pass


def measure_step_costs_ahead(folder: Path, dtype: str = "float32") -> None:
    """
    Measures the step-cost table `"auto"` needs for the model in `folder` as the server will run it (`dtype`, this
    machine's threads) and keeps it where the server reads it, so that no user's first request waits for it.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from transformers_lookahead import LookaheadState

    LookaheadState().cost_model(AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)))


def serving_dtype(requested: str) -> str:
    """`requested`, or for `"auto"` the dtype `make bench` picks: bfloat16 where the CPU computes it natively."""
    import torch

    from utils.timing import native_half_precision

    if requested != "auto":
        return requested
    return native_half_precision(torch.device("cpu")) or "float32"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--window", default="auto", help='lookahead_window saved in the folder (an int or "auto")')
    parser.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="auto (default): bfloat16 where the CPU computes it natively, as `make bench`, else float32",
    )
    args = parser.parse_args(argv)
    window = args.window if args.window == "auto" else int(args.window)
    dtype = serving_dtype(args.dtype)
    print(f"serving in {dtype}" + (" (this CPU's native half precision)" if dtype == "bfloat16" else ""), flush=True)
    folder = lookahead_folder(window)
    if window == "auto":
        measure_step_costs_ahead(folder, dtype)
    command = [str(Path(sys.executable).with_name("transformers")), "serve", str(folder), "--trust-remote-code"]
    command += ["--host", LOOPBACK, "--port", str(args.port), "--dtype", dtype]
    print(" ".join(command), flush=True)
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
