"""
Side-by-side benchmark of greedy, prompt lookup and lookahead decoding on SmolLM2-135M-Instruct with MT-Bench and
HumanEval prompts. Methods run interleaved per prompt, so machine noise hits them alike.

    python utils/benchmark.py --dataset all --num-prompts 16 --repeats 3
    python utils/benchmark.py --cost-curve
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .assets import chat_input_ids, held_out_prompts, smollm2_path, tuning_prompts
from .cost_model import measure_step_costs
from .generation_mixin import enable_lookahead

# name -> generate() keyword arguments
METHODS = {
    "greedy": {},
    "prompt_lookup": {"prompt_lookup_num_tokens": 10},
    "lookahead_15_5_15": {"lookahead_window": 15, "lookahead_ngram": 5, "lookahead_guess": 15},
    "lookahead_7_5_7": {"lookahead_window": 7, "lookahead_ngram": 5, "lookahead_guess": 7},
    "lookahead_auto": {"lookahead_window": "auto"},
}
SWEEP_WINDOWS = (1, 2, 4, 7, 10, 15)


@dataclass
class Run:
    """One generation of one prompt by one method."""

    prompt_id: str
    category: str
    method: str
    repeat: int
    new_tokens: int
    seconds: float
    forward_seconds: float
    forward_passes: int
    identical_to_greedy: bool


class ForwardTimer:
    """Counts the model's forward passes and their time, through module hooks (for every method alike)."""

    def __init__(self, model):
        self.model = model
        self.reset()
        model.register_forward_pre_hook(self._start)
        model.register_forward_hook(self._stop)

    def reset(self):
        self.calls, self.seconds, self._began = 0, 0.0, 0.0

    def _sync(self):
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)

    def _start(self, module, args):
        self._sync()
        self._began = time.perf_counter()

    def _stop(self, module, args, output):
        self._sync()
        self.calls += 1
        self.seconds += time.perf_counter() - self._began


def _environment(args, device) -> dict:
    import transformers

    cpu = platform.processor()
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "cpu": cpu,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "command": args.command,
    }


def _load(args):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = args.model or smollm2_path(args.cache_dir)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).to(device).eval()
    return enable_lookahead(model), tokenizer, device


def _prompts(args, tokenizer, device):
    datasets = ["mt_bench", "humaneval"] if args.dataset == "all" else [args.dataset]
    select = tuning_prompts if args.split == "tuning" else held_out_prompts
    prompts = []
    for dataset in datasets:
        items = select(dataset, args.cache_dir)
        if dataset == "mt_bench":
            # Round-robin over categories, so a small --num-prompts still covers every category.
            by_category = defaultdict(list)
            for item in items:
                by_category[item[1]].append(item)
            items = [item for group in zip(*by_category.values()) for item in group]
        for prompt_id, category, text in items[: args.num_prompts]:
            prompts.append((prompt_id, category, chat_input_ids(tokenizer, text, dataset).to(device)))
    return prompts


def run_benchmark(args) -> dict:
    from tqdm.auto import tqdm

    model, tokenizer, device = _load(args)
    prompts = _prompts(args, tokenizer, device)
    methods = {name: METHODS[name] for name in args.methods}
    timer = ForwardTimer(model)
    runs: list[Run] = []
    common = {"max_new_tokens": args.max_new_tokens, "do_sample": False}
    model.generate(prompts[0][2], **common)  # warm-up: kernels, allocator, the auto policy's cost table
    model.generate(prompts[0][2], lookahead_window="auto", **common)
    progress = tqdm(total=len(prompts) * args.repeats * len(methods), desc="benchmark", unit="gen")
    for prompt_id, category, ids in prompts:
        reference = None
        for repeat in range(args.repeats):
            for name, kwargs in methods.items():
                timer.reset()
                start = time.perf_counter()
                out = model.generate(ids, **common, **kwargs)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                seconds = time.perf_counter() - start
                if reference is None:
                    reference = model.generate(ids, **common) if name != "greedy" else out
                runs.append(
                    Run(
                        prompt_id=prompt_id,
                        category=category,
                        method=name,
                        repeat=repeat,
                        new_tokens=out.shape[1] - ids.shape[1],
                        seconds=seconds,
                        forward_seconds=timer.seconds,
                        forward_passes=timer.calls,
                        identical_to_greedy=bool(torch.equal(out, reference)),
                    )
                )
                progress.update()
    progress.close()
    sweep = _window_sweep(model, prompts[: args.sweep_prompts], args) if args.sweep_prompts else []
    return {"environment": _environment(args, device), "runs": [asdict(r) for r in runs], "window_sweep": sweep}


