"""
`python -m utils.bench departures`: how often, and where, each method's greedy output departs from plain greedy
decoding of the same prompt, next to the baseline every batching server sets: plain greedy of the same prompt in a
left-padded batch of two. In fp32 every method should never depart; in bf16 / fp16 a pass over several tokens (or
several rows) reduces in another order than a one-token pass, so near-ties can break the other way.

    python -m utils.bench departures --dtype bfloat16 --num-prompts 8 --max-new-tokens 96
    python -m utils.bench departures --dtype bfloat16 --cache-implementation static   # one key length per call
"""

from __future__ import annotations

import math
import statistics

import torch
from transformers import LogitsProcessor

from utils.methods import methods
from utils.tiny_models import left_padded

# What is compared with plain greedy; "batched_greedy" is the baseline, not a speed-up method.
DEPARTURE_METHODS = {
    "batched_greedy": None,
    **methods("prompt_lookup", "lookahead_auto", "lookahead_7_5_7", without_memory=True),
}


# Slots a static cache keeps past the last generated token: Transformers' prompt lookup writes the entries of the
# candidates it verifies there (up to `prompt_lookup_num_tokens`) and fails on a cache sized to the output.
STATIC_CACHE_ROOM = 16


class ForcedPath(LogitsProcessor):
    """
    Makes plain greedy decoding follow given texts, one token per forward pass as plain greedy decodes, and records at
    each position how far below the best logit the forced token's logit is (0 where the text is plain greedy's own
    choice) and the largest finite logit's size there. Put it last: it replaces the scores with the forced choice.

    Args:
        texts (`torch.LongTensor` of shape `(rows, tokens)`): the tokens each row is made to generate.
    """

    def __init__(self, texts: torch.LongTensor):
        self.texts = texts
        self.margins: list[torch.Tensor] = []
        self.scales: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        forced = self.texts[:, len(self.margins)].to(scores.device)[:, None]
        self.margins.append((scores.max(dim=-1).values - scores.gather(1, forced)[:, 0]).float().cpu())
        finite = scores.masked_fill(~torch.isfinite(scores), 0)
        self.scales.append(finite.abs().amax(dim=-1).float().cpu())
        return torch.full_like(scores, -float("inf")).scatter_(1, forced, 0.0)


