"""
One sequence's lookahead, shared by both decoding loops: where its candidates come from, how it plans its part of a
step, accepts a verdict and learns from it; and `StepPlanner`, what every sequence of a loop plans with. `generate`'s
loop keeps one `SequenceLookahead` per row of the batch, continuous batching one per request; each loop is then what
only it does (a padded batch and its cache, or the engine's pages). `"auto"` plans with `AdaptivePlanner`
(`adaptive_planner.py`), through the same interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from .lookahead_window import LookaheadWindow
from .ngram_pool import NGramPool
from .step_forward import max_positions
from .step_policy import StaticStepPolicy, StepChoice, StepOffer, StepPolicy
from .token_tree import TokenTree
from .verification import GreedyVerifier, PositionNoise, SamplingVerifier, Verdict

if TYPE_CHECKING:
    from transformers import LogitsProcessorList, PreTrainedModel

    from .configuration_lookahead import LookaheadConfig
    from .step_layout import RowStep, StepLayout


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
    One sequence's lookahead, complete when built: its n-gram pool, Jacobi window, step policy, candidate sources
    and verifier (from `planner`), the tokens its next step feeds first, and what each step accepted. Each step, the
    loop asks it to `offer` its candidates, `plan` its part, `accept` the verdict and `learn` from the step.

    Args:
        tokens (`list[int]`): the text so far without padding (its prompt and first token), on the host; `append`
            grows this list.
        limit (`int`): the length `length` may not exceed.
        planner (`StepPlanner`): how the loop's sequences plan their steps.
        verifier (`GreedyVerifier`): how its candidates are checked (`StepPlanner.verifiers`), which already chose
            its first token.
    """

    def __init__(
        self,
        tokens: list[int],
        limit: int,
        planner: StepPlanner,
        verifier: GreedyVerifier,
    ):
        self.tokens = tokens
        self.limit = limit
        self.planner = planner
        config = planner.config
        self.pool = NGramPool(config.levels, config.guess)
        if config.pool_from_prompt:
            self.pool.add_sequence(tokens)
        self.window = LookaheadWindow(planner.window_size, config.levels, tokens)
        self.policy = planner.policy()
        self.sources = planner.sources()
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

    def offer(self, layout: StepLayout | None = None) -> StepOffer:
        """
        Its candidates for the next step, every source's proposals (`StepPlanner.sources`) merged into one tree
        within the room the sequence and the model's positions leave, as much of them as a step of `layout` holds
        (`StepLayout.candidates`), priced by its policy (with whether its window fits the model's positions).
        """
        max_positions = self.planner.max_positions
        position_room = (max_positions - 1 - self.position) if max_positions else self.limit
        room = min(self.limit - self.length - 1, position_room)
        tree = TokenTree()
        for source in self.sources:
            source.propose(self, tree, min(source.depth, room))
        window_allowed = position_room >= self.window.levels + self.window.window - 1
        if layout is not None:
            tree, window_allowed = layout.candidates(tree, window_allowed, len(self.pending))
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
        was undone, `CacheCommitter.keep`).
        """
        if self.planner.observer is not None:
            self.planner.observer(step.choice, step.row, verdict)
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
        fed_again = len(self.pending) + kept if undone else (kept if self.planner.refeed else 1)
        self.pending = self.tokens[-fed_again:]
        if self.planner.config.pool_from_prompt:
            self.pool.add_sequence(self.tokens, first_key=len(self.tokens) - kept - self.planner.config.levels)


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


class StepPlanner:
    """
    How every sequence of one decoding loop (a `generate` call, or a continuous-batching engine) plans its steps:
    the paper's fixed shape here (the whole window and every candidate of the n-gram pool, every step). The loop asks
    it for each new sequence's policy, sources and verifier, for the length a batch's step settles on, for the
    lengths a compiled step is padded to, and tells it each step's duration and the sequences it finished with.
    `AdaptivePlanner` (`"auto"`) prices steps instead, through the same methods.

    Args:
        model (`PreTrainedModel`, *optional*): the model (how many positions it embeds).
        config (`LookaheadConfig`): the step shape.
        do_sample (`bool`): whether the loop samples.
        refeed (`bool`, *optional*, defaults to `False`): whether a step's kept tokens are fed again (`"refeed"`).
        observer (`Callable`, *optional*): called after every sequence's step with its `StepChoice`, `RowStep` and
            `Verdict` (how tools record steps).
    """

    def __init__(
        self,
        model: PreTrainedModel | None,
        config: LookaheadConfig,
        do_sample: bool,
        refeed: bool = False,
        observer: Callable[[StepChoice, RowStep, Verdict], None] | None = None,
    ):
        self.config = config
        self.do_sample = do_sample
        self.refeed = refeed
        self.observer = observer
        self.window_size = config.window
        # Models with learned absolute positions cannot embed positions past this; guesses stop short of it.
        self.max_positions = max_positions(model) if model is not None else None

    def policy(self) -> StepPolicy:
        """A new sequence's step policy."""
        return StaticStepPolicy(self.window_size * self.config.levels)

    def sources(self) -> list[CandidateSource]:
        """A new sequence's candidate sources, in the order their proposals are merged."""
        return [PoolCandidates(self.config.levels)]

    def verifiers(self, processors: list[LogitsProcessorList]) -> list[GreedyVerifier]:
        """
        The verifiers of new sequences, one per entry of `processors` (each sequence's own): greedy, or sampling with
        one seed per sequence from torch's generator (`torch.manual_seed` fixes the text).
        """
        if not self.do_sample:
            return [GreedyVerifier(own) for own in processors]
        seeds = torch.randint(0, 2**62, (len(processors),), dtype=torch.int64, device="cpu").tolist()
        return [SamplingVerifier(own, PositionNoise(seed)) for own, seed in zip(processors, seeds)]

    def step_length(self, offers: list[StepOffer], allowed: tuple[int, ...] | None = None) -> int | None:
        """
        The tokens per row a batch's step settles on, among the `allowed` lengths (any if `None`), given every row's
        `offers`; `None`: each row takes its whole offer (a fixed shape).
        """
        return None

    def buckets(self, longest: int) -> tuple[int, ...]:
        """The multi-token lengths a compiled step is padded to, shortest first, for steps of at most `longest`."""
        return (longest,)

    def price_batch(self, batch_size: int, padding: int | None = None, longest: int | None = None) -> None:
        """Prices the next steps for `batch_size` sequences (see `AdaptivePlanner.price_batch`); nothing to price."""

    def observe_step(self, length: int, seconds: float) -> None:
        """Learns from a step of `length` tokens per row that took `seconds`; nothing to learn for a fixed shape."""

    def finish(self, sequences: list[SequenceLookahead]) -> None:
        """Keeps what finished sequences leave for later calls; a fixed shape keeps nothing."""
