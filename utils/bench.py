"""
The project's tools behind one command: `python -m utils.bench <name> [arguments]`. `python -m utils.bench -h` lists
the names; `python -m utils.bench <name> -h` a tool's own arguments. The `make` targets (`bench`, `gpu-check`,
`serve`, `hub-repo`, ...) call it. Every tool takes its methods from one registry (`utils/methods.py`).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, what it does); each module's `main` parses the tool's own arguments.
TOOLS = {
    "benchmark": (
        "utils.benchmark",
        "greedy, prompt lookup and lookahead side by side on the real models and prompts (and its --priced, "
        "--ceiling, --memory, --sampling, --batched, --continuous-batching, --departures, --quality, --cost-curve, "
        "--whisper runs)",
    ),
    "gpu-check": ("utils.gpu_check", "the checks that need an accelerator, on random models built in the run"),
    "serve": ("utils.serving", "SmolLM2-135M-Instruct behind `transformers serve` on 127.0.0.1, with lookahead"),
    "serve-benchmark": ("utils.serve_benchmark", "`transformers serve` with and without lookahead, side by side"),
    "hub-repo": ("utils.build_hub_repo", "writes the strategy as a Hub repository stock Transformers runs"),
    "hub-benchmark": ("utils.hub_benchmark", "the Hub repository in a stock venv against plain greedy"),
    "quality": ("utils.quality", "HumanEval pass@1 of each decoding method"),
    "host-time": ("utils.host_time", "host time per decoding step as the text grows"),
    "operators": ("utils.operator_count", "operators dispatched per pass: one-token greedy against lookahead"),
    "cache-commit": ("utils.measure_cache_commit", "the time of a step's cache commit, per strategy"),
    "recurrent-state": ("utils.recurrent_state_cost", "what keeping a hybrid model's recurrent states costs"),
    "results": ("utils.render_results", "renders the results page and the README's summary from the result files"),
    "zoo": ("utils.render_zoo", "renders the model-zoo page: every architecture built tiny and decoded"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m utils.bench", description="The project's tools; `<name> -h` shows a tool's own arguments."
    )
    tools = parser.add_subparsers(dest="tool", required=True, metavar="name")
    for name, (_, description) in TOOLS.items():
        # The tool parses its own arguments, `-h` included.
        tools.add_parser(name, help=description, add_help=False)
    args, rest = parser.parse_known_args(argv)
    tool = importlib.import_module(TOOLS[args.tool][0])
    sys.argv = [f"{parser.prog} {args.tool}", *rest]
    return tool.main() or 0


if __name__ == "__main__":
    sys.exit(main())
