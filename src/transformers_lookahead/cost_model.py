"""What a forward pass of T tokens costs on this model and device, measured once and kept (see `default_cost_dir`)."""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache, EncoderDecoderCache, PreTrainedModel
from transformers.utils import logging

from .compatibility import attention_implementation
from .step_forward import StepForward, max_positions
from .step_layout import StepInputs, StepLayout
from .token_tree import TokenTree

logger = logging.get_logger(__name__)

# Step lengths the cost is measured at; lengths in between are interpolated.
COST_GRID = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64)
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


class StepCostModel:
    """
    Forward-pass time as a function of the step length T, relative to a one-token step.

    On a GPU a step of 64 tokens costs about as much as one token; on a CPU the cost grows with T, and not even
    monotonically (BLAS kernels switch blocking at some sizes: on a 2-core x86 machine 6 tokens were measured cheaper
    than 3). Lookahead decoding pays only when the tokens a step accepts outgrow what the step costs, so the adaptive
    policy reads this table instead of assuming either regime.

    Args:
        relative_costs (`dict[int, float]`): cost of a step of T tokens divided by the cost of one token.
    """

    def __init__(self, relative_costs: dict[int, float]):
        self.lengths = sorted(relative_costs)
        self.costs = [relative_costs[t] for t in self.lengths]

    def __call__(self, length: int) -> float:
        """The cost of a step of `length` tokens, in one-token steps (linear between measured lengths)."""
        lengths, costs = self.lengths, self.costs
        if length <= lengths[0]:
            return costs[0]
        for i in range(1, len(lengths)):
            if length <= lengths[i]:
                frac = (length - lengths[i - 1]) / (lengths[i] - lengths[i - 1])
                return costs[i - 1] + frac * (costs[i] - costs[i - 1])
        slope = (costs[-1] - costs[-2]) / (lengths[-1] - lengths[-2])
        return costs[-1] + slope * (length - lengths[-1])

    def for_batch(self, batch_size: int) -> StepCostModel:
        """
        The cost of a step of T tokens per row for a batch of `batch_size` rows, relative to a one-token step of that
        batch: a batch step feeds `batch_size x T` tokens, so on a CPU each extra token per row costs more the larger
        the batch.
        """
        if batch_size == 1:
            return self
        base = self(batch_size)
        return StepCostModel({length: self(batch_size * length) / base for length in self.lengths})

    @classmethod
    def for_model(
        cls, model: PreTrainedModel, cost_dir: str | os.PathLike | None = None, encoder_outputs: Any = None
    ) -> StepCostModel:
        """
        The cost table of `model` on its device, dtype and thread count: read from `cost_dir`, or measured (a few
        dozen forward passes) and written there. An unreadable, corrupt or foreign file is measured again; a
        directory that cannot be written only means the next process measures again (a warning says so).

        Args:
            model (`PreTrainedModel`): the model.
            cost_dir (`str` or `os.PathLike`, *optional*): where tables are kept; `None` measures without reading or
                writing any file.
            encoder_outputs (`ModelOutput`, *optional*): for encoder-decoder models, encoder outputs of one input
                (batch size 1) for the decoder to attend to while it is timed.
        """
        path = None if cost_dir is None else Path(cost_dir) / f"step-cost-{model_key(model)}.json"
        if path is not None:
            try:
                kept = json.loads(path.read_text())
                if kept.get("method") == MEASUREMENT_METHOD:
                    return cls({int(k): float(v) for k, v in kept["relative_costs"].items()})
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                pass  # Missing, corrupt or foreign (or measured the old way): measured again and replaced below.
        # Seconds of forward passes before the first token (5 s for a 135M model on 2 CPU cores): said, not silent.
        logger.warning(
            f'Lookahead decoding ("auto"): measuring the cost of forward passes of 1 to {max(COST_GRID)} tokens for '
            f"this model, dtype, device and thread count ({1 + _WARM_UP + _ROUNDS * len(COST_GRID)} forward passes, "
            f"once); the table is kept {f'in {path}' if path is not None else 'in memory only'}. To measure ahead of "
            "the first call (a server: before it starts), run `LookaheadState().cost_model(model)` once."
        )
        costs = measure_step_costs(model, encoder_outputs=encoder_outputs)
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
        return cls(costs)


