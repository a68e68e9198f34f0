"""What goes into a sequence's step: its priced candidates (`StepOffer`), the step chosen (`StepChoice`), the policy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    from .ngram_pool import NGramPool
    from .token_tree import TokenTree
    from .verification import Verdict


class StepOption(NamedTuple):
    """A step a policy could take: its `length`, `expected` tokens, whether it runs the window, and its `count` nodes."""

    length: int
    expected: float
    use_window: bool
    count: int


@dataclass(frozen=True)
class StepOffer:
    """
    What one sequence can put into its next step, priced by its policy.

    Args:
        tree (`TokenTree`): every candidate offered.
        window_allowed (`bool`): whether the window fits in the model's positions.
        pending (`int`): tokens the step feeds anyway.
        options (`tuple[StepOption]`): every step the policy would consider.
        order (`tuple[int]`): the nodes, likeliest first; every prefix is a subtree.
        probabilities (`tuple[float]`): each node's estimated acceptance probability.
    """

    tree: TokenTree
    window_allowed: bool
    pending: int
    options: tuple[StepOption, ...]
    order: tuple[int, ...]
    probabilities: tuple[float, ...]


@dataclass(frozen=True)
class StepChoice:
    """
    The step a policy chose of an `offer`: whether it runs the window, its `tree` (a subtree of the offer's), the
    summed acceptance probability `predicted` for it, and whether the window runs as a forced `probe`.
    """

    offer: StepOffer
    use_window: bool
    tree: TokenTree
    predicted: float = 0.0
    probe: bool = False

    @classmethod
    def empty(cls, offer: StepOffer) -> StepChoice:
        return cls(offer, False, offer.tree.subtree([]))


class StepPolicy(Protocol):
    """Decides what goes into a sequence's steps (`offer`, then `plan`), and learns from their verdicts (`observe`)."""

    # Whether it prices steps from measured costs (a cost table, learning across calls).
    adapts: bool

    def offer(self, tree: TokenTree, window_allowed: bool, pending: int) -> StepOffer:
        """The steps `tree` allows after `pending` tokens, priced."""

    def plan(self, offer: StepOffer, budget: int | None = None) -> StepChoice:
        """The step to take of `offer`, within `budget` tokens when given."""

    def observe(self, choice: StepChoice, verdict: Verdict, pool: NGramPool, key: int) -> None:
        """Learns from `choice`'s `verdict` (its candidates came from `pool` at `key`)."""


class StaticStepPolicy:
    """The paper's fixed shape: every step holds the whole window and every candidate."""

    adapts = False

    def __init__(self, window_length: int):
        self.window_length = window_length

    def offer(self, tree: TokenTree, window_allowed: bool, pending: int) -> StepOffer:
        length = pending + (self.window_length if window_allowed else 0) + len(tree)
        option = StepOption(length, 1.0, window_allowed, len(tree))
        return StepOffer(tree, window_allowed, pending, (option,), tuple(range(len(tree))), (0.0,) * len(tree))

    def plan(self, offer: StepOffer, budget: int | None = None) -> StepChoice:
        return StepChoice(offer, offer.window_allowed, offer.tree)

    def observe(self, choice: StepChoice, verdict: Verdict, pool: NGramPool, key: int) -> None:
        pass
