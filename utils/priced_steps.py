"""
Steps decided on this machine in float32, where every method's text is plain greedy's, by `"auto"` priced with a
fixed cost table instead of this machine's timings (`LookaheadState(step_costs=..., follow_durations=False)`: no
learning from measured durations), so that the steps, and the tables, do not depend on the machine. Two benchmarks
share this set-up (`fixed_table_state`):

`python -m utils.bench priced TABLE [TABLE ...]`: what lookahead would gain on a device whose cost table is known.
This CPU runs exactly the steps `"auto"` would take on a GPU whose table is known, and the steps of lade's fixed
windows and of prompt lookup, which do not depend on any table. Each run's decoding passes are then priced by the
table: a pass of T tokens costs `table(T)` one-token passes, plain greedy one per token. The priced speedup is plain
greedy's priced time over the method's; the host time per pass, measured here, is shown apart, and with `--pass-ms`
(what a one-token pass takes on the target device) added to both sides.

    python -m utils.bench priced docs/source/en/benchmarks/gpu_check_h200.json flat --num-prompts 5

`python -m utils.bench ceiling`: is `lookahead_window="auto"` limited by the candidates its steps have, or by how it
prices long steps? For every step, the deepest path of the whole candidate tree the step was offered (pool n-grams,
the context's copy, the suffix memory) that matches the text, against what the step verified and accepted. `bf16`
prices steps with the curve measured for the model in bfloat16 on a CPU with native bf16 (where a pass of 8 tokens
costs about one token's), `flat` says that every step costs one token's, so the policy verifies every candidate and
runs the widest window. Each setting's forward time is then projected with the model's bf16 curve: generated tokens
over the summed relative costs of its passes (plain greedy: 1 per token), what the flat cost curve is worth if the
machine's passes cost what the curve says, without host time.

    python -m utils.bench ceiling --num-prompts 5 --max-new-tokens 128 --threads 2
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from transformers_lookahead import LookaheadState, enable_lookahead
from transformers_lookahead.auto_tuning import AUTO_TUNING
from transformers_lookahead.cost_model import StepCostModel
from transformers_lookahead.step_layout import RowStep
from transformers_lookahead.step_policy import StepChoice
from transformers_lookahead.token_tree import TokenTree
from transformers_lookahead.verification import Verdict
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


# Cost of a forward pass of T tokens relative to one token, bf16, 2 threads, on the development CPU with AVX512-BF16
# (issue 19's measurement; 300-token context).
BFLOAT16_CURVES = {
    "smollm2": StepCostModel({1: 1.0, 2: 0.91, 4: 0.95, 8: 1.06, 16: 1.23, 32: 1.65}),
    "qwen-coder": StepCostModel({1: 1.0, 2: 0.98, 4: 1.03, 8: 1.15, 16: 1.44, 32: 1.95}),
}
# name: (pricing, generate arguments, `AUTO_TUNING` fields changed)
CEILING_SETTINGS = {
    "auto, bf16 curve": ("bf16", {}, {}),
    "auto, flat curve": ("flat", {}, {}),
    "auto, flat curve, G=16, context 16": ("flat", {"lookahead_guess": 16}, {"context_depth": 16}),
    "auto, flat curve, N=8, G=16, context 32": (
        "flat",
        {"lookahead_ngram": 8, "lookahead_guess": 16},
        {"context_depth": 32},
    ),
}
# Short names for `--ceiling-settings` (the flat settings feed 76-141 tokens a step, which is slow on larger models).
CEILING_SETTING_NAMES = dict(zip(("bf16", "flat", "flat-g16", "flat-n8"), CEILING_SETTINGS))
SOURCES = ("pool", "context", "memory")


@dataclass(frozen=True)
class StepRecord:
    """
    One step of a sequence as the policy saw it.

    Args:
        start (`int`): the index, among the generated tokens, of the step's first new token.
        length (`int`): the tokens the step fed to the model.
        accepted (`int`): the tokens it accepted (its matched candidates, plus one).
        window (`bool`): whether it ran the window.
        verified (`int`): candidate nodes it verified.
        offered (`TokenTree`): every candidate it was offered.
    """

    start: int
    length: int
    accepted: int
    window: bool
    verified: int
    offered: TokenTree

    @classmethod
    def of(cls, earlier: list[StepRecord], choice: StepChoice, row: RowStep, verdict: Verdict) -> StepRecord:
        """The record of a step (what `LookaheadState.step_observer` is given) that followed the `earlier` ones."""
        start = sum(step.accepted for step in earlier) + 1  # The prefill chose the first token.
        return cls(start, row.length, len(verdict.tokens), choice.use_window, len(choice.tree), choice.offer.tree)


def deepest_match(tree: TokenTree, continuation: list[int], source: str | None = None) -> int:
    """
    How many tokens of `continuation` a path of `tree` matches from its key, walking only through nodes of `source`
    (`"pool"`, `"context"`, `"memory"`; `None`: any node).
    """
    node, depth = -1, 0
    for token in continuation:
        child = tree.child(node, token)
        if child is None or (source is not None and not _from(tree, child, source)):
            break
        node, depth = child, depth + 1
    return depth


def _from(tree: TokenTree, node: int, source: str) -> bool:
    if source == "pool":
        return tree.counts[node] > 0
    if source == "context":
        return tree.in_context[node]
    return tree.memory_counts[node] > 0


def run_ceiling(args, model, tokenizer, prompts) -> dict:
    """
    Plain greedy, then each setting of `CEILING_SETTINGS` that `args.ceiling_settings` names (`None`: all), on each
    prompt; each lookahead step recorded.

    Args:
        prompts (`list`): `(prompt_id, category, input_ids, prompt_length)` as the benchmark builds them.
    """
    from tqdm.auto import tqdm

    require_float32(model, "ceiling", args.dtype)
    curve = BFLOAT16_CURVES.get(args.model or "smollm2")
    if curve is None:
        raise ValueError(f"ceiling knows the bf16 cost curve of {sorted(BFLOAT16_CURVES)}, not --model {args.model}.")
    chosen = getattr(args, "ceiling_settings", None) or list(CEILING_SETTING_NAMES)
    unknown = sorted(set(chosen) - set(CEILING_SETTING_NAMES))
    if unknown:
        raise ValueError(f"--ceiling-settings takes {list(CEILING_SETTING_NAMES)}, got {unknown}.")
    settings = {CEILING_SETTING_NAMES[short]: CEILING_SETTINGS[CEILING_SETTING_NAMES[short]] for short in chosen}
    common = {"max_new_tokens": args.max_new_tokens, "do_sample": False}
    # Each setting priced by its fixed curve alone (no learning from measured durations), its estimates its own, and
    # every step recorded into `steps`.
    steps: list[StepRecord] = []
    states = {
        name: fixed_table_state(
            curve if pricing == "bf16" else FLAT_CURVE,
            tuning=replace(AUTO_TUNING, **tuning),
            step_observer=lambda choice, row, verdict: steps.append(StepRecord.of(steps, choice, row, verdict)),
        )
        for name, (pricing, _, tuning) in settings.items()
    }
    results = []
    for prompt_id, category, ids, prompt_length in tqdm(prompts, desc="ceiling", unit="prompt"):
        reference = model.generate(ids, **common)[0, prompt_length:].tolist()
        runs = {}
        for name, (_, kwargs, _) in settings.items():
            steps.clear()
            enable_lookahead(model, state=states[name])
            out = model.generate(ids, **common, lookahead_window="auto", lookahead_memory=False, **kwargs)
            generated = out[0, prompt_length:].tolist()
            runs[name] = _summarize_steps(steps, generated, curve) | {"identical": generated == reference}
        results.append({"prompt_id": prompt_id, "category": category, "tokens": len(reference), "runs": runs})
    return {"prompts": results, "settings": list(settings), "bf16_curve": dict(zip(curve.lengths, curve.costs))}


def _summarize_steps(steps: list[StepRecord], generated: list[int], curve: StepCostModel) -> dict:
    """Per run: its steps' tokens, lengths and projected costs, and what its offered trees held."""
    ceiling = {source: 0 for source in (*SOURCES, "any")}
    missed_steps = 0
    for step in steps:
        continuation = generated[step.start :]
        best = deepest_match(step.offered, continuation)
        ceiling["any"] += 1 + best
        for source in SOURCES:
            ceiling[source] += 1 + deepest_match(step.offered, continuation, source)
        missed_steps += best > step.accepted - 1
    return {
        "steps": len(steps),
        "accepted": sum(step.accepted for step in steps),
        "fed": sum(step.length for step in steps),
        "window_steps": sum(step.window for step in steps),
        "verified": sum(step.verified for step in steps),
        "offered": sum(len(step.offered) for step in steps),
        "cost": sum(curve(step.length) for step in steps),
        "ceiling": ceiling,
        "missed_steps": missed_steps,
    }


