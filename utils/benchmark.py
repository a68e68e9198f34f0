"""
The benchmarks of `python -m utils.bench`, each one subcommand over the same workload (the model and prompts its
arguments name) and the same record (a JSON file with the environment, and a table). `generate`, the default of
`make bench`, runs greedy, prompt lookup and lookahead decoding side by side on SmolLM2-135M-Instruct with MT-Bench
and HumanEval prompts, interleaved per prompt, so machine noise hits them alike.

    python -m utils.bench generate            # quick: 5 + 5 prompts, greedy / prompt lookup / auto (~10 min, 2 cores)
    python -m utils.bench generate --full     # 16 + 16 prompts, every method, 3 repeats
    python -m utils.bench generate --model qwen-coder --dtype float32   # another model, another dtype
    python -m utils.bench whisper --num-prompts 8 --repeats 3  # Whisper tiny.en; needs espeak-ng
    python -m utils.bench cost-curve
    python -m utils.bench sampling --num-prompts 6 --repeats 2
    python -m utils.bench batched --num-prompts 4 --repeats 2
    python -m utils.bench memory             # suffix memory across calls: 4 workloads, 8 prompts each, 2 repeats
    python -m utils.bench departures --dtype bfloat16   # where outputs depart from plain greedy (half precision)
    python -m utils.bench quality --model qwen-coder --dtype bfloat16 --num-prompts 16  # HumanEval pass@1
    python -m utils.bench priced flat gpu_check.json --pass-ms 5   # the steps priced by other devices' tables
    python -m utils.bench continuous-batching --num-prompts 8 --repeats 2   # 1 / 4 / 8 / 16 concurrent requests
    python -m utils.bench continuous-batching --arrival-rate 0.5 1 2         # open loop: Poisson arrivals
    python -m utils.bench continuous-batching --padded-engines --concurrency 1 4  # and padded engines (graphs)

`--dtype auto` (the default) runs bfloat16 where the device computes it natively (CUDA with bf16, a CPU with
AVX512-BF16 or AMX) and float32 elsewhere, saying which (float32 for `priced`); a half-precision
`generate` run adds plain greedy in float32 as a reference row (`greedy_fp32`).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Run as a script (`python utils/benchmark.py`), the repository root is not on the path: the benchmark shares the
# asset readers with the slow tests and the chi-square helpers with the sampling tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from transformers_lookahead.cost_measurement import measure_step_costs  # noqa: E402
from utils.batched_benchmark import (  # noqa: E402
    run_batched_benchmark,
    summarize_batched,
)
from utils.cb_benchmark import (  # noqa: E402
    run_continuous_batching,
    summarize_continuous_batching,
)
from utils.faithfulness import run_departures, summarize_departures  # noqa: E402
from utils.memory_benchmark import (  # noqa: E402
    own_memory,
    run_memory_benchmark,
    summarize_memory,
)
from utils.methods import METHODS as REGISTERED_METHODS  # noqa: E402
from utils.priced_steps import (  # noqa: E402  # noqa: E402
    run_priced,
    summarize_priced,
)
from utils.quality import TUNING_PROBLEMS, run_quality, summarize_quality  # noqa: E402
from utils.render_results import result_table  # noqa: E402
from utils.sampling_benchmark import run_sampling_benchmark, summarize_sampling  # noqa: E402
from utils.timing import ForwardTimer, Run, native_half_precision  # noqa: E402
from utils.workload import SPEECH, Workload, environment, write_report  # noqa: E402

# Plain greedy in float32 beside a half-precision run: what the user would otherwise run.
REFERENCE = "greedy_fp32"
METHODS = {**REGISTERED_METHODS, REFERENCE: {}}
# The methods of the README's table; the quick run (the default) keeps the three a first look needs.
FULL_METHODS = ["greedy", "prompt_lookup", "lookahead_15_5_15", "lookahead_7_5_7", "lookahead_auto"]
QUICK_METHODS = ["greedy", "prompt_lookup", "lookahead_auto"]
QUICK = {"num_prompts": 5, "repeats": 2, "methods": QUICK_METHODS}
FULL = {"num_prompts": 16, "repeats": 3, "methods": FULL_METHODS}
MEMORY = {"num_prompts": 8, "repeats": 2, "methods": QUICK_METHODS}


def run_benchmark(args, workload: Workload, methods: dict | None = None) -> dict:
    """
    Every method of `args.methods` (looked up in `methods`, by default `METHODS`) on every prompt of `workload`,
    interleaved per prompt, `args.repeats` times.
    """
    from tqdm.auto import tqdm

    if args.whisper:
        model, extractor, device = workload.load_whisper()
        prompts = workload.spoken_prompts(extractor, model, device)
    else:
        model, tokenizer, device = workload.load()
        prompts = workload.prompts(tokenizer, device)
    methods = {name: (METHODS if methods is None else methods)[name] for name in args.methods}
    # The float32 reference of a half-precision run: plain greedy on the same model loaded in float32.
    models = {name: model for name in ("greedy", *methods)}
    if getattr(args, "reference_fp32", False):
        models[REFERENCE] = workload.load("float32")[0]
        methods[REFERENCE] = {}
    timers = {id(each): ForwardTimer(each) for each in models.values()}
    runs: list[Run] = []
    common = {"max_new_tokens": args.max_new_tokens, "do_sample": False}
    # Warm-up: kernels, allocator, the auto policy's cost table, and compilation for the compiled methods.
    warmup_seconds = {}
    for name, kwargs in {"greedy": {}, **methods}.items():
        start = time.perf_counter()
        models[name].generate(prompts[0][2], **common, **kwargs)
        warmup_seconds[name] = time.perf_counter() - start
    progress = tqdm(total=len(prompts) * args.repeats * len(methods), desc="benchmark", unit="gen")
    for prompt_id, category, ids, prompt_length in prompts:
        reference = None
        for repeat in range(args.repeats):
            for name, kwargs in methods.items():
                timer = timers[id(models[name])]
                # One memory per method and repeat: earlier prompts' answers may help, this prompt's earlier answer
                # may not, whether it came from an earlier repeat or from another method of this one.
                out, seconds = timer.generate(ids, **common, **kwargs, **own_memory(kwargs, f"{name}-{repeat}"))
                if reference is None:
                    reference = model.generate(ids, **common) if name != "greedy" else out
                runs.append(
                    Run(
                        prompt_id=prompt_id,
                        category=category,
                        method=name,
                        repeat=repeat,
                        new_tokens=_decoded_tokens(out, prompt_length, args),
                        seconds=seconds,
                        forward_seconds=timer.seconds,
                        forward_passes=timer.calls,
                        identical_to_greedy=bool(torch.equal(out, reference)),
                    )
                )
                progress.update()
    progress.close()
    return {
        "environment": environment(args, device),
        "runs": [run.record() for run in runs],
        "warmup_seconds": warmup_seconds,
    }


def _decoded_tokens(out: torch.LongTensor, prompt_length: int, args) -> int:
    """Tokens the decoder produced for one prompt."""
    if not args.whisper:
        return out.shape[1] - prompt_length
    # Whisper's `generate` returns what follows the start token (`<|notimestamps|>` first) without the final EOS,
    # which a transcript ending before the limit has decoded.
    return out.shape[1] + int(out.shape[1] < args.max_new_tokens)


def summarize(result: dict) -> list[dict]:
    """
    Per method and category (plus each dataset overall): each prompt's median time over repeats; tokens/s over the
    method's own output (total tokens / total median time: in half precision the texts, and their lengths, may depart
    from greedy's); speedup = that rate / greedy's (and / float32 greedy's where the run has it); tokens per forward;
    the host's share of the time and its milliseconds per forward pass (wall time outside the model's forward).
    """
    runs = result["runs"]
    median_seconds = defaultdict(list)
    tokens_of = defaultdict(list)
    info = {}
    for run in runs:
        key = (run["method"], run["prompt_id"])
        median_seconds[key].append(run["seconds"])
        tokens_of[key].append(run["new_tokens"])
        info[key] = run
    rows = []
    groups = defaultdict(set)
    for method, prompt_id in median_seconds:
        category = info[(method, prompt_id)]["category"]
        groups[(method, category)].add(prompt_id)
        if category not in ("humaneval", SPEECH):
            groups[(method, "mt_bench (all)")].add(prompt_id)

    def rate(method: str, prompt_ids) -> float:
        tokens = sum(statistics.mean(tokens_of[(method, p)]) for p in prompt_ids)
        return tokens / sum(statistics.median(median_seconds[(method, p)]) for p in prompt_ids)

    for (method, category), prompt_ids in sorted(groups.items()):
        selected = [r for r in runs if r["method"] == method and r["prompt_id"] in prompt_ids]
        tokens = sum(r["new_tokens"] for r in selected)
        passes = sum(r["forward_passes"] for r in selected)
        total = sum(r["seconds"] for r in selected)
        forward = sum(r["forward_seconds"] for r in selected)
        has_reference = all((REFERENCE, p) in median_seconds for p in prompt_ids)
        rows.append(
            {
                "method": method,
                "category": category,
                "prompts": len(prompt_ids),
                "tokens_per_s": rate(method, prompt_ids),
                "speedup": rate(method, prompt_ids) / rate("greedy", prompt_ids),
                "speedup_vs_fp32": rate(method, prompt_ids) / rate(REFERENCE, prompt_ids) if has_reference else None,
                "min_prompt_speedup": min(rate(method, [p]) / rate("greedy", [p]) for p in prompt_ids),
                "tokens_per_forward": tokens / passes,
                "accepted_per_step": (tokens - len(selected)) / max(passes - len(selected), 1),
                "host_share": 1 - forward / total,
                "host_ms_per_forward": 1000 * (total - forward) / passes,
                "identical": sum(r["identical_to_greedy"] for r in selected)
                // max(len(selected) // len(prompt_ids), 1),
            }
        )
    return rows


# One function per benchmark: each runs on the workload and writes its report into the output folder.


def side_by_side(args, workload: Workload, out: Path) -> None:
    """Greedy, prompt lookup and lookahead interleaved per prompt (Whisper tiny.en for `whisper`)."""
    result = run_benchmark(args, workload)
    rows = summarize(result)
    result["summary"] = rows
    name = "whisper.json" if args.whisper else "benchmark.json"
    (out / name).write_text(json.dumps(result, indent=1))
    print("\n".join(result_table(name, result)))
    warmup = ", ".join(f"{method} {seconds:.1f}" for method, seconds in result["warmup_seconds"].items())
    print(f"first call of each method (seconds, compilation included): {warmup}\nwritten: {out / name}")


def cost_curve(args, workload: Workload, out: Path) -> None:
    """`cost-curve`: forward time against step length (1..256) on the device, written as JSON."""
    model, _, device = workload.load()
    grid = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
    relative = measure_step_costs(model, grid)
    (out / "cost_curve.json").write_text(
        json.dumps({"environment": environment(args, device), "relative_cost": relative}, indent=1)
    )
    for length, cost in relative.items():
        print(f"T={length:>4}: {cost:6.2f}x a one-token forward")


def sampling(args, workload: Workload, out: Path) -> None:
    """`sampling`: plain against lookahead sampling, with a distribution check (`utils/sampling_benchmark.py`)."""
    model, tokenizer, device = workload.load()
    result = run_sampling_benchmark(args, model, workload.prompts(tokenizer, device))

    write_report(out / "sampling", result, args, device, summarize_sampling)


def batched(args, workload: Workload, out: Path) -> None:
    """`batched`: batched greedy against batched lookahead at each batch size (`utils/batched_benchmark.py`)."""
    model, tokenizer, device = workload.load()
    result = run_batched_benchmark(args, model, tokenizer, workload.prompts(tokenizer, device))
    write_report(out / "batched", result, args, device, summarize_batched)


def memory(args, workload: Workload, out: Path) -> None:
    """`memory`: the suffix memory across calls, on four workloads (`utils/memory_benchmark.py`)."""
    model, tokenizer, device = workload.load()
    result = run_memory_benchmark(args, model, tokenizer, device, ForwardTimer(model))
    write_report(out / "memory", result, args, device, summarize_memory)


def departures(args, workload: Workload, out: Path) -> None:
    """`departures`: where each method's greedy output departs from plain greedy (`utils/faithfulness.py`)."""
    model, tokenizer, device = workload.load()
    result = run_departures(args, model, tokenizer, workload.prompts(tokenizer, device))
    write_report(out / f"departures-{args.dtype}", result, args, device, summarize_departures)


