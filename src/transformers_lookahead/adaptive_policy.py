"""
`lookahead_window="auto"`'s step policy: what each step verifies, from the acceptance its `AcceptanceModel` predicts
and the price `StepPricing` gives, and the step length a batch settles on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .auto_tuning import AUTO_TUNING, AutoTuning
from .cost_model import StepCostModel, StepPricing
from .ngram_pool import NGramPool
from .step_policy import StepChoice, StepOffer, StepOption
from .token_tree import TokenTree
from .verification import Verdict

# The step (1-based, after the prefill) a policy that has timed no one-token step yet makes one.
_TIMED_ONE_TOKEN_STEP = 2


def choose_window(cost: StepCostModel, levels: int, tuning: AutoTuning = AUTO_TUNING) -> int:
    """
    The window `lookahead_window="auto"` uses: the widest one (up to `tuning.max_window`) that makes a step carrying
    one candidate path of `levels` (N - 1) tokens cost at most `tuning.window_cost_budget` times that step without
    the window. Wide on a GPU, narrow on a CPU.
    """
    base, budget = 1 + levels, tuning.window_cost_budget
    fitting = [w for w in range(1, tuning.max_window + 1) if cost(base + w * levels) <= budget * cost(base)]
    return max(fitting, default=1)


def batch_step_length(
    offers: list[StepOffer], step_cost: Callable[[int], float], allowed: tuple[int, ...] | None = None
) -> int:
    """
    The step length (tokens per row) with the most expected tokens, summed over rows, per unit of cost, among the
    `allowed` lengths (any length an offer has if `None`): every row then verifies the best it can within it.

    Args:
        offers (`list[StepOffer]`): one offer per row of the step.
        step_cost (`Callable[[int], float]`): the cost of a step of that many tokens per row, for this batch.
        allowed (`tuple[int]`, *optional*): the lengths to choose from.
    """
    longest = max([option.length for offer in offers for option in offer.options] + list(allowed or ()))
    total = [0.0] * (longest + 1)
    for offer in offers:
        # Best expected tokens of this row within each length: a running maximum over lengths.
        best = [0.0] * (longest + 1)
        for option in offer.options:
            best[option.length] = max(best[option.length], option.expected)
        running = 0.0
        for length in range(longest + 1):
            running = max(running, best[length])
            total[length] += running
    lengths = allowed or sorted({option.length for offer in offers for option in offer.options})
    return max(lengths, key=lambda length: total[length] / step_cost(length))


@dataclass(frozen=True)
class PolicyEstimates:
    """
    What an `AdaptiveStepPolicy` has learnt about acceptance, and its loop's `StepPricing` about what steps cost, to
    start another call from.

    Args:
        match_rate (`tuple[float]`): per depth, how often a pooled candidate matched once its parent had.
        context_rate (`tuple[float]`): per depth, the same for the continuation copied from the context.
        window_credit (`float`): decayed sum of the tokens only the window's n-grams predicted.
        window_steps (`float`): decayed count of the steps that ran the window.
        memory_rate (`tuple[tuple[float]]`): per match length and depth, how often a continuation from the suffix
            memory matched once its parent had (empty without a memory).
        predicted (`float`): decayed sum of the acceptance probabilities of the nodes steps verified.
        realized (`float`): decayed sum of the nodes those steps accepted.
        probe_wait (`float`): steps without the window before the next forced window step (0: not learnt).
        excess_scale (`float`): what the loop's `StepPricing` learnt: the factor on the table's excess.
        underpricing (`tuple[tuple[int, float]]`): and its factors per band of step lengths (none learnt: empty).
    """

    match_rate: tuple[float, ...]
    context_rate: tuple[float, ...]
    window_credit: float
    window_steps: float
    memory_rate: tuple[tuple[float, ...], ...] = ()
    predicted: float = 0.0
    realized: float = 0.0
    probe_wait: float = 0.0
    excess_scale: float = 1.0
    underpricing: tuple[tuple[int, float], ...] = ()

    @staticmethod
    def mean(estimates: list[PolicyEstimates]) -> PolicyEstimates:
        """The element-wise mean of several sequences' acceptance estimates (all of one shape)."""
        count = len(estimates)

        def average(values) -> tuple[float, ...]:
            return tuple(sum(column) / count for column in zip(*values))

        return PolicyEstimates(
            average(e.match_rate for e in estimates),
            average(e.context_rate for e in estimates),
            sum(e.window_credit for e in estimates) / count,
            sum(e.window_steps for e in estimates) / count,
            tuple(average(rows) for rows in zip(*(e.memory_rate for e in estimates))),
            sum(e.predicted for e in estimates) / count,
            sum(e.realized for e in estimates) / count,
            sum(e.probe_wait for e in estimates) / count,
        )