def summarize_ceiling(result: dict) -> list[dict]:
    """One row per split and setting: tokens per step, what the offered trees held, the projected speed-up."""
    rows = []
    splits = sorted({prompt["prompt_id"].split("/")[0] for prompt in result["prompts"]})
    for split in splits:
        prompts = [prompt for prompt in result["prompts"] if prompt["prompt_id"].split("/")[0] == split]
        for name in result.get("settings", CEILING_SETTINGS):
            runs = [prompt["runs"][name] for prompt in prompts]
            steps = sum(run["steps"] for run in runs)
            accepted = sum(run["accepted"] for run in runs)
            rows.append(
                {
                    "split": f"{split} ({len(prompts)})",
                    "setting": name,
                    "tokens_per_step": accepted / steps,
                    "fed_per_step": sum(run["fed"] for run in runs) / steps,
                    "window_share": sum(run["window_steps"] for run in runs) / steps,
                    "verified_per_step": sum(run["verified"] for run in runs) / steps,
                    "offered_per_step": sum(run["offered"] for run in runs) / steps,
                    "ceiling_per_step": {
                        source: sum(run["ceiling"][source] for run in runs) / steps for source in (*SOURCES, "any")
                    },
                    "missed_share": sum(run["missed_steps"] for run in runs) / steps,
                    "projected_speedup": accepted / sum(run["cost"] for run in runs),
                    "median_prompt_speedup": statistics.median(run["accepted"] / run["cost"] for run in runs),
                    "identical": sum(run["identical"] for run in runs),
                    "prompts": len(runs),
                }
            )
    return rows


def format_ceiling_table(rows: list[dict], result: dict) -> str:
    curve = ", ".join(f"{length}: {cost}" for length, cost in result["bf16_curve"].items())
    lines = [
        "| split | setting | tokens / step | fed / step | window steps | verified / offered nodes | offered tree's "
        "best (pool / context / memory / any) | steps that left tokens | projected vs greedy (median prompt) | "
        "identical |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        best = " / ".join(f"{row['ceiling_per_step'][source]:.2f}" for source in (*SOURCES, "any"))
        lines.append(
            f"| {row['split']} | {row['setting']} | {row['tokens_per_step']:.2f} | {row['fed_per_step']:.1f} | "
            f"{row['window_share']:.0%} | {row['verified_per_step']:.1f} / {row['offered_per_step']:.1f} | {best} | "
            f"{row['missed_share']:.0%} | {row['projected_speedup']:.2f}x ({row['median_prompt_speedup']:.2f}x) | "
            f"{row['identical']}/{row['prompts']} |"
        )
    lines.append(f"\nprojected with the bf16 cost curve {{{curve}}} (decode steps only, no host time)")
    return "\n".join(lines)
