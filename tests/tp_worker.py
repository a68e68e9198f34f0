"""
One rank of the tensor-parallel tests (`tests/test_tensor_parallel.py`), run under `torchrun`: loads each model folder
with `tp_plan="auto"`, decodes with and without lookahead, and writes what it got to `OUT/rank<R>.json` for the
parent test to compare across ranks and against plain tensor-parallel decoding.

    torchrun --nproc-per-node 2 tests/tp_worker.py OUT FOLDER [FOLDER ...] [--sampling FOLDER] [--bfloat16 FOLDER]
        [--new-tokens N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList  # noqa: E402

from transformers_lookahead import LookaheadState, enable_lookahead  # noqa: E402
from transformers_lookahead.cost_model import StepCostModel  # noqa: E402

# Each rank gets its own cost table, as separately measured tables would differ: rank 0 sees a flat device (large
# steps pay), the others a steep one (they do not). Without agreement the ranks would plan different steps.
COSTS = [StepCostModel({1: 1.0, 64: 1.0}), StepCostModel({1: 1.0, 2: 1.8, 8: 3.0, 64: 20.0})]


class StopOnRank(StoppingCriteria):
    """Stops after `tokens` new tokens, on one rank only: the divergence the ranks must detect together."""

    def __init__(self, prompt_length: int, tokens: int, rank: int):
        self.limit, self.rank = prompt_length + tokens, rank

    def __call__(self, input_ids, scores, **kwargs):
        fire = dist.get_rank() == self.rank and input_ids.shape[1] >= self.limit
        return torch.full((input_ids.shape[0],), fire, dtype=torch.bool)


def prompts(vocab: int) -> list[torch.LongTensor]:
    generator = torch.Generator().manual_seed(7)
    rows = []
    for length in (18, 11):
        base = torch.randint(2, vocab, (length // 2,), generator=generator)
        rows.append(torch.cat([base, base, base[:1]])[None])
    return rows


def real_prompts(folder: str) -> list[torch.LongTensor]:
    """An MT-Bench and a HumanEval tuning prompt, as the benchmark prompts the real model."""
    from transformers import AutoTokenizer

    from utils.assets import chat_input_ids, tuning_prompts

    tokenizer = AutoTokenizer.from_pretrained(folder)
    return [chat_input_ids(tokenizer, tuning_prompts(name)[0][2], name) for name in ("mt_bench", "humaneval")]


def real_model_cases(model, folder: str, new_tokens: int) -> dict:
    """Plain tensor-parallel greedy, W=4 and "auto" on real prompts."""
    results = {}
    for index, prompt in enumerate(real_prompts(folder)):
        for name, kwargs in (
            ("plain", {}),
            ("window_4", {"lookahead_window": 4}),
            ("auto", {"lookahead_window": "auto"}),
        ):
            out = model.generate(
                prompt, max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True, **kwargs
            )
            accepted = out.accepted_per_step if hasattr(out, "accepted_per_step") else None
            results[f"{name}_{index}"] = {"tokens": out.sequences.tolist(), "accepted": accepted}
    return results


def greedy_cases(model, new_tokens: int) -> dict:
    vocab = model.config.vocab_size
    first, second = prompts(vocab)
    common = {"max_new_tokens": new_tokens, "do_sample": False}
    results = {}

    def record(name: str, **kwargs) -> None:
        out = model.generate(return_dict_in_generate=True, **common, **kwargs)
        accepted = out.accepted_per_step if hasattr(out, "accepted_per_step") else None
        results[name] = {"tokens": out.sequences.tolist(), "accepted": accepted}

    record("plain", inputs=first)
    record("window_4", inputs=first, lookahead_window=4)
    record("auto", inputs=first, lookahead_window="auto")
    if getattr(model.config, "sliding_window", None) is None:
        # Static sliding layers cannot be rolled back once the generation outgrows their window (refused on one
        # device too): static caches are checked on full-attention models.
        record("plain_static", inputs=first, cache_implementation="static")
        record("window_4_static", inputs=first, lookahead_window=4, cache_implementation="static")
    width = max(first.shape[1], second.shape[1])
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for row, prompt in enumerate((first, second)):
        ids[row, width - prompt.shape[1] :], mask[row, width - prompt.shape[1] :] = prompt[0], 1
    record("plain_batch", inputs=ids, attention_mask=mask)
    record("auto_batch", inputs=ids, attention_mask=mask, lookahead_window="auto")
    # An EOS that plain decoding emits mid-way: lookahead must stop on it too, also inside an accepted chunk.
    eos = results["plain"]["tokens"][0][first.shape[1] + new_tokens // 2]
    record("plain_eos", inputs=first, eos_token_id=eos, pad_token_id=0)
    record("window_4_eos", inputs=first, eos_token_id=eos, pad_token_id=0, lookahead_window=4)
    try:
        model.generate(
            first,
            **common,
            lookahead_window=4,
            stopping_criteria=StoppingCriteriaList([StopOnRank(first.shape[1], 5, rank=1)]),
        )
        results["diverged"] = {"error": None}
    except RuntimeError as error:
        results["diverged"] = {"error": str(error)}
    return results


def bfloat16_cases(model, new_tokens: int) -> dict:
    """
    W=4 and "auto" on one prompt and a left-padded batch in bfloat16, and where their tokens are no near-tie of plain
    tensor-parallel greedy's choice along the same text (`utils.faithfulness`): none may be.
    """
    from utils.faithfulness import greedy_margins, off_greedy_positions
    from utils.tiny_models import left_padded

    first, second = prompts(model.config.vocab_size)
    results = {}
    for name, inputs in (("single", {"input_ids": first}), ("batch", left_padded([first, second]))):
        for window in (4, "auto"):
            out = model.generate(
                **inputs,
                max_new_tokens=new_tokens,
                do_sample=False,
                lookahead_window=window,
                return_dict_in_generate=True,
            )
            texts = out.sequences[:, -new_tokens:]
            margins, scales = greedy_margins(model, inputs, texts)
            results[f"{name}_{window}"] = {
                "tokens": texts.tolist(),
                "accepted": out.accepted_per_step,
                "off_greedy": off_greedy_positions(margins, scales, torch.bfloat16),
                "largest_margin": float(margins.max()),
            }
    return results


def sampling_cases(model, runs: int, new_tokens: int) -> dict:
    prompt = prompts(model.config.vocab_size)[0]
    samples = {}
    for name, kwargs in (("plain", {}), ("lookahead", {"lookahead_window": 3})):
        rows = []
        for run in range(runs):
            torch.manual_seed(run)
            out = model.generate(prompt, max_new_tokens=new_tokens, do_sample=True, temperature=1.0, **kwargs)
            rows.append(out[0, prompt.shape[1] :].tolist())
        samples[name] = rows
    return samples


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("folders", nargs="*")
    parser.add_argument("--sampling", default=None, help="a small-vocabulary model folder for the sampling check")
    parser.add_argument("--sampling-runs", type=int, default=300)
    parser.add_argument("--bfloat16", default=None, help="a model folder to decode in bfloat16")
    parser.add_argument("--new-tokens", type=int, default=30)
    parser.add_argument("--real-prompts", action="store_true", help="the folders hold a real model and tokenizer")
    args = parser.parse_args()
    torch.set_num_threads(1)
    report: dict = {"world_size": int(os.environ["WORLD_SIZE"])}
    for folder in args.folders:
        model = AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto", dtype=torch.float32).eval()
        rank = dist.get_rank()
        report["tp_size"] = model.tp_size
        # Each rank's own table: rank 0's must decide every rank's steps.
        enable_lookahead(model, state=LookaheadState(cost_dir=None, step_costs=COSTS[min(rank, 1)]))
        if args.real_prompts:
            report[Path(folder).name] = real_model_cases(model, folder, args.new_tokens)
        else:
            report[Path(folder).name] = greedy_cases(model, args.new_tokens)
    if args.bfloat16:
        model = AutoModelForCausalLM.from_pretrained(args.bfloat16, tp_plan="auto", dtype=torch.bfloat16).eval()
        enable_lookahead(model, state=LookaheadState(cost_dir=None, step_costs=COSTS[min(dist.get_rank(), 1)]))
        report["bfloat16"] = bfloat16_cases(model, args.new_tokens)
    if args.sampling:
        model = AutoModelForCausalLM.from_pretrained(args.sampling, tp_plan="auto", dtype=torch.float32).eval()
        enable_lookahead(model, state=LookaheadState(cost_dir=None))
        report["sampling"] = sampling_cases(model, args.sampling_runs, 4)
    Path(args.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