def quality(args, workload: Workload, out: Path) -> None:
    """`quality`: HumanEval pass@1 of each decoding method (`utils/quality.py`)."""
    model, tokenizer, device = workload.load()
    result = run_quality(args, model, tokenizer)
    write_report(out / f"quality-{args.dtype}", result, args, device, summarize_quality)


def priced(args, workload: Workload, out: Path) -> None:
    """`priced`: the methods' steps priced by given cost tables (`utils/priced_steps.py`)."""
    model, tokenizer, device = workload.load()
    result = run_priced(args, model, workload.prompts(tokenizer, device))
    rows = functools.partial(summarize_priced, pass_ms=args.pass_ms)
    write_report(out / "priced", result, args, device, rows)


def continuous_batching(args, workload: Workload, out: Path) -> None:
    """`continuous-batching`: plain and lookahead continuous batching under load (`utils/cb_benchmark.py`)."""
    model, tokenizer, device = workload.load(attn_implementation="sdpa")
    result = run_continuous_batching(args, model, tokenizer, workload.prompts(tokenizer, device))
    stem = out / f"continuous_batching-{args.dtype}"
    write_report(stem, result, args, device, summarize_continuous_batching)


def workload_arguments(parser: argparse.ArgumentParser) -> None:
    """What every benchmark runs on: the model and prompts, the dtype and device, where its files go."""
    parser.add_argument(
        "--model",
        help="smollm2 (SmolLM2-135M-Instruct, the default), qwen-coder (Qwen2.5-Coder-0.5B-Instruct), or a model "
        "folder; the named ones are fetched and converted once",
    )
    parser.add_argument("--dataset", choices=["mt_bench", "humaneval", "all"], default="all")
    parser.add_argument("--split", choices=["tuning", "held_out"], default="tuning")
    parser.add_argument("--num-prompts", type=int, default=None, help="prompts per dataset (quick 5, full 16)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=None, help="runs per prompt and method (quick 2, full 3)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: bfloat16 where the device computes it natively, else float32",
    )
    parser.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--cache-dir", default=None, help="where the model and datasets are kept")
    parser.add_argument("--output-dir", default="bench_out")


