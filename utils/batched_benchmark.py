"""
`python -m utils.bench batched`: batched greedy against batched lookahead (`lookahead_window="auto"`) at each batch
size, on the same prompts cut into left-padded batches.
"""

from __future__ import annotations

import statistics

import torch

from utils.memory_benchmark import own_memory
from utils.timing import ForwardTimer, Run
from utils.tiny_models import left_padded


def run_batched_benchmark(args, model, tokenizer, prompts) -> dict:
    """
    Batched greedy against batched lookahead (`lookahead_window="auto"`) for each batch size, on the same prompts
    cut into left-padded batches; the two methods run interleaved per batch.
    """
    from tqdm.auto import tqdm

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    common = {"max_new_tokens": args.max_new_tokens, "do_sample": False, "pad_token_id": pad_id}
    methods = {"greedy": {}, "lookahead_auto": {"lookahead_window": "auto"}}
    timer = ForwardTimer(model)
    warm = left_padded([prompts[0][2], prompts[-1][2]], pad_id)
    for kwargs in methods.values():
        model.generate(**warm, **common, **kwargs)
    runs = []
    total = sum(-(-len(prompts) // size) for size in args.batch_sizes) * args.repeats * len(methods)
    progress = tqdm(total=total, desc="batched", unit="batch")
    for size in args.batch_sizes:
        for start in range(0, len(prompts), size):
            group = prompts[start : start + size]
            inputs = left_padded([ids for _, _, ids, _ in group], pad_id)
            reference = None
            for repeat in range(args.repeats):
                for method, kwargs in methods.items():
                    out, seconds = timer.generate(
                        **inputs, **common, **kwargs, **own_memory(kwargs, f"{method}-{size}-{repeat}")
                    )
                    reference = out if reference is None else reference
                    generated = out[:, inputs["input_ids"].shape[1] :]
                    runs.append(
                        Run(
                            prompt_id=None,
                            batch_size=size,
                            batch=start // size,
                            method=method,
                            repeat=repeat,
                            # Padding after a row's EOS is not a generated token.
                            new_tokens=int(_generated_lengths(generated, tokenizer.eos_token_id).sum()),
                            seconds=seconds,
                            forward_seconds=timer.seconds,
                            forward_passes=timer.calls,
                            identical_to_greedy=bool(torch.equal(out, reference)),
                        ).record()
                    )
                    progress.update()
    progress.close()
    return {"runs": runs}


def _generated_lengths(generated: torch.LongTensor, eos_id: int | None) -> torch.LongTensor:
    """Per row, the tokens up to and including the first EOS (all of them if there is none)."""
    length = generated.shape[1]
    if eos_id is None:
        return torch.full((generated.shape[0],), length)
    is_eos = generated == eos_id
    first = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1) + 1, torch.tensor(length))
    return first.cpu()


def summarize_batched(result: dict) -> list[dict]:
    """Per batch size: tokens/s of each method (median over repeats of each batch's time, summed) and the speedup."""
    rows = []
    for size in sorted({run["batch_size"] for run in result["runs"]}):
        mine = [run for run in result["runs"] if run["batch_size"] == size]
        seconds, tokens = {}, {}
        for method in ("greedy", "lookahead_auto"):
            runs = [run for run in mine if run["method"] == method]
            batches = sorted({run["batch"] for run in runs})
            seconds[method] = sum(
                statistics.median(run["seconds"] for run in runs if run["batch"] == batch) for batch in batches
            )
            tokens[method] = sum(next(run["new_tokens"] for run in runs if run["batch"] == batch) for batch in batches)
        lookahead = [run for run in mine if run["method"] == "lookahead_auto"]
        host = {
            method: 1
            - sum(run.get("forward_seconds", 0.0) for run in mine if run["method"] == method)
            / sum(run["seconds"] for run in mine if run["method"] == method)
            for method in ("greedy", "lookahead_auto")
        }
        rows.append(
            {
                "batch_size": size,
                "greedy_host_share": host["greedy"],
                "lookahead_host_share": host["lookahead_auto"],
                "greedy_tokens_per_s": tokens["greedy"] / seconds["greedy"],
                "lookahead_tokens_per_s": tokens["lookahead_auto"] / seconds["lookahead_auto"],
                "speedup": seconds["greedy"] / seconds["lookahead_auto"],
                "identical": sum(run["identical_to_greedy"] for run in lookahead),
                "runs": len(lookahead),
            }
        )
    return rows