class EngineStepCost:
    """
    What a step of a continuous-batching engine costs, learnt from the engine's own steps.

    The `StepCostModel` table times one sequence's passes over a contiguous cache. A pass of Transformers' paged
    engine also gathers every scheduled request's pages and masks all of the batch's query tokens against all of its
    keys, so its time grows with the keys and with queries x keys as well, and more steeply with load than the table
    says. Around the pass the host lays out the batch and its mask, then verifies each request and moves its accepted
    entries into place: work that a one-token step of plain continuous batching does not do, and that grows with the
    requests a step verifies. A whole step (forward pass and host work) is fitted as

        seconds = a + b * table(Q) + c * Q + d * K + e * Q * K + f * V

    (Q query tokens and K key tokens in the pass, V requests verifying candidates; every coefficient clipped at zero)
    by least squares over the latest `steps_kept` steps, so the fit follows the load as requests come and go. The fit
    minimises relative errors: what it prices are decoding steps of tens of query tokens, and a prefill chunk of a
    thousand, taking several times longer, would otherwise decide the fit by its absolute error alone.

    Args:
        table (`StepCostModel`): the model's step-cost table.
        steps_kept (`int`): how many of the latest steps the fit uses.
        steps_needed (`int`): the steps seen before `for_batch` answers (the engine prices with the table until
            then).
        history (`tuple`, *optional*): the `history()` of an earlier engine of the same model, so that a new engine
            prices its first steps with that engine's fit rather than with the table.
    """

    def __init__(
        self, table: StepCostModel, steps_kept: int, steps_needed: int, history: tuple[tuple[float, ...], ...] = ()
    ):
        if not 1 <= steps_needed <= steps_kept:
            raise ValueError(f"Need 1 <= steps_needed <= steps_kept, got {steps_needed} and {steps_kept}.")
        self.table = table
        self.steps_needed = steps_needed
        self._steps: deque[tuple[float, ...]] = deque(history, maxlen=steps_kept)
        self._coefficients: list[float] | None = None

    def history(self) -> tuple[tuple[float, ...], ...]:
        """The steps the fit uses now (immutable), for a later engine of the same model."""
        return tuple(self._steps)

    def _features(self, queries: int, keys: int, verified: int) -> tuple[float, ...]:
        return (1.0, self.table(queries), float(queries), float(keys), float(queries * keys), float(verified))

    def observe(self, queries: int, keys: int, verified: int, seconds: float) -> None:
        """
        Records one step of the engine.

        Args:
            queries (`int`): the query tokens of its forward pass, every request's together.
            keys (`int`): the key tokens of its forward pass (cached and new), every request's together.
            verified (`int`): the requests whose block verified candidates.
            seconds (`float`): how long the step took, from laying out its batch to the last cache move.
        """
        if seconds > 0.0:  # the fit divides by it
            self._steps.append((*self._features(queries, keys, verified), seconds))
            self._coefficients = None

    def seconds(self, queries: int, keys: int, verified: int = 0) -> float | None:
        """
        The fitted time of a step of `queries` query tokens over `keys` keys that verifies `verified` requests;
        `None` before `steps_needed` steps were seen.
        """
        if len(self._steps) < self.steps_needed:
            return None
        if self._coefficients is None:
            self._coefficients = _non_negative_fit(self._steps)
        return sum(c * f for c, f in zip(self._coefficients, self._features(queries, keys, verified)))

    def for_batch(self, batch_size: int, cached_keys: int) -> Callable[[int], float] | None:
        """
        The cost of a step of T tokens for each of `batch_size` decoding requests whose caches hold `cached_keys`
        entries together, relative to a one-token step of them (which verifies nothing); `None` until `steps_needed`
        steps were seen.
        """
        base = self.seconds(batch_size, cached_keys + batch_size)
        if base is None or base <= 0.0:
            return None

        def relative(length: int) -> float:
            verified = batch_size if length > 1 else 0
            return self.seconds(batch_size * length, cached_keys + batch_size * length, verified) / base

        return relative


def _non_negative_fit(rows: deque[tuple[float, ...]]) -> list[float]:
    """
    Least squares of the last column (positive) on the others, on relative errors, with no negative coefficient:
    the most negative one is dropped and the rest fitted again (a time is never made smaller by more tokens).

    It runs once per engine step, so in numpy: `torch.linalg.lstsq` took about 0.8 ms for 64 rows here, numpy's
    (the same LAPACK driver, coefficients equal to 1e-14) 0.05 ms.
    """
    data = np.asarray(rows, dtype=np.float64)
    # Each row divided by its time: the residuals are then relative errors.
    features, target = data[:, :-1] / data[:, -1:], np.ones(data.shape[0])
    # Columns range from 1 to queries x keys (~1e5): scaled alike, none reads as rank-deficient.
    scale = np.maximum(np.abs(features).max(axis=0), 1e-12)
    scaled = features / scale
    active = list(range(features.shape[1]))
    solution = np.zeros(0)
    while active:
        solution = np.linalg.lstsq(scaled[:, active], target, rcond=None)[0]
        if bool((solution >= 0).all()):
            break
        del active[int(solution.argmin())]
    coefficients = [0.0] * features.shape[1]
    for column, value in zip(active, solution.tolist()):
        coefficients[column] = value / float(scale[column])
    return coefficients


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
    model: PreTrainedModel, grid: tuple[int, ...] = COST_GRID, encoder_outputs: Any = None
) -> dict[int, float]:
    """
    Times forward passes of every step length over a `_CONTEXT`-token cache, with a custom 4D mask and every row's
    logits (as a lookahead step has), in `_ROUNDS` rounds of one pass per length; returns, per length, the median
    over rounds of its time over the one-token time of the same round, made non-decreasing in the length.

    Args:
        model (`PreTrainedModel`): the model.
        grid (`tuple[int]`): the step lengths to measure, 1 first.
        encoder_outputs (`ModelOutput`, *optional*): for encoder-decoder models, what the decoder attends to.
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
    # Sliding layers can then be cropped back after each timed step.
    cache.activate_past_recording()
    layout = StepLayout.for_model(model, forward.decoder_cache, 1, 1)

    def timed(length: int) -> float:
        step = layout.build(
            forward.decoder_cache,
            [layout.row(host_ids[0, context : context + length].tolist(), context + length - 1, None, TokenTree())],
            fixed_length=length,
        )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        forward(step).argmax(-1).tolist()
        elapsed = time.perf_counter() - start
        cache.crop(-length)
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
    blocks: list[list[float]] = []  # [mean, count]
    for value in values:
        blocks.append([value, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean, count = blocks.pop()
            blocks[-1] = [
                (blocks[-1][0] * blocks[-1][1] + mean * count) / (blocks[-1][1] + count),
                blocks[-1][1] + count,
            ]
    return [mean for mean, count in blocks for _ in range(count)]
