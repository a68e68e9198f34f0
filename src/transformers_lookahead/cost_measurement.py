"""
Measuring a model's step-cost table (`StepCostModel`) by running steps through the step path (`StepLayout`,
`StepForward`), and keeping it between processes (see `default_cost_dir`).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache, EncoderDecoderCache, PreTrainedModel
from transformers.utils import logging

from .chain_steps import ChainLayout, committer_for
from .compatibility import attention_implementation
from .cost_model import COST_GRID, StepCostModel
from .step_forward import StepForward, max_positions
from .step_layout import StepInputs, StepLayout
from .token_tree import TokenTree

logger = logging.get_logger(__name__)

_CONTEXT = 128
_ROUNDS = 5
# Untimed passes first: the first calls allocate and pick kernels.
_WARM_UP = 3
# How `measure_step_costs` measures; tables kept by an earlier method (noisier) are measured again.
MEASUREMENT_METHOD = "interleaved-rounds-monotone"


# Environment variable naming where measured cost tables are kept: a directory, or "off" to keep them in memory only.
COST_DIR_VARIABLE = "TRANSFORMERS_LOOKAHEAD_COST_DIR"
_OFF = ("off", "0", "false", "no", "")


def default_cost_dir() -> Path | None:
    """
    Where measured cost tables are kept unless a `LookaheadState` says otherwise: `$TRANSFORMERS_LOOKAHEAD_COST_DIR`
    if set (`None` when it is "off"), else `lookahead/step_costs` under the Hugging Face cache (`$HF_HOME`, by
    default `~/.cache/huggingface`).
    """
    configured = os.environ.get(COST_DIR_VARIABLE)
    if configured is not None:
        return None if configured.strip().lower() in _OFF else Path(configured).expanduser()
    cache_home = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    hf_home = Path(os.environ.get("HF_HOME", cache_home / "huggingface")).expanduser()
    return hf_home / "lookahead" / "step_costs"


def load_or_measure(
    model: PreTrainedModel, cost_dir: str | os.PathLike | None = None, encoder_outputs: Any = None, chain: bool = False
) -> StepCostModel:
    """
    The cost table of `model` on its device, dtype and thread count: read from `cost_dir`, or measured (a few
    dozen forward passes) and written there (`None`: no file). An unreadable, corrupt or foreign file is measured
    again; a directory that cannot be written only means the next process measures again (a warning says so).
    Encoder-decoder models' decoders attend to `encoder_outputs`, of one input, while timed; a model that decodes
    in chain steps (`chain`) is timed in chain steps.
    """
    path = None if cost_dir is None else Path(cost_dir) / f"step-cost-{model_key(model)}.json"
    if path is not None:
        try:
            kept = json.loads(path.read_text())
            if kept.get("method") == MEASUREMENT_METHOD:
                return StepCostModel({int(k): float(v) for k, v in kept["relative_costs"].items()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # Missing, corrupt or foreign (or measured the old way): measured again and replaced below.
    # Seconds of forward passes before the first token (5 s for a 135M model on 2 CPU cores): said, not silent.
    logger.warning(
        f'Lookahead decoding ("auto"): measuring the cost of forward passes of 1 to {max(COST_GRID)} tokens for '
        f"this model, dtype, device and thread count ({1 + _WARM_UP + _ROUNDS * len(COST_GRID)} forward passes, "
        f"once); the table is kept {f'in {path}' if path is not None else 'in memory only'}. To measure ahead of "
        "the first call (a server: before it starts), run `LookaheadState().cost_model(model)` once."
    )
    costs = measure_step_costs(model, encoder_outputs=encoder_outputs, chain=chain)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.part")
            partial.write_text(json.dumps({"method": MEASUREMENT_METHOD, "relative_costs": costs}, indent=1))
            partial.replace(path)
        except OSError as error:
            logger.warning(
                f"Could not keep the lookahead step-cost table in {cost_dir} ({error}); it is kept in memory only. "
                f"Set {COST_DIR_VARIABLE} to a writable directory, or to 'off' to silence this."
            )
    return StepCostModel(costs)


def model_key(model: PreTrainedModel) -> str:
    """What a cost table depends on: the model, its dtype and device, the thread count and the attention backend."""
    parts = [
        type(model).__name__,
        str(model.config.name_or_path or ""),
        str(sum(p.numel() for p in model.parameters())),
        str(model.dtype),
        str(model.device.type),
        torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else "",
        str(torch.get_num_threads()),
        attention_implementation(model) or "",
    ]
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]


@torch.no_grad()
def measure_step_costs(
    model: PreTrainedModel, grid: tuple[int, ...] = COST_GRID, encoder_outputs: Any = None, chain: bool = False
) -> dict[int, float]:
    """
    Times forward passes of every step length over a `_CONTEXT`-token cache, with a custom 4D mask (`chain`: as a
    chain step, `ChainLayout`) and every row's logits (as a lookahead step has), in `_ROUNDS` rounds of one pass per
    length; returns, per length, the median over rounds of its time over the one-token time of the same round, made
    non-decreasing in the length. `grid` starts at 1; `encoder_outputs` as for `load_or_measure`.
    """
    device = model.device
    vocab = model.config.get_text_config(decoder=True).vocab_size
    context = _CONTEXT
    limit = max_positions(model)
    if limit is not None and context + max(grid) > limit:
        # A short position table: time the steps that fit after a shorter context, extrapolate the longer ones.
        grid = tuple(length for length in grid if length <= limit // 2)
        context = min(context, limit - max(grid))
    generator = torch.Generator().manual_seed(0)
    host_ids = torch.randint(vocab, (1, context + max(grid)), generator=generator, device="cpu")
    ids = host_ids.to(device)
    cache = DynamicCache(config=model.config)
    if model.config.is_encoder_decoder:
        cache = EncoderDecoderCache(cache, DynamicCache(config=model.config))
    forward = StepForward(model, cache, encoder_outputs)
    positions = torch.arange(context, device=device)[None]
    forward(StepInputs(ids[:, :context], positions, None, torch.tensor([context - 1], device=device), [None]))
    # Every timed step is then undone, recurrent states included (kept before the timer starts).
    committer = committer_for(forward.decoder_cache, owner=type(model).__name__)
    committer.start()
    layout = (ChainLayout if chain else StepLayout).for_model(model, forward.decoder_cache, 1, 1)

    def timed(length: int) -> float:
        step = layout.build(
            forward.decoder_cache,
            [layout.row(host_ids[0, context : context + length].tolist(), context + length - 1, None, TokenTree())],
            fixed_length=length,
        )
        committer.before_step(feeds_guesses=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        forward(step).argmax(-1).tolist()
        elapsed = time.perf_counter() - start
        committer.undo(length)
        return elapsed

    for length in grid[:_WARM_UP]:
        timed(length)
    # Every round times each length once, and each length is judged against the one-token step of its own round:
    # load that comes and goes then shifts both alike instead of one length's repeats.
    rounds = [{length: timed(length) for length in grid} for _ in range(_ROUNDS)]
    # No step is cheaper than the one-token step, which stays at exactly 1 (a tiny model's 2-token step can time
    # below it, and pooling the two would move it).
    ratios = [max(1.0, statistics.median(times[length] / times[grid[0]] for times in rounds)) for length in grid]
    return dict(zip(grid, _non_decreasing(ratios)))


def _non_decreasing(values: list[float]) -> list[float]:
    """
    The closest non-decreasing sequence (least squares, pool-adjacent-violators): a longer step never costs less, and
    a dip in a measured curve is noise that would make `"auto"` prefer one length over its neighbours.
    """
    blocks: list[tuple[float, int]] = []  # (mean, count)
    for value in values:
        blocks.append((value, 1))
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (mean, count), (last_mean, last_count) = blocks.pop(), blocks.pop()
            blocks.append(((last_mean * last_count + mean * count) / (last_count + count), last_count + count))
    return [mean for mean, count in blocks for _ in range(count)]
