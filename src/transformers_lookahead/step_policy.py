"""
What goes into each step of one sequence: the candidates a step could verify, priced (`StepOffer`), the step chosen
of them (`StepChoice`), and the policy that chooses (`StepPolicy`). `StaticStepPolicy` is the paper's fixed shape;
`"auto"`'s adaptive policy is in `adaptive_policy.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    from .ngram_pool import NGramPool
    from .token_tree import TokenTree
    from .verification import Verdict


class StepOption(NamedTuple):
    """
    One step a policy could take (a named tuple: an offer builds one per option, every step).

    Args:
        length (`int`): tokens the step feeds for this sequence.
        expected (`float`): tokens it is expected to accept.
        use_window (`bool`): whether it runs the window.
        count (`int`): how many of the offer's nodes it verifies (the likeliest ones, see `StepOffer.order`).
    """

    length: int
    expected: float
    use_window: bool
    count: int


@dataclass(frozen=True)
class StepOffer:
    """
    What one sequence can put into its next step, priced by its policy (`StepPolicy.offer`).

    Args:
        tree (`TokenTree`): every candidate its pool, context and memory offer.
        window_allowed (`bool`): whether the window fits in the model's positions.
        pending (`int`): tokens the step feeds anyway.
        options (`tuple[StepOption]`): every step the policy would consider.
        order (`tuple[int]`): the tree's nodes, likeliest first; every prefix is a subtree.
        probabilities (`tuple[float]`): each node's estimated acceptance probability before calibration.
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
    The step a policy chose from an offer, carrying what it was chosen with, for `StepPolicy.observe`.

    Args:
        offer (`StepOffer`): the offer.
        use_window (`bool`): whether the step runs the window.
        tree (`TokenTree`): the candidates it verifies (a subtree of `offer.tree`).
        predicted (`float`): the summed acceptance probability of those candidates, before calibration.
        probe (`bool`): whether the window runs as a forced probe rather than on its estimated worth.
    """

    offer: StepOffer
    use_window: bool
    tree: TokenTree
    predicted: float = 0.0
    probe: bool = False

    @classmethod
    def empty(cls, offer: StepOffer) -> StepChoice:
        """The step that verifies nothing of `offer`: the pending tokens alone, without the window."""
        return cls(offer, False, offer.tree.subtree([]))


class StepPolicy(Protocol):
    """
    Decides what goes into each step of one sequence, and learns from what the steps accepted.

    The loop asks for an `offer` once per step (the candidates priced), then a `plan` of it (for a batch, within the
    step length the rows settled on), and after the forward pass `observe`s that plan's verdict.
    """

    # Whether the policy prices steps from measured costs (it then needs a cost table and learns across calls).
    adapts: bool

    def offer(self, tree: TokenTree, window_allowed: bool, pending: int) -> StepOffer:
        """The steps `tree` (every candidate offered) allows, with `pending` tokens fed anyway, priced."""

    def plan(self, offer: StepOffer, budget: int | None = None) -> StepChoice:
        """The step to take of `offer`, within `budget` tokens (the length a batch settled on) when given."""

    def observe(self, choice: StepChoice, verdict: Verdict, pool: NGramPool, key: int) -> None:
        """Learns from a step: `choice` as planned, its `verdict`, the `pool` and `key` its candidates came from."""


class StaticStepPolicy:
    """Every step holds the whole window and every candidate, as in the paper: the step shape is fixed."""

    adapts = False

    def __init__(self, window_length: int):
        self.window_length = window_length

    def offer(self, tree: TokenTree, window_allowed: bool, pending: int) -> StepOffer:
        length = pending + (self.window_length if window_allowed else 0) + len(tree)
        option = StepOption(length, 1.0, window_allowed, len(tree))
        return StepOffer(tree, window_allowed, pending, (option,), tuple(range(len(tree))), (0.0,) * len(tree))

    def plan(self, offer: StepOffer, budget: int | None = None) -> StepChoice:
        """The whole offer (a fixed shape ignores `budget`, the step length a batch settled on)."""
        return StepChoice(offer, offer.window_allowed, offer.tree)

    def observe(self, choice: StepChoice, verdict: Verdict, pool: NGramPool, key: int) -> None:
        """Nothing to learn for a fixed shape (see `StepPolicy.observe`)."""
