"""
`utils/benchmark.py --departures`: how often, and where, each method's greedy output departs from plain greedy
decoding of the same prompt, next to the baseline every batching server sets: plain greedy of the same prompt in a
left-padded batch of two. In fp32 every method should never depart; in bf16 / fp16 a pass over several tokens (or
several rows) reduces in another order than a one-token pass, so near-ties can break the other way.

    python utils/benchmark.py --departures --dtype bfloat16 --num-prompts 8 --max-new-tokens 96
"""

from __future__ import annotations

import statistics

import torch

from utils.tiny_models import left_padded

# What is compared with plain greedy; "batched_greedy" is the baseline, not a speed-up method.
DEPARTURE_METHODS = {
    "batched_greedy": None,
    "prompt_lookup": {"prompt_lookup_num_tokens": 10},
    "lookahead_auto": {"lookahead_window": "auto", "lookahead_memory": False},
    "lookahead_7_5_7": {"lookahead_window": 7, "lookahead_ngram": 5, "lookahead_guess": 7},
}


def first_departure(generated: list[int], reference: list[int]) -> int | None:
    """The first position where `generated` differs from `reference` (a shorter one departs where it ends)."""
    for position, (token, expected) in enumerate(zip(generated, reference)):
        if token != expected:
            return position
    if len(generated) != len(reference):
        return min(len(generated), len(reference))
    return None


def _new_tokens(row: torch.LongTensor, prompt_length: int, pad_id: int | None, eos_id: int | None) -> list[int]:
    """The tokens generated after a prompt of `prompt_length` tokens, up to and including the first EOS."""
    tokens = row[prompt_length:].tolist()
    if eos_id is not None and eos_id in tokens:
        tokens = tokens[: tokens.index(eos_id) + 1]
    elif pad_id is not None:
        while tokens and tokens[-1] == pad_id:
            tokens.pop()
    return tokens


def run_departures(args, model, tokenizer, prompts) -> dict:
    """
    For every prompt: plain greedy, then each method of `DEPARTURE_METHODS` (the batched baseline pairs the prompt
    with the next one), and the first position where each departs from plain greedy within `args.max_new_tokens`.

    Args:
        prompts (`list`): `(prompt_id, category, input_ids, prompt_length)` as the benchmark builds them.
    """
    from tqdm.auto import tqdm

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    common = {"max_new_tokens": args.max_new_tokens, "do_sample": False}
    results = []
    for index, (prompt_id, category, ids, prompt_length) in enumerate(tqdm(prompts, desc="departures", unit="prompt")):
        reference = _new_tokens(model.generate(ids, **common)[0], prompt_length, pad_id, tokenizer.eos_token_id)
        departures = {}
        for method, kwargs in DEPARTURE_METHODS.items():
            if kwargs is None:
                neighbour = prompts[(index + 1) % len(prompts)][2]
                batch = left_padded([ids, neighbour], pad_id)
                row = model.generate(**batch, **common, pad_token_id=pad_id)[0]
                generated = _new_tokens(row, batch["input_ids"].shape[1], pad_id, tokenizer.eos_token_id)
            else:
                out = model.generate(ids, **common, **kwargs)
                generated = _new_tokens(out[0], prompt_length, pad_id, tokenizer.eos_token_id)
            departures[method] = first_departure(generated, reference)
        results.append(
            {"prompt_id": prompt_id, "category": category, "tokens": len(reference), "departures": departures}
        )
    return {"prompts": results, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens}


def summarize_departures(result: dict) -> list[dict]:
    """Per method: prompts departed, and the median first departure position among them."""
    rows = []
    for method in DEPARTURE_METHODS:
        positions = [entry["departures"][method] for entry in result["prompts"]]
        departed = [position for position in positions if position is not None]
        rows.append(
            {
                "method": method,
                "prompts": len(positions),
                "departed": len(departed),
                "median_first_departure": statistics.median(departed) if departed else None,
                "earliest_departure": min(departed) if departed else None,
            }
        )
    return rows


def format_departures_table(rows: list[dict], result: dict) -> str:
    lines = [
        f"Departures from plain greedy ({result['dtype']}, {result['max_new_tokens']} new tokens; batched_greedy is "
        "the prompt in a left-padded batch of two)",
        "",
        "| method | prompts departed | median first departure | earliest |",
        "|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['method']} | {row['departed']} / {row['prompts']} | {row['median_first_departure']} | "
            f"{row['earliest_departure']} |"
        )
    return "\n".join(lines)
