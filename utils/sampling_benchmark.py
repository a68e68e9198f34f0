"""
`python -m utils.bench sampling`: plain sampling against lookahead sampling, interleaved per prompt with the same seed
at each temperature, and a distribution check per temperature (the first tokens of many draws of each, compared
position by position).
"""

from __future__ import annotations

import statistics
from collections import defaultdict

import torch

from utils.distribution_check import homogeneity_p_value, token_counts
from utils.memory_benchmark import own_memory
from utils.methods import METHODS
from utils.timing import ForwardTimer, Run

SAMPLING_METHODS = {"sample": METHODS["greedy"], "lookahead_sample": METHODS["lookahead_auto"]}


def run_sampling_benchmark(args, model, prompts) -> dict:
    """
    Plain sampling against lookahead sampling (`lookahead_window="auto"`), interleaved per prompt with the same seed,
    at each temperature; then a distribution check per temperature (see `_distribution_check`).
    """
    from tqdm.auto import tqdm

    timer = ForwardTimer(model)
    runs = []
    model.generate(prompts[0][2], max_new_tokens=8, do_sample=True, lookahead_window="auto")  # warm-up
    progress = tqdm(total=len(prompts) * args.repeats * len(args.temperatures) * 2, desc="sampling", unit="gen")
    for temperature in args.temperatures:
        for index, (prompt_id, category, ids, _) in enumerate(prompts):
            for repeat in range(args.repeats):
                for method, kwargs in SAMPLING_METHODS.items():
                    torch.manual_seed(1000 * index + repeat)
                    out, seconds = timer.generate(
                        ids,
                        do_sample=True,
                        temperature=temperature,
                        max_new_tokens=args.max_new_tokens,
                        **kwargs,
                        **own_memory(kwargs, f"{method}-{temperature}-{repeat}"),
                    )
                    runs.append(
                        Run(
                            prompt_id=prompt_id,
                            category=category,
                            method=method,
                            temperature=temperature,
                            repeat=repeat,
                            new_tokens=out.shape[1] - ids.shape[1],
                            seconds=seconds,
                            forward_seconds=timer.seconds,
                            forward_passes=timer.calls,
                        ).record()
                    )
                    progress.update()
    progress.close()
    # The check uses the first HumanEval prompt when there is one: code repeats itself, so candidates get accepted.
    check_ids = next((ids for _, category, ids, _ in prompts if category == "humaneval"), prompts[0][2])
    checks = [
        _distribution_check(model, check_ids, temperature, args.check_runs, args.check_tokens)
        for temperature in args.temperatures
    ]
    return {"runs": runs, "distribution_checks": checks}


def _distribution_check(model, ids: torch.LongTensor, temperature: float, runs: int, new_tokens: int) -> dict:
    """
    Draws the first `new_tokens` tokens `runs` times with plain sampling (one batched call) and with lookahead
    sampling (one call per run), and tests per position that both samples come from one distribution.
    """
    common = {
        "do_sample": True,
        "temperature": temperature,
        "max_new_tokens": new_tokens,
        "min_new_tokens": new_tokens,
    }
    torch.manual_seed(0)
    plain = model.generate(ids, num_return_sequences=runs, **common)[:, ids.shape[1] :]
    lookahead, multi_token_runs = [], 0
    for _ in range(runs):
        out = model.generate(ids, lookahead_window="auto", return_dict_in_generate=True, **common)
        lookahead.append(out.sequences[0, ids.shape[1] :])
        multi_token_runs += any(kept > 1 for kept in out.accepted_per_step)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    plain_counts, lookahead_counts = token_counts(plain, vocab), token_counts(torch.stack(lookahead), vocab)
    p_values = [homogeneity_p_value(plain_counts[i], lookahead_counts[i]) for i in range(new_tokens)]
    return {
        "temperature": temperature,
        "runs": runs,
        "new_tokens": new_tokens,
        "p_values": p_values,
        "runs_with_multi_token_steps": multi_token_runs,
    }


def summarize_sampling(result: dict) -> list[dict]:
    """
    Per temperature and dataset: tokens/s of each method (total tokens / total seconds, since sampled lengths differ),
    the speedup as the ratio of those, the median per-prompt speedup, and lookahead's tokens per forward.
    """
    groups = defaultdict(list)
    for run in result["runs"]:
        dataset = "humaneval" if run["category"] == "humaneval" else "mt_bench"
        for name in (dataset, "all"):
            groups[(run["temperature"], name)].append(run)
    rows = []
    for (temperature, dataset), selected in sorted(groups.items()):
        rate = {}
        per_prompt = defaultdict(dict)
        for method in SAMPLING_METHODS:
            mine = [r for r in selected if r["method"] == method]
            rate[method] = sum(r["new_tokens"] for r in mine) / sum(r["seconds"] for r in mine)
            for prompt_id in {r["prompt_id"] for r in mine}:
                theirs = [r for r in mine if r["prompt_id"] == prompt_id]
                per_prompt[prompt_id][method] = sum(r["new_tokens"] for r in theirs) / sum(
                    r["seconds"] for r in theirs
                )
        lookahead = [r for r in selected if r["method"] == "lookahead_sample"]
        rows.append(
            {
                "temperature": temperature,
                "dataset": dataset,
                "prompts": len(per_prompt),
                "sample_tokens_per_s": rate["sample"],
                "lookahead_tokens_per_s": rate["lookahead_sample"],
                "speedup": rate["lookahead_sample"] / rate["sample"],
                "median_prompt_speedup": statistics.median(
                    rates["lookahead_sample"] / rates["sample"] for rates in per_prompt.values()
                ),
                "tokens_per_forward": sum(r["new_tokens"] for r in lookahead)
                / sum(r["forward_passes"] for r in lookahead),
            }
        )
    return rows
