"""
`utils/benchmark.py --price-with TABLE [TABLE ...]`: what lookahead would gain on a device whose cost table is known,
decided and counted on this machine.

In float32 every method's text is plain greedy's, and the steps of `"auto"` depend only on its cost table and the
text once it learns nothing from measured step durations (`LookaheadState(step_costs=..., follow_durations=False)`).
So this CPU can run exactly the steps `"auto"` would take on a GPU whose table is known, and the steps of lade's
fixed windows and of prompt lookup, which do not depend on any table. Each run's decoding passes are then priced by
the table: a pass of T tokens costs `table(T)` one-token passes, plain greedy one per token. The priced speedup is
plain greedy's priced time over the method's; the host time per pass, measured here, is shown apart, and with
`--pass-ms` (what a one-token pass takes on the target device) added to both sides.

    python utils/benchmark.py --price-with docs/source/en/benchmarks/gpu_check_h200.json flat --num-prompts 5
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from transformers_lookahead import LookaheadState, enable_lookahead
from transformers_lookahead.cost_model import StepCostModel
from utils.methods import methods
from utils.timing import ForwardTimer

FLAT = "flat"
# Methods whose steps do not depend on a cost table: run once, priced by every table.
FIXED_METHODS = methods("prompt_lookup", "lookahead_7_5_7", "lookahead_15_5_15")
# `"auto"`, run once per table (no suffix memory: each prompt is priced on its own).
AUTO = methods("lookahead_auto", without_memory=True)["lookahead_auto"]


def load_table(spec: str) -> tuple[str, StepCostModel]:
    """
    A cost table by name: `flat` (every pass costs one token's), or a JSON file holding `relative_cost` (what
    `--cost-curve` writes) or a `make gpu-check` report, whose `cost curve` check holds one.

    Returns:
        `tuple`: the table's name (the file's stem) and the table.
    """
    if spec == FLAT:
        return FLAT, StepCostModel({1: 1.0, 2: 1.0})
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"--price-with takes `{FLAT}` or a JSON file with a cost table; {spec!r} is neither.")
    content = json.loads(path.read_text())
    relative = content.get("relative_cost")
    if relative is None:
        relative = next(
            (check["relative_cost"] for check in content.get("checks", []) if check.get("check") == "cost curve"),
            None,
        )
    if not relative:
        raise ValueError(f"--price-with: {spec} holds no `relative_cost` and no gpu-check `cost curve` check.")
    return path.stem, StepCostModel({int(length): float(cost) for length, cost in relative.items()})


def run_priced(args, model, prompts) -> dict:
    """
    Plain greedy, the fixed methods and `"auto"` under each table of `args.price_with`, on each prompt: every
    decoding pass's length, the wall and forward seconds, and whether the text is plain greedy's.

    Args:
        prompts (`list`): `(prompt_id, category, input_ids, prompt_length)` as the benchmark builds them.
    """
    from tqdm.auto import tqdm

    if model.dtype != torch.float32:
        raise ValueError(
            f"--price-with decodes in float32 (its texts must be plain greedy's), got --dtype {args.dtype}."
        )
    tables = dict(load_table(spec) for spec in args.price_with)
    # name: (generate arguments, the state `"auto"` keeps its table and estimates in, or None)
    methods = {"greedy": ({}, None), **{name: (kwargs, None) for name, kwargs in FIXED_METHODS.items()}}
    for name, table in tables.items():
        # A state per table: its steps follow that table alone, and its estimates carry from prompt to prompt.
        methods[f"lookahead_auto@{name}"] = (
            AUTO,
            LookaheadState(cost_dir=None, step_costs=table, follow_durations=False),
        )
    timer = ForwardTimer(model)
    common = {"max_new_tokens": args.max_new_tokens, "do_sample": False}
    runs = []
    for prompt_id, category, ids, prompt_length in tqdm(prompts, desc="priced", unit="prompt"):
        reference = None
        for name, (kwargs, state) in methods.items():
            if state is not None:
                enable_lookahead(model, state=state)
            out, seconds = timer.generate(ids, **common, **kwargs)
            reference = out if reference is None else reference
            decoding = [tokens for tokens, _ in timer.passes[1:]]  # The first pass is the prompt's.
            runs.append(
                {
                    "prompt_id": prompt_id,
                    "category": category,
                    "method": name,
                    "new_tokens": out.shape[1] - prompt_length,
                    "pass_lengths": decoding,
                    "seconds": seconds,
                    "forward_seconds": timer.seconds,
                    "identical_to_greedy": bool(torch.equal(out, reference)),
                }
            )
    return {"tables": {name: dict(zip(table.lengths, table.costs)) for name, table in tables.items()}, "runs": runs}


def summarize_priced(result: dict, pass_ms: float | None = None) -> list[dict]:
    """
    One row per split, table and method: tokens per decoding pass, the priced speedup over plain greedy (forward time
    alone), the host milliseconds per pass measured here, and with `pass_ms` the priced speedup with host time.
    """
    rows = []
    runs = result["runs"]
    splits = sorted({run["prompt_id"].split("/")[0] for run in runs})
    for split in splits:
        in_split = [run for run in runs if run["prompt_id"].split("/")[0] == split]
        greedy = [run for run in in_split if run["method"] == "greedy"]
        greedy_passes = sum(len(run["pass_lengths"]) for run in greedy)
        # Plain greedy's decoding passes per token: each costs one one-token pass.
        greedy_per_token = greedy_passes / sum(run["new_tokens"] for run in greedy)
        greedy_host = _host_ms(greedy)
        for table_name, relative in result["tables"].items():
            table = StepCostModel({int(length): cost for length, cost in relative.items()})
            for method in dict.fromkeys(run["method"] for run in in_split):
                if "@" in method and not method.endswith("@" + table_name):
                    continue
                chosen = [run for run in in_split if run["method"] == method]
                passes = sum(len(run["pass_lengths"]) for run in chosen)
                cost = sum(table(length) for run in chosen for length in run["pass_lengths"])
                tokens = sum(run["new_tokens"] for run in chosen)
                host = _host_ms(chosen)
                row = {
                    "split": split,
                    "table": table_name,
                    "method": method.split("@")[0],
                    "prompts": len(chosen),
                    "tokens_per_pass": tokens / max(passes + len(chosen), 1),
                    "mean_pass_tokens": sum(sum(run["pass_lengths"]) for run in chosen) / max(passes, 1),
                    "priced_speedup": greedy_per_token / (cost / tokens),
                    "host_ms_per_pass": host,
                    "identical": sum(run["identical_to_greedy"] for run in chosen),
                }
                if pass_ms is not None:
                    greedy_time = greedy_per_token * (pass_ms + greedy_host)
                    row["priced_speedup_with_host"] = greedy_time / ((cost * pass_ms + passes * host) / tokens)
                rows.append(row)
    return rows


def _host_ms(runs: list[dict]) -> float:
    """Host milliseconds per forward pass of `runs`: their wall time outside the forward passes."""
    passes = sum(len(run["pass_lengths"]) + 1 for run in runs)
    return 1000 * sum(run["seconds"] - run["forward_seconds"] for run in runs) / passes


def format_priced_table(rows: list[dict], result: dict) -> str:
    with_host = any("priced_speedup_with_host" in row for row in rows)
    lines = [
        "| split | table | method | tokens / pass | tokens fed / pass | priced vs greedy | host ms / pass (here) |"
        + (" priced with host |" if with_host else "")
        + " identical |",
        "|---|---|---|---|---|---|---|" + ("---|" if with_host else "") + "---|",
    ]
    for row in rows:
        cells = [
            row["split"],
            row["table"],
            row["method"],
            f"{row['tokens_per_pass']:.2f}",
            f"{row['mean_pass_tokens']:.1f}",
            f"{row['priced_speedup']:.2f}x",
            f"{row['host_ms_per_pass']:.2f}",
        ]
        if with_host:
            cells.append(f"{row['priced_speedup_with_host']:.2f}x")
        cells.append(f"{row['identical']}/{row['prompts']}")
        lines.append("| " + " | ".join(cells) + " |")
    tables = "; ".join(f"{name}: {relative}" for name, relative in result["tables"].items())
    lines.append(f"\npriced by the cost tables {tables} (decoding passes; the prompt's pass left out)")
    return "\n".join(lines)
