"""
One sequence's lookahead, shared by `generate`'s loop (one per row) and continuous batching (one per request): its
candidate sources, how it plans its part of a step, accepts a verdict and learns; and `StepPlanner`, what every
sequence of a loop plans with (`"auto"`'s is `adaptive_planner.AdaptivePlanner`).
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
    One sequence's part of a step (`SequenceLookahead.plan`): what its policy chose (`choice`), how it is laid out
    (`row`), and its tokens in the cache before the step (`past`, for continuous batching's pages).
    """

    sequence: SequenceLookahead
    choice: StepChoice
    row: RowStep
    past: int = 0


class SequenceLookahead:
    """
    One sequence's lookahead: its n-gram pool, Jacobi window, policy, candidate sources and verifier, the tokens its
    next step feeds first, and what each step accepted. Each step the loop asks it to `offer`, `plan`, `verify`,
    `accept` and `learn`.

    Args:
        tokens (`list[int]`): the text without padding (prompt and first token), on the host.
        limit (`int`): the length `length` may not exceed.
        planner (`StepPlanner`): what the loop's sequences plan with.
        verifier (`GreedyVerifier`): checks its candidates (it chose the first token).
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
        # The row's padding where the model numbers positions by cache slot, else `generate_position_shift`.
        self.position_offset = 0

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def position(self) -> int:
        """The last token's position (the first real token's is 0, unless `position_offset` says otherwise)."""
        return len(self.tokens) - 1 + self.position_offset

    @property
    def input_ids(self) -> torch.LongTensor | None:
        """The text as the verifier reads it, `(1, length)`; `None` where it reads none."""
        return torch.tensor([self.tokens], device="cpu") if self.verifier.reads_text else None

    def append(self, token: int) -> None:
        self.tokens.append(token)

    def offer(self, layout: StepLayout | None = None) -> StepOffer:
        """
        Its candidates for the next step: every source's proposals merged into one tree within the room its limit
        and the model's positions leave, what a step of `layout` holds of them, priced by its policy.
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
        Its part of the next step: what its policy chooses of `offer` within `budget` tokens (1 verifies nothing), cut
        to `room` where given (the window first, then the least likely candidates; a cut choice does not calibrate).
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
        """What the model accepted of its part (`None`: pending tokens alone), from its `logits` and `choices`."""
        tree, tree_row = (step.choice.tree, step.row.tree_row) if step is not None else (TokenTree(), 1)
        return self.verifier.verify(logits, tree, tree_row, self.input_ids, self.limit - self.length, choices)

    def accept(self, verdict: Verdict, stop: Callable[[int, torch.Tensor, torch.Tensor], bool]) -> int:
        """Appends the verdict's tokens until `stop(token, logits, scores)` or the limit says it ends; returns how many."""
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
        Moves past a step of which it kept `kept` tokens: its policy learns, its window takes the next Jacobi
        iteration from `choices`, its pool the window's n-grams (`undone`: the cache undid the step).
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
        Moves past `kept` appended tokens: the next step feeds the last one (all of them with `"refeed"`, and the
        step's pending tokens too where it was `undone`); the pool takes the n-grams they completed.
        """
        fed_again = len(self.pending) + kept if undone else (kept if self.planner.refeed else 1)
        self.pending = self.tokens[-fed_again:]
        if self.planner.config.pool_from_prompt:
            self.pool.add_sequence(self.tokens, first_key=len(self.tokens) - kept - self.planner.config.levels)


class CandidateSource(ABC):
    """Proposes continuations of a sequence's last token, at most `depth` deep, into the step's one `TokenTree`."""

    def __init__(self, depth: int):
        self.depth = depth

    @abstractmethod
    def propose(self, sequence: SequenceLookahead, tree: TokenTree, depth: int) -> None:
        """Adds its continuations of `sequence.tokens[-1]`, at most `depth` tokens deep, to `tree`."""


class PoolCandidates(CandidateSource):
    """The sequence's n-gram pool: what its window and its text produced after the last token."""

    def propose(self, sequence: SequenceLookahead, tree: TokenTree, depth: int) -> None:
        sequence.pool.tree(sequence.tokens[-1], depth, tree)


class StepPlanner:
    """
    How every sequence of one loop plans its steps: the paper's fixed shape (the whole window and every pooled
    candidate, every step). The loop asks it for each sequence's policy, sources and verifier, a batch's step length
    and a compiled step's lengths, and tells it each step's duration and the finished sequences; `AdaptivePlanner`
    prices steps instead.

    Args:
        model (`PreTrainedModel`, *optional*): the model (how many positions it embeds).
        config (`LookaheadConfig`): the step shape.
        do_sample (`bool`): whether the loop samples.
        refeed (`bool`, *optional*): whether kept tokens are fed again (`"refeed"`).
        observer (`Callable`, *optional*): called with each sequence's `StepChoice`, `RowStep` and `Verdict`.
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
        return StaticStepPolicy(self.window_size * self.config.levels)

    def sources(self) -> list[CandidateSource]:
        return [PoolCandidates(self.config.levels)]

    def verifiers(self, processors: list[LogitsProcessorList]) -> list[GreedyVerifier]:
        """One verifier per sequence's `processors`: greedy, or sampling with a seed from torch's generator."""
        if not self.do_sample:
            return [GreedyVerifier(own) for own in processors]
        seeds = torch.randint(0, 2**62, (len(processors),), dtype=torch.int64, device="cpu").tolist()
        return [SamplingVerifier(own, PositionNoise(seed)) for own, seed in zip(processors, seeds)]

    def step_length(self, offers: list[StepOffer], allowed: tuple[int, ...] | None = None) -> int | None:
        """The tokens per row a batch's step settles on, among `allowed`; `None`: each row takes its whole offer."""
        return None

    def buckets(self, longest: int) -> tuple[int, ...]:
        """The multi-token lengths a compiled step is padded to, shortest first, for steps of at most `longest`."""
        return (longest,)

    def price_batch(self, batch_size: int, padding: int | None = None, longest: int | None = None) -> None:
        """Prices the next steps for `batch_size` sequences; nothing to price for a fixed shape."""

    def observe_step(self, length: int, seconds: float) -> None:
        """Learns from a step of `length` tokens per row that took `seconds`."""

    def finish(self, sequences: list[SequenceLookahead]) -> None:
        """Keeps what finished sequences leave for later calls."""
