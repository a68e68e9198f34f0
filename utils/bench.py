"""
The project's tools behind one command: `python -m utils.bench <name> [arguments]`. `python -m utils.bench -h` lists
the names: every benchmark of `utils/benchmark.py` (`generate`, `priced`, `memory`, ...), each with its own
arguments, and the other tools (`gpu-check`, `serve`, `hub-repo`, ...). `python -m utils.bench <name> -h` shows a
name's arguments. The `make` targets call it; every tool takes its methods from one registry (`utils/methods.py`).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, what it does) of the tools besides the benchmarks (`utils.benchmark.BENCHMARKS`); each module's
# `main` parses the tool's own arguments.
TOOLS = {
    "gpu-check": ("utils.gpu_check", "the checks that need an accelerator, on random models built in the run"),
    "serve": ("utils.serving", "SmolLM2-135M-Instruct behind `transformers serve` on 127.0.0.1, with lookahead"),
    "serve-benchmark": ("utils.serve_benchmark", "`transformers serve` with and without lookahead, side by side"),
    "hub-repo": ("utils.build_hub_repo", "writes the strategy as a Hub repository stock Transformers runs"),
    "hub-benchmark": ("utils.hub_benchmark", "the Hub repository in a stock venv against plain greedy"),
    "quality-merge": ("utils.quality", "merges `quality` runs over different problems into one result"),
    "recurrent-state": ("utils.recurrent_state_cost", "what keeping a hybrid model's recurrent states costs"),
    "results": ("utils.render_results", "renders the results page and the README's summary from the result files"),
    "zoo": ("utils.render_zoo", "renders the model-zoo page: every architecture built tiny and decoded"),
}


def main(argv: list[str] | None = None) -> int:
    from utils import benchmark

    parser = argparse.ArgumentParser(
        prog="python -m utils.bench", description="The project's tools; `<name> -h` shows a tool's own arguments."
    )
    subcommands = parser.add_subparsers(dest="tool", required=True, metavar="name")
    benchmark.add_benchmarks(subcommands)
    for name, (_, description) in TOOLS.items():
        # The tool parses its own arguments, `-h` included.
        subcommands.add_parser(name, help=description, add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.tool in benchmark.BENCHMARKS:
        benchmark.main(argv if argv is not None else sys.argv[1:])
        return 0
    tool = importlib.import_module(TOOLS[args.tool][0])
    sys.argv = [f"{parser.prog} {args.tool}", *rest]
    return tool.main() or 0


if __name__ == "__main__":
    sys.exit(main())
