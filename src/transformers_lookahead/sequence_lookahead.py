"""
One sequence's lookahead, shared by both decoding loops: what it is built from, where its candidates come from, how
it plans its part of a step, accepts a verdict and learns from it. `generate`'s loop keeps one per row of the batch,
continuous batching one per request; each loop is then what only it does (a padded batch and its cache, or the
engine's pages).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from .auto_tuning import AUTO_TUNING, AutoTuning
from .cost_model import StepPricing, padded_table
from .lookahead_window import LookaheadWindow
from .ngram_pool import ContextIndex, NGramPool
from .step_forward import max_positions
from .step_policy import (
    AdaptiveStepPolicy,
    PolicyEstimates,
    StaticStepPolicy,
    StepChoice,
    StepOffer,
    StepPolicy,
    choose_window,
)
from .token_tree import TokenTree
from .verification import GreedyVerifier, PositionNoise, SamplingVerifier, Verdict

if TYPE_CHECKING:
    from transformers import LogitsProcessorList, PreTrainedModel

    from .configuration_lookahead import LookaheadConfig
    from .cost_model import StepCostModel
    from .lookahead_state import LookaheadState
    from .rank_sync import RankSync
    from .step_layout import RowStep, StepLayout
    from .suffix_memory import SuffixMemory


@dataclass
class SequenceStep:
    """
    One sequence's part of a step, in either loop (`SequenceLookahead.plan`).

    Args:
        sequence (`SequenceLookahead`): the sequence.
        choice (`StepChoice`): what its policy chose from what was offered (the policy learns from all of it).
        row (`RowStep`): its tokens, positions and visibility in the step, and where its outputs are.
        past (`int`, *optional*, defaults to 0): the tokens of the sequence in the cache before the step, where the
            loop needs them (continuous batching's pages).
    """

    sequence: SequenceLookahead
    choice: StepChoice
    row: RowStep
    past: int = 0


class SequenceLookahead:
    """
    One sequence's lookahead, complete when built: its n-gram pool, Jacobi window, step policy, context index and
    verifier (all from `factory`), the tokens its next step feeds first, and what each step accepted. Each step, the
    loop asks it to `plan` its part, `accept` the verdict and `learn` from the step.

    Args:
        tokens (`list[int]`): the text so far without padding (its prompt and first token), on the host; `append`
            grows this list.
        limit (`int`): the length `length` may not exceed.
        factory (`LookaheadFactory`): the loop's settings, sources and pricing.
        verifier (`GreedyVerifier`): how its candidates are checked (`LookaheadFactory.verifiers`), which already
            chose its first token.
    """

    def __init__(
        self,
        tokens: list[int],
        limit: int,
        factory: LookaheadFactory,
        verifier: GreedyVerifier,
    ):
        self.tokens = tokens
        self.limit = limit
        self.factory = factory
        config = factory.config
        self.pool = NGramPool(config.levels, config.guess)
        if config.pool_from_prompt:
            self.pool.add_sequence(tokens)
        self.window = LookaheadWindow(factory.window_size, config.levels, tokens)
        self.policy = factory.policy()
        # The adaptive policy also verifies the continuation of the longest repeated suffix of the text.
        self.context = ContextIndex() if config.adaptive and config.pool_from_prompt else None
        self.verifier = verifier
        # The tokens the next step feeds before its guesses: the last accepted one (all of them with "refeed").
        self.pending = tokens[-1:]
        self.accepted: list[int] = []
        # Where the model numbers positions by cache slot, the row's left padding counts; where `generate` shifts its
        # positions, the shift (`generate_position_shift`).
        self.position_offset = 0

    @property
    def length(self) -> int:
        """The text's length, in the units of `limit`."""
        return len(self.tokens)

    @property
    def position(self) -> int:
        """
        The position of the last token: the first real token is at 0, as with left-padded plain decoding, unless the
        model numbers positions by cache slot (`position_offset`: the row's padding) or `generate` shifts them.
        """
        return len(self.tokens) - 1 + self.position_offset

    @property
    def input_ids(self) -> torch.LongTensor | None:
        """The text as the verifier reads it, shape `(1, length)`; `None` where it reads none."""
        return torch.tensor([self.tokens], device="cpu") if self.verifier.reads_text else None

    def append(self, token: int) -> None:
        """Appends one accepted token to the text."""
        self.tokens.append(token)

    def offer(self, chain: int | None = None) -> StepOffer:
        """
        Its candidates for the next step, every source's proposals (`LookaheadFactory.sources`) merged into one tree
        within the room the sequence and the model's positions leave, priced by its policy (with whether its window
        fits the model's positions). `chain`: a chain step (`ChainLayout`) of at most `chain` tokens, the pending ones
        included: one candidate path (`TokenTree.chain`), no window.
        """
        max_positions = self.factory.max_positions
        position_room = (max_positions - 1 - self.position) if max_positions else self.limit
        room = min(self.limit - self.length - 1, position_room)
        tree = TokenTree()
        for source in self.factory.sources:
            source.propose(self, tree, min(source.depth, room))
        window_allowed = position_room >= self.window.levels + self.window.window - 1
        if chain is not None:
            tree, window_allowed = tree.subtree(tree.chain()[: max(0, chain - len(self.pending))]), False
        return self.policy.offer(tree, window_allowed, len(self.pending))

    def plan(
        self, offer: StepOffer, layout: StepLayout, budget: int | None = None, room: int | None = None
    ) -> SequenceStep:
        """
        The sequence's part of the next step: what its policy chooses of `offer`, within `budget` tokens (the length
        the batch settled on; 1 verifies nothing), cut to `room` tokens where given (the window first to go, then the
        least likely candidates). A cut choice is no longer the one its prediction was made for: it does not calibrate.
        """
        choice = StepChoice.empty(offer) if budget == 1 else self.policy.plan(offer, budget)
        use_window, tree = choice.use_window, choice.tree
        if room is not None:
            if use_window and offer.pending + len(self.window) + len(tree) > room:
                use_window = False
            if offer.pending + len(tree) > room:
                tree = tree.subtree(list(range(max(0, room - offer.pending))))
        if use_window != choice.use_window or tree is not choice.tree:
            choice = replace(choice, use_window=use_window, tree=tree, predicted=0.0)
        row = layout.row(self.pending, self.position, self.window.flat() if use_window else None, tree)
        return SequenceStep(self, choice, row)

    def verify(self, step: SequenceStep | None, logits: torch.Tensor, choices: list[int]) -> Verdict:
        """
        What the model accepted of the sequence's part of a step (`None`: a step that fed its pending token alone),
        from its `logits` and the model's `choices` at its rows (`RowStep.logits_rows` order).
        """
        tree, tree_row = (step.choice.tree, step.row.tree_row) if step is not None else (TokenTree(), 1)
        return self.verifier.verify(logits, tree, tree_row, self.input_ids, self.limit - self.length, choices)

    def accept(self, verdict: Verdict, stop: Callable[[int, torch.Tensor, torch.Tensor], bool]) -> int:
        """
        Appends the verdict's tokens one at a time, as plain decoding would, until `stop(token, logits, scores)`
        (asked after each) says the sequence ends, or it reaches its limit; returns how many it kept.
        """
        kept = 0
        for token, raw, processed in zip(verdict.tokens, verdict.logits, verdict.scores):
            if self.length >= self.limit:
                break
            kept += 1
            self.append(token)
            if stop(token, raw, processed):
                break
        return kept

    def learn(self, step: SequenceStep, verdict: Verdict, kept: int, choices: list[int], undone: bool = False) -> None:
        """
        Moves past its part of a step (`step`), whose `verdict` it kept `kept` tokens of (`accept`; fewer where it
        stopped inside the chunk), given the model's `choices` at its rows: what its policy learns, its window's next
        Jacobi iteration, its pool's new n-grams and what its next step feeds first (`advance`; `undone`: the step
        was undone, `CacheCommitter.undo`).
        """
        if self.factory.observer is not None:
            self.factory.observer(step.choice, step.row, verdict)
        self.accepted.append(kept)
        self.policy.observe(step.choice, verdict, self.pool, self.tokens[-kept - 1])
        if step.row.window_used:
            for ngram in self.window.update(step.row.window_top(choices)):
                self.pool.add(ngram[0], ngram[1:], from_window=True)
        self.advance(kept, undone)

    def advance(self, kept: int, undone: bool = False) -> None:
        """
        Moves past `kept` tokens just appended to the text: what the next step feeds first (the last token, all `kept`
        again with "refeed" commits, or this step's pending tokens and the `kept` ones where the step was `undone`),
        and the n-grams they completed for the pool.
        """
        fed_again = len(self.pending) + kept if undone else (kept if self.factory.refeed else 1)
        self.pending = self.tokens[-fed_again:]
        if self.factory.config.pool_from_prompt:
            self.pool.add_sequence(self.tokens, first_key=len(self.tokens) - kept - self.factory.config.levels)


class CandidateSource(ABC):
    """
    Where a step's candidates come from: each source proposes continuations of a sequence's last token, and
    `SequenceLookahead.offer` merges every source's proposals into the step's one `TokenTree`. A new source is a subclass
    and one entry in `candidate_sources`.

    Args:
        depth (`int`): the most tokens deep it proposes.
    """

    def __init__(self, depth: int):
        self.depth = depth

    @abstractmethod
    def propose(self, sequence: SequenceLookahead, tree: TokenTree, depth: int) -> None:
        """Adds its continuations of `sequence.tokens[-1]`, at most `depth` tokens deep, to `tree`."""


class PoolCandidates(CandidateSource):
    """The sequence's n-gram pool: what its window and its text produced after the last token (`NGramPool`)."""

    def propose(self, sequence: SequenceLookahead, tree: TokenTree, depth: int) -> None:
        sequence.pool.tree(sequence.tokens[-1], depth, tree)


class ContextCandidates(CandidateSource):
    """What followed the longest earlier occurrence of the text's suffix (`ContextIndex`, for `"auto"`)."""

    def propose(self, sequence: SequenceLookahead, tree: TokenTree, depth: int) -> None:
        if sequence.context is not None:
            sequence.context.update(sequence.tokens)
            tree.add_path(sequence.context.continuation(sequence.tokens, depth))


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
            tree.add_memory(match, self.max_nodes)


def candidate_sources(
    config: LookaheadConfig, memory: SuffixMemory | None, tuning: AutoTuning = AUTO_TUNING
) -> list[CandidateSource]:
    """Every source a step's candidates come from, in the order their proposals are merged."""
    sources = [PoolCandidates(config.levels), ContextCandidates(tuning.context_depth)]
    if memory is not None:
        sources.append(MemoryCandidates(tuning.memory_depth, memory, tuning.memory_nodes))
    return sources


class LookaheadFactory:
    """
    What every sequence of one decoding loop (a `generate` call, or a continuous-batching engine) is built and
    priced with, the same way in both: the window size, the pricing of `"auto"`, the candidate sources (the suffix
    memory among them), what earlier calls learnt, and the rules a sequence learns by.

    Args:
        model (`PreTrainedModel`): the model (its vocabulary names its suffix memory).
        config (`LookaheadConfig`): the step shape.
        state (`LookaheadState`): what earlier calls learnt, the suffix memory and the step observer.
        do_sample (`bool`): whether the loop samples (greedy and sampled decoding carry their own estimates).
        cost (`StepCostModel`, *optional*): the model's step-cost table, for `"auto"`.
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
        cost: StepCostModel | None = None,
        *,
        batch_size: int | None = 1,
        window_cost: StepCostModel | None = None,
        timed: bool = False,
        sync: RankSync | None = None,
        refeed: bool = False,
    ):
        self.config = config
        self.state = state
        self.tuning = state.tuning
        self.do_sample = do_sample
        self.cost = cost
        self.sync = sync
        self.refeed = refeed
        self.observer = state.step_observer
        self.window_size, self.pricing = config.window, None
        if config.adaptive:
            table = cost.for_batch(batch_size or 1)
            self.window_size = choose_window(window_cost or table, config.levels, self.tuning)
            # One pricing for the loop: every row's step costs what the batch's step costs.
            self.pricing = StepPricing(table, timed, self.tuning)
        self._batch_size = batch_size
        # Earlier calls' text, whose continuations the steps also verify; the loop's is added as sequences finish.
        self.memory = state.memory(model, config.memory_namespace, config.memory_size) if config.memory else None
        self.sources = candidate_sources(config, self.memory, self.tuning)
        # Models with learned absolute positions cannot embed positions past this; guesses stop short of it.
        self.max_positions = max_positions(model) if model is not None else None
        self._carried: dict[tuple, PolicyEstimates | None] = {}
        self._pricing_started = False

    def policy(self) -> StepPolicy:
        """A new sequence's step policy: for `"auto"`, starting from what the last call of its kind left."""
        config = self.config
        if not config.adaptive:
            return StaticStepPolicy(self.window_size * config.levels)
        policy = AdaptiveStepPolicy(
            self.pricing,
            self.window_size * config.levels,
            config.levels,
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

    def verifiers(self, processors: list[LogitsProcessorList]) -> list[GreedyVerifier]:
        """
        The verifiers of new sequences, one per entry of `processors` (each sequence's own): greedy, or sampling with
        one seed per sequence from torch's generator (`torch.manual_seed` fixes the text).
        """
        if not self.do_sample:
            return [GreedyVerifier(own) for own in processors]
        seeds = torch.randint(0, 2**62, (len(processors),), dtype=torch.int64, device="cpu").tolist()
        return [SamplingVerifier(own, PositionNoise(seed)) for own, seed in zip(processors, seeds)]

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
        if self.pricing is None or batch_size == self._batch_size:
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
        Keeps what finished sequences leave for later calls: what their policies learnt (for `"auto"`) and their
        text (for the suffix memory, when it is on).
        """
        if self.config.adaptive:
            self.state.remember(
                self.estimates_key(sequences[0].policy), self.estimates([sequence.policy for sequence in sequences])
            )
        if self.memory is not None:
            self.state.add_to_memory(self.config.memory_namespace, [sequence.tokens for sequence in sequences])