def _window_sweep(model, prompts, args) -> list[dict]:
    """Compression (tokens per forward, deterministic) against the window size, N=5 and G=W."""
    rows = []
    for window in SWEEP_WINDOWS:
        tokens = passes = 0
        for _, _, ids in prompts:
            out = model.generate(
                ids,
                max_new_tokens=args.max_new_tokens,
                do_sample=False,
                lookahead_window=window,
                return_dict_in_generate=True,
            )
            tokens += out.sequences.shape[1] - ids.shape[1]
            passes += out.num_forward_passes
        rows.append({"window": window, "compression": tokens / passes})
    return rows


def summarize(result: dict) -> list[dict]:
    """
    Per method and category (plus each dataset overall): median over repeats of each prompt's time, then speedup
    = sum of greedy medians / sum of method medians, tokens/s, tokens per forward, host share of the time.
    """
    runs = result["runs"]
    median_seconds = defaultdict(list)
    info = {}
    for run in runs:
        key = (run["method"], run["prompt_id"])
        median_seconds[key].append(run["seconds"])
        info[key] = run
    rows = []
    groups = defaultdict(set)
    for method, prompt_id in median_seconds:
        category = info[(method, prompt_id)]["category"]
        dataset = "humaneval" if category == "humaneval" else "mt_bench"
        groups[(method, category)].add(prompt_id)
        if dataset == "mt_bench":
            groups[(method, "mt_bench (all)")].add(prompt_id)
    for (method, category), prompt_ids in sorted(groups.items()):
        seconds = sum(statistics.median(median_seconds[(method, p)]) for p in prompt_ids)
        greedy = sum(statistics.median(median_seconds[("greedy", p)]) for p in prompt_ids)
        selected = [r for r in runs if r["method"] == method and r["prompt_id"] in prompt_ids]
        tokens = sum(r["new_tokens"] for r in selected)
        passes = sum(r["forward_passes"] for r in selected)
        total = sum(r["seconds"] for r in selected)
        forward = sum(r["forward_seconds"] for r in selected)
        per_prompt = [
            statistics.median(median_seconds[("greedy", p)]) / statistics.median(median_seconds[(method, p)])
            for p in prompt_ids
        ]
        rows.append(
            {
                "method": method,
                "category": category,
                "prompts": len(prompt_ids),
                "tokens_per_s": tokens / total,
                "speedup": greedy / seconds,
                "min_prompt_speedup": min(per_prompt),
                "tokens_per_forward": tokens / passes,
                "accepted_per_step": (tokens - len(selected)) / max(passes - len(selected), 1),
                "host_share": 1 - forward / total,
                "identical": sum(r["identical_to_greedy"] for r in selected)
                // max(len(selected) // len(prompt_ids), 1),
            }
        )
    return rows


def format_table(rows: list[dict]) -> str:
    header = (
        f"{'category':<16} {'method':<18} {'n':>3} {'tok/s':>7} {'speedup':>8} {'min':>6} {'tok/fwd':>8} "
        f"{'acc/step':>8} {'host':>6} {'identical':>9}"
    )
    lines = [header, "-" * len(header)]
    for row in sorted(rows, key=lambda r: (r["category"], list(METHODS).index(r["method"]))):
        lines.append(
            f"{row['category']:<16} {row['method']:<18} {row['prompts']:>3} {row['tokens_per_s']:>7.1f} "
            f"{row['speedup']:>7.2f}x {row['min_prompt_speedup']:>5.2f}x {row['tokens_per_forward']:>8.2f} "
            f"{row['accepted_per_step']:>8.2f} {row['host_share']:>6.1%} {row['identical']:>4}/{row['prompts']}"
        )
    return "\n".join(lines)


