"""
Steps decided on this machine in float32, where every method's text is plain greedy's, by `"auto"` priced with a
fixed cost table instead of this machine's timings (`LookaheadState(step_costs=..., follow_durations=False)`: no
learning from measured durations), so that the steps, and the tables, do not depend on the machine.

`python -m utils.bench priced TABLE [TABLE ...]`: what lookahead would gain on a device whose cost table is known. This
CPU runs exactly the steps `"auto"` would take on a GPU whose table is known, and the steps of lade's fixed
windows and of prompt lookup, which do not depend on any table. Each run's decoding passes are then priced by the
table: a pass of T tokens costs `table(T)` one-token passes, plain greedy one per token. The priced speedup is plain
greedy's priced time over the method's; the host time per pass, measured here, is shown apart, and with `--pass-ms`
(what a one-token pass takes on the target device) added to both sides.

    python -m utils.bench priced docs/source/en/benchmarks/gpu_check_h200.json flat --num-prompts 5
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
# Every pass costs one token's: the policy verifies every candidate and runs the widest window.
FLAT_CURVE = StepCostModel({1: 1.0, 2: 1.0})
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
        return FLAT, FLAT_CURVE
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"priced takes `{FLAT}` or a JSON file with a cost table; {spec!r} is neither.")
    content = json.loads(path.read_text())
    relative = content.get("relative_cost")
    if relative is None:
        relative = next(
            (check["relative_cost"] for check in content.get("checks", []) if check.get("check") == "cost curve"),
            None,
        )
    if not relative:
        raise ValueError(f"priced: {spec} holds no `relative_cost` and no gpu-check `cost curve` check.")
    return path.stem, StepCostModel({int(length): float(cost) for length, cost in relative.items()})


def run_priced(args, model, prompts) -> dict:
    """
    Plain greedy, the fixed methods and `"auto"` under each table of `args.price_with`, on each prompt: every
    decoding pass's length, the wall and forward seconds, and whether the text is plain greedy's.

    Args:
        prompts (`list`): `(prompt_id, category, input_ids, prompt_length)` as the benchmark builds them.
    """
    from tqdm.auto import tqdm

    require_float32(model, "priced", args.dtype)
    tables = dict(load_table(spec) for spec in args.price_with)
    # name: (generate arguments, the state `"auto"` keeps its table and estimates in, or None)
    methods = {"greedy": ({}, None), **{name: (kwargs, None) for name, kwargs in FIXED_METHODS.items()}}
    for name, table in tables.items():
        # A state per table: its steps follow that table alone, and its estimates carry from prompt to prompt.
        methods[f"lookahead_auto@{name}"] = (AUTO, fixed_table_state(table))
    # Each state checks the model at its first lookahead call, with passes of its own: checked here, those passes
    # are not among the priced ones.
    for state in [model.lookahead_state] + [state for _, state in methods.values() if state is not None]:
        state.step_check.check(model)
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


def fixed_table_state(table: StepCostModel, **settings) -> LookaheadState:
    """
    A state whose `"auto"` prices steps by `table` alone (it learns nothing from measured durations), keeps its
    estimates from prompt to prompt, and writes nothing: with it, the steps depend on the table and the text only.
    """
    return LookaheadState(cost_dir=None, step_costs=table, follow_durations=False, **settings)


def require_float32(model, benchmark: str, dtype: str) -> None:
    """Refuses a model that does not decode in float32, where every text is plain greedy's."""
    if model.dtype != torch.float32:
        raise ValueError(f"{benchmark} decodes in float32 (its texts must be plain greedy's), got --dtype {dtype}.")
