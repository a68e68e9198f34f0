"""What lookahead decoding keeps about a model between `generate` calls."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .cost_model import StepCostModel, default_cost_dir, model_key

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from .step_policy import PolicyEstimates

# `cost_dir` when the caller did not choose: `default_cost_dir()`, read when the state is created.
_DEFAULT = object()


class LookaheadState:
    """
    What `"auto"` learns about one model across `generate` calls, held by the user's model (`enable_lookahead` gives
    it one as `model.lookahead_state`) rather than by the package.

    - The step-cost table (`StepCostModel`): measured once per device, dtype and thread count, kept in memory and,
      unless `cost_dir` is `None`, in a JSON file so the next process reads it instead of measuring again.
    - The acceptance estimates of the last greedy `"auto"` call (`PolicyEstimates`, one per policy shape): the next
      call starts from them instead of the priors. Short generations (a transcript, a chat turn) otherwise spend
      most of their steps relearning that, say, copied continuations rarely match. Sampled calls neither read nor
      write them: the candidates decide how many random numbers verification draws, so a seeded sampled call must
      not depend on the calls before it.

    Safe to share between threads calling `generate` on one model at once: each call works on its own copies and
    reads or writes the state under a lock. A copied or pickled state starts empty.

    Args:
        cost_dir (`str` or `os.PathLike` or `None`, *optional*):
            Where cost tables are read and written. Defaults to `default_cost_dir()`: `$TRANSFORMERS_LOOKAHEAD_COST_DIR`
            if set ("off" for `None`), else `lookahead/step_costs` under the Hugging Face cache. `None` keeps tables
            in memory only (each new state measures once).
    """

    def __init__(self, cost_dir: str | os.PathLike | None | Any = _DEFAULT):
        self.cost_dir = default_cost_dir() if cost_dir is _DEFAULT else (None if cost_dir is None else Path(cost_dir))
        self._lock = threading.Lock()
        self._costs: dict[str, StepCostModel] = {}
        self._estimates: dict[tuple, PolicyEstimates] = {}

    def cost_model(self, model: PreTrainedModel, encoder_outputs: Any = None) -> StepCostModel:
        """
        The step-cost table of `model` as it runs now (device, dtype, threads), measured at most once per state.

        Args:
            model (`PreTrainedModel`): the model this state belongs to.
            encoder_outputs (`ModelOutput`, *optional*): for encoder-decoder models, encoder outputs of one input.
        """
        key = model_key(model)
        # Held while measuring: a second thread would otherwise time its forward passes against the first's.
        with self._lock:
            if key not in self._costs:
                self._costs[key] = StepCostModel.for_model(model, self.cost_dir, encoder_outputs=encoder_outputs)
            return self._costs[key]

    def recall(self, shape: tuple) -> PolicyEstimates | None:
        """The estimates the last greedy `"auto"` call left for a policy of this `shape`, if any."""
        with self._lock:
            return self._estimates.get(shape)

    def remember(self, shape: tuple, estimates: PolicyEstimates) -> None:
        """Keeps `estimates` (immutable) for the next call with a policy of this `shape`."""
        with self._lock:
            self._estimates[shape] = estimates

    def __deepcopy__(self, memo: dict) -> LookaheadState:
        return LookaheadState(self.cost_dir)

    def __reduce__(self):
        return (LookaheadState, (self.cost_dir,))