class AcceptanceModel:
    """
    How likely a sequence's candidates are to be accepted, learnt from every step it takes (the guide's
    "`lookahead_window="auto"`" section derives it); `AdaptiveStepPolicy` chooses steps with it.

    - A node's probability of lying on the accepted path: down its path, the running rate at which a candidate
      matched once its parent had (per depth and source: pooled `match_rate`, copied `context_rate`, remembered
      `memory_rate[match length]`) times the node's share of its siblings' continuations. Rates learn from every
      step's whole offered tree, so left-out candidates still teach them.
    - Calibration: verified nodes are the ones that look best, so they match less often than their estimates say;
      every probability is scaled by accepted over predicted nodes (decayed sums from `calibration_prior`).
    - The window's worth (`window_gain`): the tokens per window step only the window's n-grams found.

    Args:
        levels (`int`): N - 1, the deepest candidate.
        context_depth (`int`): the longest continuation copied from the context.
        memory_match (`int`): the longest match of the suffix memory (0: no memory).
        memory_depth (`int`): the deepest continuation of the suffix memory.
        tuning (`AutoTuning`): the estimates' decay and priors and the calibration's constants.
    """

    def __init__(
        self,
        levels: int,
        context_depth: int = 0,
        memory_match: int = 0,
        memory_depth: int = 0,
        tuning: AutoTuning = AUTO_TUNING,
    ):
        self.decay = tuning.decay
        self.match_rate = [tuning.match_prior] * (levels + 1)
        self.context_rate = [tuning.context_prior] * (context_depth + 1)
        self.memory_rate = (
            [[tuning.memory_prior] * (memory_depth + 1) for _ in range(memory_match + 1)] if memory_match else []
        )
        self._window_credit, self._window_steps = tuning.window_credit_prior, tuning.window_steps_prior
        self.calibration_decay = tuning.calibration_decay
        self.calibration_prior = tuning.calibration_prior
        self._predicted, self._realized = 0.0, 0.0

    @property
    def shape(self) -> tuple:
        """What estimates of another model must match to be reused here."""
        memory_shape = (len(self.memory_rate), len(self.memory_rate[0])) if self.memory_rate else (0, 0)
        return (len(self.match_rate), len(self.context_rate), *memory_shape)

    def estimates(self, probe_wait: float) -> PolicyEstimates:
        """What this model has learnt so far, with the policy's `probe_wait`."""
        return PolicyEstimates(
            tuple(self.match_rate),
            tuple(self.context_rate),
            self._window_credit,
            self._window_steps,
            tuple(tuple(rates) for rates in self.memory_rate),
            self._predicted,
            self._realized,
            probe_wait,
        )

    def start_from(self, estimates: PolicyEstimates) -> None:
        """Replaces the priors with estimates learnt earlier (by a model of the same `shape`)."""
        self.match_rate = list(estimates.match_rate)
        self.context_rate = list(estimates.context_rate)
        self.memory_rate = [list(rates) for rates in estimates.memory_rate]
        self._window_credit, self._window_steps = estimates.window_credit, estimates.window_steps
        self._predicted, self._realized = estimates.predicted, estimates.realized

    @property
    def calibration(self) -> float:
        """Accepted over predicted nodes of the verified steps: the factor applied to every node's probability."""
        return (self._realized + self.calibration_prior) / (self._predicted + self.calibration_prior)

    @property
    def window_gain(self) -> float:
        return self._window_credit / max(self._window_steps, 1.0)

    def node_probabilities(self, tree: TokenTree) -> list[float]:
        """The estimated probability that each node of `tree` is accepted, calibrated (see the class docstring)."""
        return self.calibrated(self.raw_probabilities(tree))

    def calibrated(self, raw: list[float]) -> list[float]:
        calibration = self.calibration
        return [min(1.0, calibration * probability) for probability in raw]

    def raw_probabilities(self, tree: TokenTree) -> list[float]:
        """Each node's probability from the per-depth estimates alone."""
        sibling_counts: dict[int, int] = {}
        for parent, count in zip(tree.parents, tree.counts):
            sibling_counts[parent] = sibling_counts.get(parent, 0) + count
        memory_rate = self.memory_rate[tree.memory_match] if tree.memory_total else None
        probability, context, remembered = [], [], []
        for node, (parent, depth) in enumerate(zip(tree.parents, tree.depths)):
            above = probability[parent] if parent >= 0 else 1.0
            pooled = 0.0
            if tree.counts[node]:
                pooled = above * self.match_rate[depth] * tree.counts[node] / sibling_counts[parent]
            copied = 0.0
            if tree.in_context[node]:
                copied = (context[parent] if parent >= 0 else 1.0) * self.context_rate[depth]
            recalled = 0.0
            if tree.memory_counts[node]:
                through_parent = tree.memory_counts[parent] if parent >= 0 else tree.memory_total
                recalled = (
                    (remembered[parent] if parent >= 0 else 1.0)
                    * memory_rate[depth]
                    * tree.memory_counts[node]
                    / through_parent
                )
            context.append(copied)
            remembered.append(recalled)
            probability.append(max(pooled, copied, recalled))
        return probability

    def observe(self, choice: StepChoice, verdict: Verdict, pool: NGramPool, key: int) -> None:
        """Learns from the step `choice` planned and its `verdict` (see `StepPolicy.observe`)."""
        offered = choice.offer.tree
        # The whole tree offered for this step, not only the verified part, is scored against the accepted tokens;
        # the copied continuation is scored on its own.
        self._learn_rates(self.match_rate, offered, offered.counts, verdict.tokens)
        for depth, node in enumerate(offered.context_path(), start=1):
            if depth > len(verdict.tokens):
                break
            hit = float(offered.tokens[node] == verdict.tokens[depth - 1])
            self.context_rate[depth] += (1 - self.decay) * (hit - self.context_rate[depth])
            if not hit:
                break
        if offered.memory_total:
            self._learn_rates(self.memory_rate[offered.memory_match], offered, offered.memory_counts, verdict.tokens)
        keep = self.calibration_decay
        self._predicted = keep * self._predicted + choice.predicted
        self._realized = keep * self._realized + (len(verdict.nodes) if choice.predicted else 0)
        matched = verdict.tokens[: len(verdict.nodes)]
        window_credit = len(matched) if pool.found_by_window(key, matched) else 0
        self._window_credit = self.decay * self._window_credit + window_credit
        self._window_steps = self.decay * self._window_steps + float(choice.use_window)

    def _learn_rates(self, rates: list[float], tree: TokenTree, counts: list[int], accepted: list[int]) -> None:
        """Scores the nodes of one source (those with `counts`) down the accepted path, one rate per depth."""
        node = -1
        for depth, token in enumerate(accepted[: len(rates) - 1], start=1):
            children = {t: c for t, c in tree.children[node + 1].items() if counts[c]}
            if not children:
                return
            child = children.get(token)
            rates[depth] += (1 - self.decay) * (float(child is not None) - rates[depth])
            if child is None:
                return
            node = child


