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
    What `"auto"` learns about one model across calls, held by the model (`model.lookahead_state`): its step-cost
    table (measured once per device, dtype and thread count, and kept in `cost_dir`), the last call's acceptance
    estimates (so short calls do not relearn them), a continuous-batching engine's timed steps, the suffix memories
    (one per namespace, kept in `memory_dir` where set), and the model check's verdicts. None of it changes what a
    call generates. Safe to share between threads; a copied or pickled state starts empty.

    Args:
        cost_dir (`str` or `os.PathLike` or `None`, *optional*): where cost tables are kept: by default
            `$TRANSFORMERS_LOOKAHEAD_COST_DIR` ("off": `None`), else `lookahead/step_costs` under the Hugging Face
            cache; `None` keeps them in memory.
        memory_dir (`str` or `os.PathLike` or `None`, *optional*): where suffix memories are kept, by default
            `$TRANSFORMERS_LOOKAHEAD_MEMORY_DIR`, else nowhere.
        step_costs (`StepCostModel`, *optional*): a table to price every step by instead of measuring one.
        follow_durations (`bool`, *optional*, defaults to `True`): whether `"auto"` also learns from its steps'
            measured durations; off, its steps depend only on the table and the text.
        tuning (`AutoTuning`, *optional*): the constants `"auto"` decides with.
        step_observer (`Callable`, *optional*): called with each sequence's `StepChoice`, `RowStep` and `Verdict`.
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
        The step-cost table of `model` as it runs now, measured at most once per state (over `encoder_outputs` of one
        input for encoder-decoder models; in chain steps where `chain`).
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
        The suffix memory of `namespace`, holding at most `max_tokens` from now on: created, or read from
        `memory_dir`, on first use (a `ValueError` if that file is not of this vocabulary).
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
        """Adds a finished call's sequences to the memory of `namespace`, and writes it to `memory_dir` if set."""
        with self._lock:
            memory = self._memories[namespace]
        memory.add(documents)
        path = self._memory_file(memory.vocabulary, namespace)
        if path is not None:
            memory.save(path)

    def save_memory(self, path: str | os.PathLike, namespace: str = DEFAULT_MEMORY_NAMESPACE) -> None:
        """Writes the memory of `namespace` to a file, which `load_memory` reads back."""
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
        """Replaces the memory of `namespace` with the file at `path` (`save_memory`'s), keeping `max_tokens`."""
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
