"""
`lookahead_window="auto"`'s planner: the window size and every step's content chosen from the model's measured step
costs and the acceptance seen so far, the candidates of the context and of the suffix memory beside the pool's, and
what a call leaves for the next one (`LookaheadState`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from .adaptive_policy import AdaptiveStepPolicy, PolicyEstimates, batch_step_length, choose_window
from .auto_tuning import AUTO_TUNING, AutoTuning
from .cost_model import COST_GRID, StepPricing, padded_table
from .sequence_lookahead import CandidateSource, PoolCandidates, SequenceLookahead, StepPlanner
from .step_policy import StepOffer

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from .configuration_lookahead import LookaheadConfig
    from .cost_model import StepCostModel
    from .lookahead_state import LookaheadState
    from .rank_sync import RankSync
    from .suffix_memory import SuffixMemory
    from .token_tree import TokenTree


class ContextIndex:
    """
    Where each recent k-gram of the text last occurred, to copy what followed it (prompt lookup decoding's idea,
    with a hash lookup instead of a scan). The longest suffix of the text (up to `max_match` tokens) seen earlier
    proposes the tokens that followed its most recent earlier occurrence.

    Args:
        max_match (`int`): the longest suffix looked up.
    """

    def __init__(self, max_match: int = 3):
        self.max_match = max_match
        self._next_index: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_match)]
        self._indexed = 0

    def update(self, tokens: Sequence[int]) -> None:
        """Indexes the k-grams of `tokens` that gained a following token since the last call."""
        for end in range(max(self._indexed, 1), len(tokens)):
            # tokens[end - k : end] is followed by tokens[end]
            for k in range(1, min(self.max_match, end) + 1):
                self._next_index[k - 1][tuple(tokens[end - k : end])] = end
        self._indexed = len(tokens)

    def continuation(self, tokens: Sequence[int], length: int) -> list[int]:
        """
        Up to `length` tokens that followed the most recent earlier occurrence of the longest matching suffix of
        `tokens` (which must have been passed to `update`), or an empty list.
        """
        if length < 1:
            return []
        for k in range(min(self.max_match, len(tokens) - 1), 0, -1):
            start = self._next_index[k - 1].get(tuple(tokens[-k:]))
            if start is not None:
                return list(tokens[start : start + length])
        return []


class ContextCandidates(CandidateSource):
    """What followed the longest earlier occurrence of the text's suffix (its own `ContextIndex` of the text)."""

    def __init__(self, depth: int):
        super().__init__(depth)
        self.index = ContextIndex()

    def propose(self, sequence: SequenceLookahead, tree: TokenTree, depth: int) -> None:
        self.index.update(sequence.tokens)
        tree.add_path(self.index.continuation(sequence.tokens, depth))


class MemoryCandidates(CandidateSource):
    """
    What followed the text's suffix in earlier calls (`SuffixMemory`).

    Args:
        depth (`int`): the most tokens deep it proposes.
        memory (`SuffixMemory`): the memory.
        max_nodes (`int`): the most tree nodes its continuations add.
    """

    def __init__(self, depth: int, memory: SuffixMemory, max_nodes: int):
        super().__init__(depth)
        self.memory = memory
        self.max_nodes = max_nodes

    def propose(self, sequence: SequenceLookahead, tree: TokenTree, depth: int) -> None:
        match = self.memory.match(sequence.tokens, depth)
        if match is not None:
            tree.add_memory(match.length, match.continuations, self.max_nodes)


def compiled_buckets(cost: StepCostModel, longest: int, tuning: AutoTuning = AUTO_TUNING) -> tuple[int, ...]:
    """
    The multi-token step lengths a compiled forward pass compiles, shortest first: the widest step this device runs
    for at most `compiled_step_cost` one-token steps (on a GPU about all of it, a few tokens on a CPU), and below it
    at most `compiled_buckets - 1` shorter lengths, each kept only where the next longer one costs at least
    `compiled_bucket_ratio` times as much. A flat cost curve gives one bucket holding wide windows and many
    candidates; a steep one, small buckets.
    """
    affordable = [
        length for length in COST_GRID if 4 <= length <= longest and cost(length) <= tuning.compiled_step_cost
    ]
    buckets = [max(affordable, default=min(4, longest))]
    for length in sorted(affordable, reverse=True):
        if len(buckets) == tuning.compiled_buckets:
            break
        if cost(buckets[-1]) >= tuning.compiled_bucket_ratio * cost(length):
            buckets.append(length)
    return tuple(sorted(buckets))