def methods_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--methods", nargs="+", choices=list(METHODS), default=None, help=f"quick {QUICK_METHODS}, full {FULL_METHODS}"
    )


def generate_arguments(parser: argparse.ArgumentParser) -> None:
    methods_argument(parser)
    parser.add_argument(
        "--full",
        action="store_true",
        help="the full run (16 + 16 prompts, every method, 3 repeats: about an hour on 2 cores) "
        "instead of the quick one (5 + 5 prompts, greedy / prompt lookup / auto, 2 repeats: about 10 minutes)",
    )
    parser.add_argument(
        "--reference-fp32",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"add plain greedy in float32 ({REFERENCE}) to a half-precision run (default: on)",
    )
    parser.add_argument(
        "--context-tokens",
        type=positive(int),
        default=None,
        help="put each prompt after an earlier turn of other tuning prompts' text, about this many tokens in all",
    )


def sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    parser.add_argument("--check-runs", type=int, default=300, help="runs per method of the distribution check")
    parser.add_argument("--check-tokens", type=int, default=6, help="first tokens compared by the distribution check")


def batched_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8])


def departures_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cache-implementation",
        choices=["dynamic", "static"],
        default="dynamic",
        help="the cache every method and plain greedy decode with (a static cache gives every pass of a call the "
        "same key slots)",
    )


