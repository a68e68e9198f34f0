"""What lookahead decoding keeps about a model between `generate` calls."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .auto_tuning import AUTO_TUNING, AutoTuning
from .configuration_lookahead import DEFAULT_MEMORY_NAMESPACE, DEFAULT_MEMORY_SIZE, NAMESPACE_PATTERN
from .cost_measurement import default_cost_dir, load_or_measure, model_key
from .cost_model import StepCostModel
from .step_check import StepCheck
from .suffix_memory import SuffixMemory, vocabulary_key

if TYPE_CHECKING:
    from collections.abc import Callable

    from transformers import PreTrainedModel

    from .adaptive_policy import PolicyEstimates
    from .step_layout import RowStep
    from .step_policy import StepChoice
    from .verification import Verdict

# Where suffix memories are kept between processes when the user did not choose (unset: nowhere).
MEMORY_DIR_VARIABLE = "TRANSFORMERS_LOOKAHEAD_MEMORY_DIR"

# `cost_dir` when the caller did not choose: `default_cost_dir()`, read when the state is created.
_DEFAULT = object()


class LookaheadState:
    """
    What `"auto"` learns about one model across `generate` calls, held by the user's model (`enable_lookahead` gives
    it one as `model.lookahead_state`) rather than by the package.

    - The step-cost table (`StepCostModel`): measured once per device, dtype and thread count, kept in memory and,
      unless `cost_dir` is `None`, in a JSON file so the next process reads it instead of measuring again.
    - The acceptance estimates of the last `"auto"` call (`PolicyEstimates`, one per policy shape, greedy and sampled
      apart): the next call starts from them instead of the priors. Short generations (a transcript, a chat turn)
      otherwise spend most of their steps relearning that, say, copied continuations rarely match.
    - The steps a continuous-batching engine last timed (`EngineStepCost.history`), per model key: the next engine
      (each `generate_batch` call starts one) prices its first steps with the fit they give, not with the table, which
      times passes of another kind (one sequence over a contiguous cache).
    - The suffix memories (`SuffixMemory`, one per `lookahead_memory_namespace`): the prompts and outputs of earlier
      calls, whose continuations later calls verify. With `memory_dir` set, a memory is read from its file when a
      call first uses it and written back after every call that added to it, so a restarted server starts warm.

    None of it changes what a call generates: greedy output is plain greedy's, and sampled text depends only on the
    seed (see `PositionNoise`).

    Safe to share between threads calling `generate` on one model at once: each call works on its own copies of the
    estimates and reads or writes the state under locks. A copied or pickled state starts empty.

    Args:
        cost_dir (`str` or `os.PathLike` or `None`, *optional*):
            Where cost tables are read and written. Defaults to `default_cost_dir()`: `$TRANSFORMERS_LOOKAHEAD_COST_DIR`
            if set ("off" for `None`), else `lookahead/step_costs` under the Hugging Face cache. `None` keeps tables
            in memory only (each new state measures once).
        memory_dir (`str` or `os.PathLike` or `None`, *optional*):
            Where suffix memories are read and written, one file per vocabulary and namespace. Defaults to
            `$TRANSFORMERS_LOOKAHEAD_MEMORY_DIR` if set, else `None`: memories live in this state only.
        step_costs (`StepCostModel`, *optional*):
            A cost table to price every step by, instead of measuring one: the table of another device, to see what
            `"auto"` would do there, or a fixed table for steps that do not depend on this machine's timings.
        follow_durations (`bool`, *optional*, defaults to `True`):
            Whether `"auto"` also learns from the measured durations of its steps what its table under-prices (in
            continuous batching: prices steps by the engine's timed steps, `EngineStepCost`). Off, its steps depend
            only on the table and the text.
        tuning (`AutoTuning`, *optional*):
            The constants `"auto"` decides with (defaults to `AUTO_TUNING`; what `lookahead_ngram` and
            `lookahead_guess` `"auto"` resolve to is read with the settings, from `AUTO_TUNING`).
        step_observer (`Callable`, *optional*):
            Called after every sequence's step with what its policy chose (`StepChoice`), its part of the step
            (`RowStep`) and the `Verdict`: how tools record steps.
    """

    def __init__(
        self,
        cost_dir: str | os.PathLike | None | Any = _DEFAULT,
        memory_dir: str | os.PathLike | None | Any = _DEFAULT,
        step_costs: StepCostModel | None = None,
        follow_durations: bool = True,
        tuning: AutoTuning = AUTO_TUNING,
        step_observer: Callable[[StepChoice, RowStep, Verdict], None] | None = None,
    ):
        if not isinstance(follow_durations, bool):
            raise ValueError(f"`follow_durations` must be True or False, got {follow_durations!r}.")
        if step_costs is not None and not isinstance(step_costs, StepCostModel):
            raise ValueError(f"`step_costs` must be a `StepCostModel` or None, got {type(step_costs).__name__}.")
        if not isinstance(tuning, AutoTuning):
            raise ValueError(f"`tuning` must be an `AutoTuning`, got {type(tuning).__name__}.")
        self.step_costs = step_costs
        self.follow_durations = follow_durations
        self.tuning = tuning
        self.step_observer = step_observer
        self.cost_dir = default_cost_dir() if cost_dir is _DEFAULT else (None if cost_dir is None else Path(cost_dir))
        if memory_dir is _DEFAULT:
            memory_dir = os.environ.get(MEMORY_DIR_VARIABLE) or None
        self.memory_dir = None if memory_dir is None else Path(memory_dir)
        self._lock = threading.Lock()
        self._costs: dict[str, StepCostModel] = {}
        self._estimates: dict[tuple, PolicyEstimates] = {}
        self._engine_steps: dict[str, tuple[tuple[float, ...], ...]] = {}
        self._memories: dict[str, SuffixMemory] = {}
        self.step_check = StepCheck()

    def cost_model(self, model: PreTrainedModel, encoder_outputs: Any = None, chain: bool = False) -> StepCostModel:
        """
        The step-cost table of `model` as it runs now (device, dtype, threads), measured at most once per state.

        Args:
            model (`PreTrainedModel`): the model this state belongs to.
            encoder_outputs (`ModelOutput`, *optional*): for encoder-decoder models, encoder outputs of one input.
            chain (`bool`, *optional*): the model decodes in chain steps (`ChainLayout`), and is timed in them.
        """
        if self.step_costs is not None:
            return self.step_costs
        key = model_key(model)
        # Held while measuring: a second thread would otherwise time its forward passes against the first's.
        with self._lock:
            if key not in self._costs:
                self._costs[key] = load_or_measure(model, self.cost_dir, encoder_outputs=encoder_outputs, chain=chain)
            return self._costs[key]

    def recall(self, shape: tuple) -> PolicyEstimates | None:
        """The estimates the last greedy `"auto"` call left for a policy of this `shape`, if any."""
        with self._lock:
            return self._estimates.get(shape)

    def remember(self, shape: tuple, estimates: PolicyEstimates) -> None:
        """Keeps `estimates` (immutable) for the next call with a policy of this `shape`."""
        with self._lock:
            self._estimates[shape] = estimates

    def recall_engine_steps(self, key: str) -> tuple[tuple[float, ...], ...]:
        """The steps the last continuous-batching engine of a model with this `model_key` timed (empty if none)."""
        with self._lock:
            return self._engine_steps.get(key, ())

    def remember_engine_steps(self, key: str, steps: tuple[tuple[float, ...], ...]) -> None:
        """Keeps an engine's timed steps (`EngineStepCost.history`, immutable) for the next engine."""
        with self._lock:
            self._engine_steps[key] = steps

    def memory(
        self,
        model: PreTrainedModel,
        namespace: str = DEFAULT_MEMORY_NAMESPACE,
        max_tokens: int = DEFAULT_MEMORY_SIZE,
    ) -> SuffixMemory:
        """
        The suffix memory of `namespace` (`lookahead_memory_namespace`), holding at most `max_tokens` tokens
        (`lookahead_memory_size`) from now on: created empty, or read from `memory_dir` (named by `model`'s
        vocabulary), on first use.

        Raises:
            `ValueError` if the memory's file in `memory_dir` is not a memory of this vocabulary; the file is left as
            it is.
        """
        with self._lock:
            memory = self._memories.get(namespace)
            if memory is None:
                memory = SuffixMemory(vocabulary_key(model), max_tokens)
                path = self._memory_file(memory.vocabulary, namespace)
                if path is not None and path.exists():
                    memory.load(path)
                self._memories[namespace] = memory
        if memory.max_tokens != max_tokens:
            memory.resize(max_tokens)
        return memory

    def add_to_memory(self, namespace: str, documents: list[list[int]]) -> None:
        """
        Adds the token sequences of a finished call to the memory of `namespace` (which `memory` created), and writes
        the memory to `memory_dir` if there is one.
        """
        with self._lock:
            memory = self._memories[namespace]
        memory.add(documents)
        path = self._memory_file(memory.vocabulary, namespace)
        if path is not None:
            memory.save(path)

    def save_memory(self, path: str | os.PathLike, namespace: str = DEFAULT_MEMORY_NAMESPACE) -> None:
        """
        Writes the memory of `namespace` to a file (e.g. beside the model), which `load_memory` reads back.

        Raises:
            `ValueError` if this state has no memory of that namespace.
        """
        with self._lock:
            memory = self._memories.get(namespace)
        if memory is None:
            raise ValueError(
                f"This state has no lookahead memory of namespace {namespace!r}; it has {sorted(self._memories)}."
            )
        memory.save(path)

    def load_memory(
        self,
        model: PreTrainedModel,
        path: str | os.PathLike,
        namespace: str = DEFAULT_MEMORY_NAMESPACE,
        max_tokens: int = DEFAULT_MEMORY_SIZE,
    ) -> SuffixMemory:
        """
        Replaces the memory of `namespace` with the file at `path`, written by `save_memory` (or found in a
        `memory_dir`) for `model`'s vocabulary, keeping its newest `max_tokens` tokens.

        Raises:
            `ValueError` naming the file and what is wrong with it; the memory stays as it was.
        """
        if not NAMESPACE_PATTERN.fullmatch(namespace):
            raise ValueError(f"`namespace` must be 1 to 64 letters, digits, '.', '_' or '-', got {namespace!r}.")
        memory = self.memory(model, namespace, max_tokens)
        memory.load(path)
        return memory

    def _memory_file(self, vocabulary: str, namespace: str) -> Path | None:
        if self.memory_dir is None:
            return None
        return self.memory_dir / f"{vocabulary.replace('/', '-')}.{namespace}.safetensors"

    def __deepcopy__(self, memo: dict) -> LookaheadState:
        return LookaheadState(*self.__reduce__()[1])

    def __reduce__(self):
        arguments = (self.cost_dir, self.memory_dir, self.step_costs, self.follow_durations, self.tuning)
        return (LookaheadState, (*arguments, self.step_observer))
