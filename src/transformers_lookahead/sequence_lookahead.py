"""
One sequence's lookahead, shared by both decoding loops: what it is built from, where its candidates come from, what
it offers a step and what it learns from one. `generate`'s loop keeps one per row of the batch, continuous batching
one per request.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from .auto_tuning import AUTO_TUNING, AutoTuning
from .lookahead_window import LookaheadWindow
from .ngram_pool import ContextIndex, NGramPool
from .step_policy import AdaptiveStepPolicy, PolicyEstimates, StaticStepPolicy, StepChoice, StepOffer, StepPolicy
from .token_tree import TokenTree
from .verification import GreedyVerifier, Verdict

if TYPE_CHECKING:
    from .configuration_lookahead import LookaheadConfig
    from .cost_model import StepPricing
    from .step_layout import RowStep
    from .suffix_memory import SuffixMemory


class SequenceLookahead:
    """
    One sequence's lookahead, complete when built (`LookaheadFactory.build`): its n-gram pool, Jacobi window, step
    policy, context index and verifier, the tokens its next step feeds first, and what each step accepted.

    Args:
        tokens (`list[int]`): the text so far without padding, on the host; the loop appends to this list.
        limit (`int`): the length `length` may not exceed.
        pool (`NGramPool`): its candidate n-grams.
        window (`LookaheadWindow`): its Jacobi window.
        policy (`StepPolicy`): what goes into each of its steps.
        context (`ContextIndex`, *optional*): where its text repeats itself (for `"auto"` with the prompt pool).
        verifier (`GreedyVerifier`): how its candidates are checked (greedy or sampling).
    """

    def __init__(
        self,
        tokens: list[int],
        limit: int,
        pool: NGramPool,
        window: LookaheadWindow,
        policy: StepPolicy,
        context: ContextIndex | None,
        verifier: GreedyVerifier,
    ):
        self.tokens = tokens
        self.limit = limit
        self.pool = pool
        self.window = window
        self.policy = policy
        self.context = context
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

    def advance(self, kept: int, config: LookaheadConfig, refeed: bool = False, undone: bool = False) -> None:
        """
        Moves past `kept` tokens just appended to the text: what the next step feeds first (the last token, all `kept`
        again where `refeed`, or this step's pending tokens and the `kept` ones where the step was `undone`), and the
        n-grams they completed for the pool.
        """
        fed_again = len(self.pending) + kept if undone else (kept if refeed else 1)
        self.pending = self.tokens[-fed_again:]
        if config.pool_from_prompt:
            self.pool.add_sequence(self.tokens, first_key=len(self.tokens) - kept - config.levels)


class CandidateSource(ABC):
    """
    Where a step's candidates come from: each source proposes continuations of a sequence's last token, and
    `offer_candidates` merges every source's proposals into the step's one `TokenTree`. A new source is a subclass
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
    Builds every sequence's lookahead for one decoding loop (a `generate` call, or a continuous-batching engine), the
    same way in both.

    Args:
        config (`LookaheadConfig`): the step shape.
        window_size (`int`): W, the window's columns (chosen from the cost table for `"auto"`).
        do_sample (`bool`): whether the loop samples (greedy and sampled decoding carry their own estimates).
        recall (`Callable`): what earlier calls left for a policy of a shape (`estimates_key`), or `None`.
        memory (`SuffixMemory`, *optional*): earlier calls' text, whose matches the policy prices.
        pricing (`StepPricing`, *optional*): what steps cost, which every sequence's policy asks (for `"auto"`); it
            starts from what earlier calls learnt.
        tuning (`AutoTuning`): the constants of `"auto"`'s sources and policies.
    """

    def __init__(
        self,
        config: LookaheadConfig,
        window_size: int,
        do_sample: bool,
        recall: Callable[[tuple], PolicyEstimates | None],
        memory: SuffixMemory | None = None,
        pricing: StepPricing | None = None,
        tuning: AutoTuning = AUTO_TUNING,
    ):
        self.config = config
        self.tuning = tuning
        self.window_size = window_size
        self.do_sample = do_sample
        self.recall = recall
        self.memory = memory
        self.pricing = pricing
        self.sources = candidate_sources(config, memory, tuning)
        self._pricing_started = False

    def parts(self, tokens: list[int]) -> tuple[NGramPool, LookaheadWindow, StepPolicy, ContextIndex | None]:
        """The pool, window, policy and context index of a sequence whose text is `tokens` (its prompt and first token)."""
        config = self.config
        pool = NGramPool(config.levels, config.guess)
        if config.pool_from_prompt:
            pool.add_sequence(tokens)
        window = LookaheadWindow(self.window_size, config.levels, tokens)
        context = None
        if config.adaptive:
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
            # The adaptive policy also verifies the continuation of the longest repeated suffix of the text.
            context = ContextIndex() if config.pool_from_prompt else None
        else:
            policy = StaticStepPolicy(self.window_size * config.levels)
        return pool, window, policy, context

    def build(self, tokens: list[int], limit: int, verifier: GreedyVerifier) -> SequenceLookahead:
        """A sequence's lookahead (see `parts`), checking its candidates with `verifier`."""
        return SequenceLookahead(tokens, limit, *self.parts(tokens), verifier)

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


def offer_candidates(
    sequence: SequenceLookahead, sources: list[CandidateSource], max_positions: int | None, chain: int | None = None
) -> StepOffer:
    """
    A sequence's candidates for its next step, every source's proposals merged into one tree, priced by its policy
    (with whether its window fits the model's positions).

    Args:
        sequence (`SequenceLookahead`): the sequence.
        sources (`list[CandidateSource]`): where candidates come from (`candidate_sources`).
        max_positions (`int`, *optional*): the positions the model embeds, if it says.
        chain (`int`, *optional*): offer a chain step (`ChainLayout`) of at most `chain` tokens, the pending ones
            included: one candidate path (`TokenTree.chain`), no window.
    """
    position_room = (max_positions - 1 - sequence.position) if max_positions else sequence.limit
    room = min(sequence.limit - sequence.length - 1, position_room)
    tree = TokenTree()
    for source in sources:
        source.propose(sequence, tree, min(source.depth, room))
    window_allowed = position_room >= sequence.window.levels + sequence.window.window - 1
    if chain is not None:
        tree, window_allowed = tree.subtree(tree.chain()[: max(0, chain - len(sequence.pending))]), False
    return sequence.policy.offer(tree, window_allowed, len(sequence.pending))


def learn_from_step(
    sequence: SequenceLookahead,
    choice: StepChoice,
    row: RowStep,
    verdict: Verdict,
    kept: int,
    choices: list[int],
    config: LookaheadConfig,
    refeed: bool = False,
    observer: Callable[[StepChoice, RowStep, Verdict], None] | None = None,
    undone: bool = False,
) -> None:
    """
    Moves a sequence past a step that kept `kept` of its verified tokens (already appended to its text): what its
    next step feeds first, what its policy learns, its window's next Jacobi iteration and its pool's new n-grams.

    Args:
        sequence (`SequenceLookahead`): the sequence.
        choice (`StepChoice`): what its policy chose for the step.
        row (`RowStep`): its part of the step.
        verdict (`Verdict`): what verification accepted.
        kept (`int`): the tokens the sequence kept (fewer than accepted where it stopped inside the chunk).
        choices (`list[int]`): the model's choices at its rows (`RowStep.logits_rows` order).
        config (`LookaheadConfig`): the step shape.
        refeed (`bool`): whether the next step feeds the kept tokens again (`"refeed"` cache commits) rather than
            the last one only.
        observer (`Callable`, *optional*): told of the step (`LookaheadState.step_observer`).
        undone (`bool`, *optional*): whether the step was undone (`CacheCommitter.undo`), so that the next one feeds
            its pending tokens and the kept ones again.
    """
    if observer is not None:
        observer(choice, row, verdict)
    sequence.accepted.append(kept)
    sequence.policy.observe(choice, verdict, sequence.pool, sequence.tokens[-kept - 1])
    if row.window_used:
        for ngram in sequence.window.update(row.window_top(choices)):
            sequence.pool.add(ngram[0], ngram[1:], from_window=True)
    sequence.advance(kept, config, refeed, undone)