def plot(result: dict, rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(14, 5), gridspec_kw={"width_ratios": [3, 1]})
    categories = sorted({r["category"] for r in rows})
    methods = [m for m in METHODS if m != "greedy" and any(r["method"] == m for r in rows)]
    width = 0.8 / max(len(methods), 1)
    for i, method in enumerate(methods):
        values = [
            next((r["speedup"] for r in rows if r["method"] == method and r["category"] == c), 0) for c in categories
        ]
        left.bar([x + i * width for x in range(len(categories))], values, width, label=method)
    left.axhline(1.0, color="black", linewidth=0.8)
    left.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(categories))])
    left.set_xticklabels(categories, rotation=30, ha="right")
    left.set_ylabel("speedup vs greedy (x)")
    left.legend()
    left.set_title("Speedup per category")
    sweep = result.get("window_sweep") or []
    if sweep:
        right.plot([s["window"] for s in sweep], [s["compression"] for s in sweep], marker="o")
    right.set_xlabel("lookahead_window (N=5, G=W)")
    right.set_ylabel("tokens per forward pass")
    right.set_title("Compression vs window")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def run_cost_curve(args) -> None:
    """Forward time against step length (1..256) on the device, written as JSON and PNG."""
    model, _, device = _load(args)
    grid = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
    relative = measure_step_costs(model, grid)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cost_curve.json").write_text(
        json.dumps({"environment": _environment(args, device), "relative_cost": relative}, indent=1)
    )
    for length, cost in relative.items():
        print(f"T={length:>4}: {cost:6.2f}x a one-token forward")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    axis.plot(list(relative), list(relative.values()), marker="o")
    axis.set_xscale("log", base=2)
    axis.set_xlabel("tokens in the forward pass")
    axis.set_ylabel("time / one-token forward")
    axis.set_title(f"Forward cost on {device.type} ({torch.get_num_threads()} threads)")
    figure.tight_layout()
    figure.savefig(out / "cost_curve.png", dpi=110)


def main(argv: list[str] | None = None) -> None:
    import sys

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder (default: SmolLM2-135M-Instruct, fetched and converted once)")
    parser.add_argument("--dataset", choices=["mt_bench", "humaneval", "all"], default="all")
    parser.add_argument("--split", choices=["tuning", "held_out"], default="tuning")
    parser.add_argument("--num-prompts", type=int, default=16, help="prompts per dataset")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--sweep-prompts", type=int, default=4, help="prompts for the compression-vs-window sweep")
    parser.add_argument("--cost-curve", action="store_true", help="measure forward cost against step length")
    parser.add_argument("--cache-dir", default=None, help="where the model and datasets are kept")
    parser.add_argument("--output-dir", default="bench_out")
    args = parser.parse_args(argv)
    args.command = "python utils/benchmark.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.threads:
        torch.set_num_threads(args.threads)
    if "greedy" not in args.methods:
        args.methods = ["greedy", *args.methods]
    if args.cost_curve:
        run_cost_curve(args)
        return
    result = run_benchmark(args)
    rows = summarize(result)
    result["summary"] = rows
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "benchmark.json").write_text(json.dumps(result, indent=1))
    table = format_table(rows)
    (out / "benchmark.txt").write_text(table + "\n")
    plot(result, rows, out / "benchmark.png")
    print(table)
    print(f"\nwritten: {out / 'benchmark.json'}, {out / 'benchmark.txt'}, {out / 'benchmark.png'}")


if __name__ == "__main__":
    main()