def greedy_margins(model, inputs: dict, texts: torch.LongTensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Plain greedy's view of generated texts: each row of `texts` is fed to the model one token per pass, after the same
    inputs (prompt, padding, cache), and at every position the margin by which the generated token's logit falls short
    of plain greedy's best (0: plain greedy would have chosen it too).

    Args:
        model (`PreTrainedModel`): the model that generated `texts`; its own class's `generate` decodes here, without
            lookahead settings.
        inputs (`dict`): the `generate` inputs the texts were generated from (`input_ids`, `attention_mask`,
            `input_features`, ...).
        texts (`torch.LongTensor` of shape `(rows, tokens)`): the generated tokens, without the prompt.
        kwargs: other `generate` arguments of the generation being checked (`cache_implementation`, processors'
            settings), so that plain greedy runs as it did.

    Returns:
        `(margins, scales)`: two `(rows, positions)` float tensors, the margins and the largest finite logit's size at
        each position; fewer positions than `texts` has tokens where every row's text ends with an EOS before.
    """
    forced = ForcedPath(texts)
    processors = [*kwargs.pop("logits_processor", []), forced]
    type(model).generate(
        model,
        **inputs,
        **kwargs,
        max_new_tokens=texts.shape[1],
        do_sample=False,
        logits_processor=processors,
    )
    return torch.stack(forced.margins, dim=1), torch.stack(forced.scales, dim=1)


# Units of the dtype's relative precision (times the largest logit) that a near-tie may fall short of the best by.
# Measured on SmolLM2-135M in bfloat16 (16 tuning prompts x 64 tokens, lookahead "auto" with big steps): at most 2.03;
# even the runner-up of plain greedy's choice falls short by 12 units at the median position (2.3 logits).
NEAR_TIE_UNITS = 4.0


def near_tie_tolerance(dtype: torch.dtype, scales: torch.Tensor, units: float = NEAR_TIE_UNITS) -> torch.Tensor:
    """
    How far below plain greedy's best logit a token chosen by a pass of another shape may fall in `dtype`: `units`
    times the dtype's relative precision times the logits' size (a pass over several tokens or rows sums in another
    order, every layer's output is rounded to the dtype, and the differences carry through the cache). Zero in
    float32, where every method must be exact.
    """
    if dtype == torch.float32:
        return torch.zeros_like(scales)
    return units * torch.finfo(dtype).eps * scales


def off_greedy_positions(margins: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> list[tuple[int, int]]:
    """`(row, position)` of every generated token that is no near-tie of plain greedy's choice (`greedy_margins`)."""
    return [tuple(index) for index in (margins > near_tie_tolerance(dtype, scales)).nonzero().tolist()]


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


def run_departures(args, model, tokenizer, prompts, methods: dict | None = None) -> dict:
    """
    For every prompt: plain greedy, then each method of `DEPARTURE_METHODS` (the batched baseline decodes prompts two
    by two, see `_batch_pair`), and the first position where each departs from plain greedy within
    `args.max_new_tokens`. Also, per departure, plain greedy's margin between its two best logits at that position
    (how near a tie it was) and, for lookahead, where in its step the departing token was chosen (`_step_offset`);
    and plain greedy's margins at every position, to compare with; and, on the first prompts, which modules make a
    pass over several tokens compute rows otherwise than one-token passes (`divergence_sources`). Everything decodes
    with `args.cache_implementation` (`"dynamic"` when absent).

    Args:
        prompts (`list`): `(prompt_id, category, input_ids, prompt_length)` as the benchmark builds them.
        methods (`dict`, *optional*): name -> `generate` settings (`None`: the batched baseline), by default
            `DEPARTURE_METHODS`.
    """
    methods = DEPARTURE_METHODS if methods is None else methods
    from tqdm.auto import tqdm

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    common = {"max_new_tokens": args.max_new_tokens, "do_sample": False}
    cache = getattr(args, "cache_implementation", "dynamic")
    results = []
    # Each batch of two serves both its prompts: (prompt pair) -> (output rows, padded prompt length).
    batched: dict[tuple[int, int], tuple[torch.LongTensor, int]] = {}
    for index, (prompt_id, category, ids, prompt_length) in enumerate(tqdm(prompts, desc="departures", unit="prompt")):
        own_cache = cache_kwargs(cache, ids.shape[1], args.max_new_tokens)
        plain = model.generate(ids, **common, **own_cache, output_scores=True, return_dict_in_generate=True)
        reference = _new_tokens(plain.sequences[0], prompt_length, pad_id, tokenizer.eos_token_id)
        margins = [float(scores[0].topk(2).values.diff().abs()) for scores in plain.scores[: len(reference)]]
        departures, details, off_greedy, forwards = {}, {}, {}, {}
        for method, kwargs in methods.items():
            if kwargs is None:
                pair = _batch_pair(index, len(prompts))
                if pair not in batched:
                    batch = left_padded([prompts[member][2] for member in pair], pad_id)
                    batch_cache = cache_kwargs(cache, batch["input_ids"].shape[1], args.max_new_tokens)
                    rows = model.generate(**batch, **common, **batch_cache, pad_token_id=pad_id)
                    batched[pair] = (rows, batch["input_ids"].shape[1])
                rows, batch_length = batched[pair]
                generated = _new_tokens(rows[pair.index(index)], batch_length, pad_id, tokenizer.eos_token_id)
                steps = None
            else:
                out = model.generate(ids, **common, **own_cache, **kwargs, return_dict_in_generate=True)
                generated = _new_tokens(out.sequences[0], prompt_length, pad_id, tokenizer.eos_token_id)
                steps = getattr(out, "accepted_per_step", None)
            if steps is not None:
                # Tokens and forward passes of the lookahead methods (the prefill counts as one pass).
                forwards[method] = (len(generated), len(steps) + 1)
            departure = first_departure(generated, reference)
            departures[method] = departure
            if departure is not None and departure < len(margins):
                details[method] = {
                    "margin": margins[departure],
                    "step_offset": None if steps is None else _step_offset(steps, departure),
                }
            off_greedy[method] = _off_greedy_count(model, ids, generated, departure, **own_cache)
        results.append(
            {
                "prompt_id": prompt_id,
                "category": category,
                "tokens": len(reference),
                "departures": departures,
                "at_departure": details,
                "off_greedy": off_greedy,
                "forwards": forwards,
                "margins": margins,
            }
        )
    return {
        "prompts": results,
        "methods": list(methods),
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        "cache": cache,
    }


def _batch_pair(index: int, count: int) -> tuple[int, int]:
    """
    The batch of two that holds prompt `index` of `count` for the batched baseline, in batch order: prompts 0 and 1
    together, 2 and 3, and so on; a last prompt without a partner goes with the first.
    """
    partner = index ^ 1
    if partner >= count:
        partner = (index + 1) % count
    return (min(index, partner), max(index, partner))


def cache_kwargs(cache: str, input_length: int, max_new_tokens: int) -> dict:
    """
    The `generate` arguments that decode `input_length` tokens and their continuation with the `cache`
    implementation: none for `"dynamic"`; a static cache is sized to the output plus `STATIC_CACHE_ROOM`, the same for
    every method of a prompt (lookahead asks for more: its widest step, `max_cache_len` being a floor).
    """
    if cache == "dynamic":
        return {}
    return {"cache_implementation": cache, "max_cache_len": input_length + max_new_tokens + STATIC_CACHE_ROOM}


def _off_greedy_count(
    model, ids: torch.LongTensor, generated: list[int], departure: int | None, **cache_arguments
) -> int:
    """
    How many of `generated` are no near-tie of plain greedy's choice along that text (none before `departure`), plain
    greedy decoding with the cache arguments (`cache_kwargs`) the text was generated with.
    """
    if departure is None or not generated:
        return 0
    texts = torch.tensor([generated], device=ids.device)
    margins, scales = greedy_margins(model, {"input_ids": ids}, texts, **cache_arguments)
    return len(off_greedy_positions(margins, scales, model.dtype))


# The one-sided significance below which `paired_departure_test` finds that a method departs more often than the
# batched baseline: the half-precision promise fails only then.
DEPARTURE_SIGNIFICANCE = 0.05
DEPARTURE_BASELINE = "batched_greedy"


def paired_departure_test(result: dict, method: str, baseline: str = DEPARTURE_BASELINE) -> dict:
    """
    Whether `method` departs from plain greedy more often than `baseline` on the same prompts: an exact one-sided
    McNemar (sign) test. Prompts where both or neither departed say nothing about which departs more; on the others,
    if `method` departed no more often than `baseline`, each is at most a coin flip for `method`, so the p-value is
    the chance that a fair coin gives at least as many prompts to `method` as it got.

    Args:
        result (`dict`): what `run_departures` returned (its per-prompt `departures` of both methods).
        method (`str`): the method tested.
        baseline (`str`, *optional*): the method it is compared with, by default the batched baseline.

    Returns:
        `dict` with `only_method` and `only_baseline` (prompts that only one of them departed on) and `p_value`.
    """
    only_method = only_baseline = 0
    for entry in result["prompts"]:
        method_departed = entry["departures"][method] is not None
        baseline_departed = entry["departures"][baseline] is not None
        only_method += method_departed and not baseline_departed
        only_baseline += baseline_departed and not method_departed
    discordant = only_method + only_baseline
    tail = sum(math.comb(discordant, count) for count in range(only_method, discordant + 1))
    return {"only_method": only_method, "only_baseline": only_baseline, "p_value": tail / 2**discordant}


def summarize_departures(result: dict) -> list[dict]:
    """
    Per method: prompts departed, the median and earliest first departure, plain greedy's median top-2 logit margin
    at the departures (beside its median over every position), how many departing tokens were the first of their
    lookahead step, (lookahead) the tokens per forward pass, prefill included, and where the batched baseline ran
    too, `paired_departure_test` against it.
    """
    everywhere = [margin for entry in result["prompts"] for margin in entry.get("margins", [])]
    rows = []
    for method in result.get("methods", DEPARTURE_METHODS):
        positions = [entry["departures"][method] for entry in result["prompts"]]
        departed = [position for position in positions if position is not None]
        at = [entry["at_departure"][method] for entry in result["prompts"] if method in entry.get("at_departure", {})]
        offsets = [detail["step_offset"] for detail in at if detail["step_offset"] is not None]
        counts = [entry["forwards"][method] for entry in result["prompts"] if method in entry.get("forwards", {})]
        passes = sum(count[1] for count in counts)
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
                "off_greedy_tokens": sum(entry.get("off_greedy", {}).get(method, 0) for entry in result["prompts"]),
                "tokens_per_forward": round(sum(count[0] for count in counts) / passes, 2) if passes else None,
            }
        )
        if method != DEPARTURE_BASELINE and DEPARTURE_BASELINE in result.get("methods", DEPARTURE_METHODS):
            rows[-1]["versus_batched"] = paired_departure_test(result, method)
    return rows


def format_paired_test(row: dict) -> str:
    """`paired_departure_test`'s counts and p-value in a summary row, `-` where it did not run."""
    test = row.get("versus_batched")
    if test is None:
        return "-"
    return f"{test['only_method']} / {test['only_baseline']} (p={test['p_value']:.2g})"