def quality_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--first-problem",
        type=int,
        default=0,
        choices=range(TUNING_PROBLEMS),
        metavar=f"0-{TUNING_PROBLEMS - 1}",
        help="the first HumanEval tuning problem to run (default 0), to split a long run",
    )


def priced_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "price_with",
        nargs="+",
        metavar="TABLE",
        help="the cost tables to price steps by: `flat`, or a JSON file holding relative_cost or a gpu-check report",
    )
    parser.add_argument(
        "--pass-ms",
        type=positive(float),
        default=None,
        help="a one-token pass's milliseconds on the priced device, to add this machine's host time",
    )


def continuous_batching_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument(
        "--arrival-rate",
        type=positive(float),
        nargs="+",
        default=None,
        help="requests per second of an open loop (Poisson arrivals), one level each, instead of the closed loop of "
        "--concurrency clients",
    )
    parser.add_argument(
        "--padded-engines",
        action="store_true",
        help="also both engines with every step padded to 64 query and 256 key tokens, captured as CUDA graphs on a "
        "GPU and compiled (static shapes) elsewhere",
    )
    parser.add_argument(
        "--padded-backend",
        choices=["inductor", "eager"],
        default="inductor",
        help="--padded-engines off a GPU: the compiler backend (eager: dynamo alone, which checks the shapes quickly)",
    )


def positive(kind: type) -> Callable[[str], Any]:
    """An argparse type: a `kind` above 0, else a usage error naming the value."""

    def parse(text: str) -> Any:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"takes a value above 0, got {text}")
        return value

    return parse


@dataclass(frozen=True)
class Benchmark:
    """
    One benchmark (`python -m utils.bench <name>`): what it measures and writes (`run`, which writes its table
    beside its JSON file), the arguments it takes besides the workload's, and the dtype `--dtype auto` means for it.
    """

    run: Callable[[argparse.Namespace, Workload, Path], None]
    help: str
    arguments: Callable[[argparse.ArgumentParser], None] | None = None
    auto_dtype: str | None = None
    preset: dict | None = None


