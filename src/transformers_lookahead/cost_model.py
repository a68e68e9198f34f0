"""
What a step of T tokens costs: a model's measured table (`StepCostModel`, measured by `cost_measurement`), what the
durations of the steps that ran teach about it (`StepPricing`), and a continuous-batching engine's own fit
(`EngineStepCost`). Nothing here runs the model.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np

from .auto_tuning import AUTO_TUNING, AutoTuning

# Step lengths the cost is measured at; lengths in between are interpolated.
COST_GRID = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64)


class StepCostModel:
    """
    Forward-pass time as a function of the step length T, relative to a one-token step: about flat on a GPU, growing
    (not even monotonically: BLAS kernels switch blocking at some sizes) on a CPU, so the adaptive policy reads the
    measured table instead of assuming either regime.

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
        """The cost of a step of T tokens per row of `batch_size` rows, relative to a one-token step of that batch."""
        if batch_size == 1:
            return self
        base = self(batch_size)
        return StepCostModel({length: self(batch_size * length) / base for length in self.lengths})


class StepPricing:
    """
    What a step of T tokens costs, in one-token steps of the batch, as the adaptive policy weighs it against the
    tokens it expects: the table's excess over one token, rescaled by a running factor learnt from measured step
    durations (a table drifts with the load and the context length), times a factor per band of step lengths
    (`length.bit_length()`) for what no bounded rescaling explains (a near-flat table where steps are not, as on a
    GPU driven by a slow host).

    Args:
        table (`StepCostModel`): the model's table, for a step of the batch as it is now (`use_table`).
        timed (`bool`): whether the loop reports every step's duration (`observe`). Durations are judged against a
            one-token step's: until one was timed, `wants_reference` asks the policy for one.
        tuning (`AutoTuning`): how fast and how far durations move the price.
    """

    def __init__(self, table: StepCostModel, timed: bool = False, tuning: AutoTuning = AUTO_TUNING):
        self.table = table
        self.timed = timed
        self.tuning = tuning
        self.excess_scale = 1.0
        self.underpricing: dict[int, float] = {}
        self._single_token_seconds: float | None = None

    def __call__(self, length: int) -> float:
        """The expected cost of a step of `length` tokens, in one-token steps."""
        scaled = 1.0 + (self.table(length) - 1.0) * self.excess_scale
        return scaled if length == 1 else scaled * self.underpricing.get(length.bit_length(), 1.0)

    def use_table(self, table: StepCostModel) -> None:
        """Prices with `table` from now on: the batch changed size, and with it what each token per row costs."""
        self.table = table

    @property
    def wants_reference(self) -> bool:
        """Whether durations are reported but no one-token step was timed yet."""
        return self.timed and self._single_token_seconds is None

    def start_from(self, excess_scale: float, underpricing: tuple[tuple[int, float], ...]) -> None:
        """Starts from what an earlier call learnt (not the one-token time: it grows with the context)."""
        self.excess_scale, self.underpricing = excess_scale, dict(underpricing)

    def learnt(self) -> tuple[float, tuple[tuple[int, float], ...]]:
        """`(excess_scale, underpricing)`, for `start_from` in a later call."""
        return self.excess_scale, tuple(sorted(self.underpricing.items()))

    def observe(self, length: int, seconds: float) -> None:
        """Learns from the measured duration of a step of `length` tokens: from its forward pass to its verdict."""
        smoothing = self.tuning.duration_smoothing
        if length == 1:
            previous = self._single_token_seconds
            self._single_token_seconds = seconds if previous is None else previous + smoothing * (seconds - previous)
            return
        if self._single_token_seconds is None:
            return
        measured = seconds / self._single_token_seconds
        excess = self.table(length) - 1.0
        explained = 1.0
        if excess > 0.0:
            low, high = self.tuning.excess_scale_range
            factor = min(max((measured - 1.0) / excess, low), high)
            self.excess_scale += smoothing * (factor - self.excess_scale)
            explained = 1.0 + excess * factor
        # A flat table (no excess to scale) or one far too low: without this, steps priced at about one token that
        # cost two ran "auto" at half plain greedy's speed (a flat table on a CPU, measured).
        low, high = self.tuning.underpricing_range
        band = length.bit_length()
        previous = self.underpricing.get(band, 1.0)
        self.underpricing[band] = previous + smoothing * (min(max(measured / explained, low), high) - previous)


class EngineStepCost:
    """
    What a step of a continuous-batching engine costs, learnt from the engine's own steps. Unlike one sequence's pass
    over a contiguous cache (the table), a paged pass gathers every request's pages and masks all query tokens
    against all keys, and around it the host lays out the batch and verifies and moves each request's entries. A
    whole step is fitted as

        seconds = a + b * table(Q) + c * Q + d * K + e * Q * K + f * V

    (Q query and K key tokens in the pass, V requests verifying candidates; coefficients clipped at zero) by least
    squares on relative errors (a prefill chunk would otherwise outweigh the decoding steps priced) over the latest
    `steps_kept` steps, so that the fit follows the load.

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
        Records one step of the engine: its forward pass's query and key (cached and new) tokens, every request's
        together, the requests whose block verified candidates, and its time from layout to the last cache move.
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


def padded_step_cost(step_cost: Callable[[int], float], requests: int, interval: int) -> Callable[[int], float]:
    """
    The cost of a step of T tokens for each of `requests` requests in an engine that pads a step's query tokens to a
    multiple of `interval`: that of the longest length whose padded step is as long.
    """

    def cost(length: int) -> float:
        # The engine pads the step's query tokens to the next multiple of `interval` (`padded_length`).
        return step_cost(max(length, -(-requests * length // interval) * interval // requests))

    return cost


def padded_table(table: StepCostModel, requests: int, interval: int, longest: int) -> StepCostModel:
    """
    `padded_step_cost` of a table as a table up to `longest` tokens per request, relative to a one-token step: a
    step function, kept exact by its two lengths at each edge between paddings.
    """
    cost = padded_step_cost(table, requests, interval)
    longest = max(2, longest)
    edges = (step * interval // requests for step in range(1, longest * requests // interval + 2))
    lengths = {1, longest} | {length for edge in edges for length in (edge, edge + 1) if 1 < length < longest}
    return StepCostModel({length: cost(length) / cost(1) for length in lengths})