class AdaptiveStepPolicy:
    """
    Picks each step's content to maximise expected accepted tokens per unit of forward-pass time (the guide's
    "`lookahead_window="auto"`" section derives it), with what its `AcceptanceModel` learnt.

    - Expected tokens: 1, plus each verified node's probability of lying on the accepted path (calibrated), plus the
      window's gain where the step runs it. After `probe_every` steps without the window one step runs it anyway; a
      probe that does not win doubles the wait, up to `max_probe_every`.
    - Cost: what `StepPricing` says the step's length costs; where durations are reported, the call's second step
      is a timed one-token step they are judged against.

    Nodes sorted by probability make every prefix a subtree (a child is never likelier than its parent), so one
    pass over the prefixes, with and without the window, finds the best step.

    Args:
        pricing (`StepPricing`): what a step of T tokens (per row) costs, shared by the rows of a batch.
        window_length (`int`): tokens the window adds to a step (W x (N - 1)).
        levels, context_depth, memory_match, memory_depth: the `AcceptanceModel`'s.
        tuning (`AutoTuning`): the probes' waits, and the `AcceptanceModel`'s constants.
    """

    def __init__(
        self,
        pricing: StepPricing,
        window_length: int,
        levels: int,
        context_depth: int = 0,
        memory_match: int = 0,
        memory_depth: int = 0,
        tuning: AutoTuning = AUTO_TUNING,
    ):
        self.pricing = pricing
        self.window_length = window_length
        self.acceptance = AcceptanceModel(levels, context_depth, memory_match, memory_depth, tuning)
        self.probe_every = tuning.probe_every
        self.max_probe_every = max(tuning.max_probe_every, tuning.probe_every)
        self._probe_wait = tuning.probe_every
        self._steps_without_window = 0
        self._steps_planned = 0

    adapts = True

    @property
    def shape(self) -> tuple:
        """What estimates of another policy must match to be reused here (see `LookaheadState`)."""
        return (self.window_length, *self.acceptance.shape)

    def estimates(self) -> PolicyEstimates:
        """What this policy has learnt so far."""
        return self.acceptance.estimates(float(self._probe_wait))

    def start_from(self, estimates: PolicyEstimates) -> None:
        """Replaces the priors with estimates learnt earlier (by a policy of the same `shape`)."""
        self.acceptance.start_from(estimates)
        self._probe_wait = min(max(round(estimates.probe_wait), self.probe_every), self.max_probe_every)

    def offer(self, tree: TokenTree, window_allowed: bool, pending: int) -> StepOffer:
        """
        Prices every step this policy could take with `tree`: with or without the window, verifying the `count`
        likeliest nodes for every count.
        """
        raw = self.acceptance.raw_probabilities(tree)
        order = sorted(range(len(tree)), key=lambda node: -raw[node])
        probability = self.acceptance.calibrated(raw)
        options = []
        for use_window in [False, True] if window_allowed else [False]:
            expected = 1.0 + (self.acceptance.window_gain if use_window else 0.0)
            base = pending + (self.window_length if use_window else 0)
            for count in range(len(order) + 1):
                if count:
                    expected += probability[order[count - 1]]
                options.append(StepOption(base + count, expected, use_window, count))
        return StepOffer(tree, window_allowed, pending, tuple(options), tuple(order), tuple(raw))

    def plan(self, offer: StepOffer, budget: int | None = None) -> StepChoice:
        """
        The option with the most expected tokens per unit of cost; within `budget` tokens (the step length a batch
        settled on, which it pays for anyway), the one with the most expected tokens. After `probe_every` (or the
        learnt wait) steps without the window, the window runs as a probe.
        """
        self._steps_planned += 1
        if budget is None and self.pricing.wants_reference and self._steps_planned == _TIMED_ONE_TOKEN_STEP:
            # Every step's duration is judged against a one-token step's, and a table that prices long steps at about
            # one token would never choose one: the call's second step is one, once (its first may still warm up).
            return StepChoice.empty(offer)
        options = offer.options
        if budget is None:
            best = max(options, key=lambda option: option.expected / self.pricing(option.length))
        else:
            fitting = [option for option in options if option.length <= budget] or list(options[:1])
            best = max(fitting, key=lambda option: option.expected)
        use_window, count, probe = best.use_window, best.count, False
        if not use_window and offer.window_allowed and self._steps_without_window >= self._probe_wait:
            if budget is None:
                use_window = probe = True
            else:
                # Probe with the best step that holds the window and still fits the budget, if there is one.
                windowed = [option for option in options if option.use_window and option.length <= budget]
                if windowed:
                    count = max(windowed, key=lambda option: option.expected).count
                    use_window = probe = True
        nodes = list(offer.order[:count])
        predicted = sum(offer.probabilities[node] for node in nodes)
        return StepChoice(offer, use_window, offer.tree.subtree(nodes), predicted, probe)

    def observe(self, choice: StepChoice, verdict: Verdict, pool: NGramPool, key: int) -> None:
        """Learns from the step `choice` planned and its `verdict` (see `StepPolicy.observe`)."""
        self.acceptance.observe(choice, verdict, pool, key)
        window_used = choice.use_window
        self._steps_without_window = 0 if window_used else self._steps_without_window + 1
        if choice.probe:
            self._probe_wait = min(2 * self._probe_wait, self.max_probe_every)
        elif window_used:
            self._probe_wait = self.probe_every