# Their texts must be plain greedy's, so that what each step could accept is known: float32.
BENCHMARKS = {
    "generate": Benchmark(
        side_by_side, "greedy, prompt lookup and lookahead side by side (interleaved per prompt)", generate_arguments
    ),
    "whisper": Benchmark(
        side_by_side, "the same with Whisper tiny.en on MT-Bench questions read by espeak-ng", methods_argument
    ),
    "cost-curve": Benchmark(cost_curve, "forward time against step length on this device"),
    "sampling": Benchmark(sampling, "plain against lookahead sampling, with a distribution check", sampling_arguments),
    "batched": Benchmark(batched, "batched greedy against batched lookahead at each batch size", batched_arguments),
    "memory": Benchmark(memory, "the suffix memory across calls, on four workloads", preset=MEMORY),
    "departures": Benchmark(
        departures, "where each method departs from plain greedy, beside batched greedy", departures_arguments
    ),
    "quality": Benchmark(quality, "HumanEval pass@1 of each decoding method", quality_arguments),
    "priced": Benchmark(
        priced, "the methods' steps (float32) priced by given cost tables", priced_arguments, auto_dtype="float32"
    ),
    "continuous-batching": Benchmark(
        continuous_batching, "plain and lookahead continuous batching under load", continuous_batching_arguments
    ),
}
# What the shared code reads of the arguments a benchmark does not take.
DEFAULTS = {"full": False, "methods": None, "reference_fp32": False, "context_tokens": None}


def add_benchmarks(subcommands: argparse._SubParsersAction) -> None:
    """Adds every benchmark of `BENCHMARKS` as a subcommand, with the workload's arguments and its own."""
    for name, benchmark in BENCHMARKS.items():
        parser = subcommands.add_parser(name, help=benchmark.help, description=benchmark.help)
        workload_arguments(parser)
        if benchmark.arguments is not None:
            benchmark.arguments(parser)
        parser.set_defaults(benchmark=name)


def resolve_arguments(args: argparse.Namespace, parser: argparse.ArgumentParser, argv: list[str] | None) -> None:
    """
    Fills what the arguments leave to the benchmark (the preset's counts and methods, the dtype, the float32
    reference) and refuses, through `parser.error`, a combination that cannot run, before anything loads.
    """
    benchmark = BENCHMARKS[args.benchmark]
    for name, value in DEFAULTS.items():
        if not hasattr(args, name):
            setattr(args, name, value)
    args.whisper = args.benchmark == "whisper"
    preset = FULL if args.full else (benchmark.preset or QUICK)
    for name, value in preset.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.command = "python -m utils.bench " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.threads:
        torch.set_num_threads(args.threads)
    if benchmark.auto_dtype is not None and args.dtype not in ("auto", benchmark.auto_dtype):
        parser.error(f"{args.benchmark} decodes in {benchmark.auto_dtype}, where every text is plain greedy's.")
    if args.dtype == "auto":
        native = benchmark.auto_dtype or native_half_precision(Workload(args).device)
        args.dtype = native or "float32"
        print(f"dtype: {args.dtype} (--dtype sets another)", flush=True)
    if REFERENCE in args.methods:
        args.methods = [method for method in args.methods if method != REFERENCE]
        args.reference_fp32 = True
    if args.reference_fp32 is None:
        args.reference_fp32 = args.dtype != "float32"
    if "greedy" not in args.methods:
        args.methods = ["greedy", *args.methods]
    if args.whisper and args.model:
        parser.error("whisper runs on its own model; drop --model.")


def main(argv: list[str] | None = None, workload: Workload | None = None) -> None:
    """
    Runs the benchmark `argv` names first (see `BENCHMARKS`) with the arguments after it, and writes its report into
    `--output-dir`: what `python -m utils.bench <benchmark> ...` runs.

    Args:
        argv (`list[str]`, *optional*): the benchmark's name and its arguments, by default the command line's.
        workload (`Workload`, *optional*): what the benchmark runs on, by default what the arguments name.
    """
    parser = argparse.ArgumentParser(prog="python -m utils.bench", description="The benchmarks.")
    add_benchmarks(parser.add_subparsers(dest="benchmark", required=True, metavar="benchmark"))
    args = parser.parse_args(argv)
    resolve_arguments(args, parser, argv)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    BENCHMARKS[args.benchmark].run(args, Workload(args) if workload is None else workload, out)


if __name__ == "__main__":
    main()