class AdaptivePlanner(StepPlanner):
    """
    `"auto"`'s `StepPlanner`, the same way in both loops: the window size chosen from the model's step-cost table,
    one pricing of every step for the loop (`StepPricing`, learning from the steps' durations where `timed`), an
    `AdaptiveStepPolicy` per sequence starting from what the last call of its kind left, and the context's and the
    suffix memory's candidates beside the pool's.

    Args:
        model (`PreTrainedModel`): the model (its vocabulary names its suffix memory).
        config (`LookaheadConfig`): the step shape (`window="auto"`).
        state (`LookaheadState`): what earlier calls learnt, the suffix memory, the tuned constants and the step
            observer.
        do_sample (`bool`): whether the loop samples (greedy and sampled decoding carry their own estimates).
        cost (`StepCostModel`): the model's step-cost table.
        batch_size (`int`, *optional*, defaults to 1): the rows the first steps are priced for (`price_batch`);
            `None` where `price_batch` prices them before the first step.
        window_cost (`StepCostModel`, *optional*): the table the window size is chosen from, if not the batch's.
        timed (`bool`, *optional*, defaults to `False`): whether the pricing learns from the steps' durations.
        sync (`RankSync`, *optional*): tensor-parallel ranks agree on what earlier calls learnt.
        refeed (`bool`, *optional*, defaults to `False`): whether a step's kept tokens are fed again (`"refeed"`).
    """

    def __init__(
        self,
        model: PreTrainedModel | None,
        config: LookaheadConfig,
        state: LookaheadState,
        do_sample: bool,
        cost: StepCostModel,
        *,
        batch_size: int | None = 1,
        window_cost: StepCostModel | None = None,
        timed: bool = False,
        sync: RankSync | None = None,
        refeed: bool = False,
    ):
        super().__init__(model, config, do_sample, refeed=refeed, observer=state.step_observer)
        self.state = state
        self.tuning = state.tuning
        self.cost = cost
        self.sync = sync
        table = cost.for_batch(batch_size or 1)
        self.window_size = choose_window(window_cost or table, config.levels, self.tuning)
        # One pricing for the loop: every row's step costs what the batch's step costs.
        self.pricing = StepPricing(table, timed, self.tuning)
        self._batch_size = batch_size
        # Earlier calls' text, whose continuations the steps also verify; the loop's is added as sequences finish.
        self.memory = state.memory(model, config.memory_namespace, config.memory_size) if config.memory else None
        self._carried: dict[tuple, PolicyEstimates | None] = {}
        self._pricing_started = False

    def policy(self) -> AdaptiveStepPolicy:
        """A new sequence's step policy, starting from what the last call of its kind left."""
        policy = AdaptiveStepPolicy(
            self.pricing,
            self.window_size * self.config.levels,
            self.config.levels,
            context_depth=self.tuning.context_depth,
            memory_match=self.memory.max_match if self.memory is not None else 0,
            memory_depth=self.tuning.memory_depth,
            tuning=self.tuning,
        )
        learnt = self.recall(self.estimates_key(policy))
        if learnt is not None:
            policy.start_from(learnt)
            if not self._pricing_started:
                # Shared by the loop's sequences, and learning from its steps once they run.
                self.pricing.start_from(learnt.excess_scale, learnt.underpricing)
        self._pricing_started = True
        return policy

    def sources(self) -> list[CandidateSource]:
        """The pool's candidates, the context's continuation (with the prompt's n-grams) and the suffix memory's."""
        sources: list[CandidateSource] = [PoolCandidates(self.config.levels)]
        if self.config.pool_from_prompt:
            sources.append(ContextCandidates(self.tuning.context_depth))
        if self.memory is not None:
            sources.append(MemoryCandidates(self.tuning.memory_depth, self.memory, self.tuning.memory_nodes))
        return sources

    def step_length(self, offers: list[StepOffer], allowed: tuple[int, ...] | None = None) -> int | None:
        """The length with the most expected tokens over all rows per unit of cost (`batch_step_length`)."""
        return batch_step_length(offers, self.pricing, allowed)

    def buckets(self, longest: int) -> tuple[int, ...]:
        """A few lengths taken from the cost table (`compiled_buckets`)."""
        return compiled_buckets(self.cost, longest, self.tuning)

    def observe_step(self, length: int, seconds: float) -> None:
        if self.pricing.timed:
            self.pricing.observe(length, seconds)

    def recall(self, key: tuple) -> PolicyEstimates | None:
        """What the last call of this kind left for a policy of shape `key`; rank 0's under tensor parallelism."""
        if self.sync is None:
            return self.state.recall(key)
        if key not in self._carried:
            self._carried[key] = self.sync.agree(self.state.recall(key))
        return self._carried[key]

    def price_batch(self, batch_size: int, padding: int | None = None, longest: int | None = None) -> None:
        """
        Prices the next steps for `batch_size` sequences, a step of T tokens each costing what `batch_size x T`
        tokens cost (a smaller batch makes each extra token cheaper again); where the loop pads a step's query
        tokens to a multiple of `padding`, as the padded step (`padded_table`, up to `longest` tokens each).
        """
        if batch_size == self._batch_size:
            return
        self._batch_size = batch_size
        table = self.cost.for_batch(batch_size)
        if padding:
            table = padded_table(table, batch_size, padding, longest)
        self.pricing.use_table(table)

    def estimates_key(self, policy: AdaptiveStepPolicy) -> tuple:
        """Greedy and sampled decoding accept at different rates: each kind carries its own estimates."""
        return (*policy.shape, self.do_sample)

    def estimates(self, policies: list[AdaptiveStepPolicy]) -> PolicyEstimates:
        """What the policies of the loop's sequences learnt (their mean), with what its pricing learnt."""
        excess_scale, underpricing = self.pricing.learnt()
        return replace(
            PolicyEstimates.mean([policy.estimates() for policy in policies]),
            excess_scale=excess_scale,
            underpricing=underpricing,
        )

    def finish(self, sequences: list[SequenceLookahead]) -> None:
        """
        Keeps what finished sequences leave for later calls: what their policies learnt, and their text (for the
        suffix memory, when it is on).
        """
        self.state.remember(
            self.estimates_key(sequences[0].policy), self.estimates([sequence.policy for sequence in sequences])
        )
        if self.memory is not None:
            self.state.add_to_memory(self.config.memory_namespace, [sequence.tokens for sequence in sequences])
