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


def _step_offset(accepted_per_step: tuple[int, ...], position: int) -> int | None:
    """
    Where generated token `position` sits in the lookahead step that produced it: 0 for the token chosen right after
    the step's pending token, k for the k-th token chosen from a verified candidate's row. `None` for the prefill's.
    """
    if position == 0:
        return None
    start = 1
    for accepted in accepted_per_step:
        if position < start + accepted:
            return position - start
        start += accepted
    return None


def run_departures(args, model, tokenizer, prompts) -> dict:
    """
    For every prompt: plain greedy, then each method of `DEPARTURE_METHODS` (the batched baseline pairs the prompt
    with the next one), and the first position where each departs from plain greedy within `args.max_new_tokens`.
    Also, per departure, plain greedy's margin between its two best logits at that position (how near a tie it was)
    and, for lookahead, where in its step the departing token was chosen (`_step_offset`); and plain greedy's margins
    at every position, to compare with.

    Args:
        prompts (`list`): `(prompt_id, category, input_ids, prompt_length)` as the benchmark builds them.
    """
    from tqdm.auto import tqdm

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    common = {"max_new_tokens": args.max_new_tokens, "do_sample": False}
    results = []
    for index, (prompt_id, category, ids, prompt_length) in enumerate(tqdm(prompts, desc="departures", unit="prompt")):
        plain = model.generate(ids, **common, output_scores=True, return_dict_in_generate=True)
        reference = _new_tokens(plain.sequences[0], prompt_length, pad_id, tokenizer.eos_token_id)
        margins = [float(scores[0].topk(2).values.diff().abs()) for scores in plain.scores[: len(reference)]]
        departures, details = {}, {}
        for method, kwargs in DEPARTURE_METHODS.items():
            if kwargs is None:
                neighbour = prompts[(index + 1) % len(prompts)][2]
                batch = left_padded([ids, neighbour], pad_id)
                row = model.generate(**batch, **common, pad_token_id=pad_id)[0]
                generated = _new_tokens(row, batch["input_ids"].shape[1], pad_id, tokenizer.eos_token_id)
                steps = None
            else:
                out = model.generate(ids, **common, **kwargs, return_dict_in_generate=True)
                generated = _new_tokens(out.sequences[0], prompt_length, pad_id, tokenizer.eos_token_id)
                steps = getattr(out, "accepted_per_step", None)
            departure = first_departure(generated, reference)
            departures[method] = departure
            if departure is not None and departure < len(margins):
                details[method] = {
                    "margin": margins[departure],
                    "step_offset": None if steps is None else _step_offset(steps, departure),
                }
        results.append(
            {
                "prompt_id": prompt_id,
                "category": category,
                "tokens": len(reference),
                "departures": departures,
                "at_departure": details,
                "margins": margins,
            }
        )
    return {"prompts": results, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens}


def summarize_departures(result: dict) -> list[dict]:
    """
    Per method: prompts departed, the median and earliest first departure, plain greedy's median top-2 logit margin
    at the departures (beside its median over every position), and how many departing tokens were the first of
    their lookahead step.
    """
    everywhere = [margin for entry in result["prompts"] for margin in entry.get("margins", [])]
    rows = []
    for method in DEPARTURE_METHODS:
        positions = [entry["departures"][method] for entry in result["prompts"]]
        departed = [position for position in positions if position is not None]
        at = [entry["at_departure"][method] for entry in result["prompts"] if method in entry.get("at_departure", {})]
        offsets = [detail["step_offset"] for detail in at if detail["step_offset"] is not None]
        rows.append(
            {
                "method": method,
                "prompts": len(positions),
                "departed": len(departed),
                "median_first_departure": statistics.median(departed) if departed else None,
                "earliest_departure": min(departed) if departed else None,
                "median_margin_at_departure": round(statistics.median(d["margin"] for d in at), 4) if at else None,
                "median_margin_everywhere": round(statistics.median(everywhere), 4) if everywhere else None,
                "first_of_step": f"{sum(offset == 0 for offset in offsets)} / {len(offsets)}" if offsets else None,
            }
        )
    return rows


def format_departures_table(rows: list[dict], result: dict) -> str:
    lines = [
        f"Departures from plain greedy ({result['dtype']}, {result['max_new_tokens']} new tokens; batched_greedy is "
        "the prompt in a left-padded batch of two)",
        "",
        "| method | prompts departed | median first departure | earliest | plain's top-2 margin there | first of "
        "its step |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['method']} | {row['departed']} / {row['prompts']} | {row['median_first_departure']} | "
            f"{row['earliest_departure']} | {row['median_margin_at_departure']} | {row['first_of_step']} |"
        )
    if rows:
        lines.append("")
        lines.append(
            f"Plain greedy's median top-2 logit margin over every position: {rows[0]['median_margin_everywhere']}"
        )
    return "\n".join(lines)
