import dataclasses
import unittest

from transformers_lookahead.adaptive_policy import AdaptiveStepPolicy, PolicyEstimates, choose_window
from transformers_lookahead.auto_tuning import AUTO_TUNING
from transformers_lookahead.cost_model import StepCostModel, StepPricing
from transformers_lookahead.ngram_pool import NGramPool
from transformers_lookahead.step_policy import StaticStepPolicy, StepChoice
from transformers_lookahead.token_tree import TokenTree
from transformers_lookahead.verification import Verdict

FLAT = StepCostModel({1: 1.0, 64: 1.0})
STEEP = StepCostModel({1: 1.0, 2: 1.5, 8: 2.0, 64: 8.0})
MODEST = StepCostModel({1: 1.0, 2: 1.1, 8: 1.5, 64: 4.0})


def _tree():
    pool = NGramPool(continuation_length=2, max_per_key=3)
    pool.add(0, [1, 2])
    pool.add(0, [1, 3])
    pool.add(0, [4, 5])
    return pool.tree(0, 2)


def _plan(policy, tree: TokenTree, window_allowed: bool = True, budget: int | None = None) -> StepChoice:
    """What `policy` verifies of `tree` in a step with one pending token."""
    return policy.plan(policy.offer(tree, window_allowed, 1), budget)


def _unverified(policy, tree: TokenTree, window_used: bool = False) -> StepChoice:
    """A step that offered `tree` and verified none of it (a batch's one-token step)."""
    return StepChoice(policy.offer(tree, window_used, 1), window_used, tree.subtree([]))


class StepPolicyTest(unittest.TestCase):
    def test_static_policy_keeps_everything(self):
        tree = _tree()
        policy = StaticStepPolicy(window_length=8)
        choice = _plan(policy, tree)
        self.assertEqual((choice.use_window, choice.tree), (True, tree))
        self.assertEqual([option.length for option in choice.offer.options], [1 + 8 + len(tree)])
        self.assertIs(_plan(policy, tree, budget=2).tree, tree, "a fixed shape ignores a batch's budget")

    def test_window_width_follows_cost(self):
        self.assertEqual(choose_window(FLAT, 4, dataclasses.replace(AUTO_TUNING, max_window=16)), 16)
        self.assertEqual(choose_window(STEEP, 4, dataclasses.replace(AUTO_TUNING, max_window=16)), 1)

    def test_flat_cost_verifies_everything(self):
        policy = AdaptiveStepPolicy(StepPricing(FLAT), window_length=8, levels=2)
        choice = _plan(policy, _tree())
        self.assertTrue(choice.use_window)
        self.assertEqual(len(choice.tree), 5)

    def test_steep_cost_and_misses_verify_nothing(self):
        policy = AdaptiveStepPolicy(StepPricing(STEEP), window_length=8, levels=2)
        for _ in range(30):
            # The model never follows the pool.
            policy.observe(_plan(policy, _tree()), Verdict([9], [], [], []), NGramPool(2, 3), 0)
        choice = _plan(policy, _tree(), window_allowed=False)
        self.assertFalse(choice.use_window)
        self.assertEqual(len(choice.tree), 0)
        self.assertLess(policy.acceptance.match_rate[1], 0.05)

    def test_matches_raise_the_estimate_even_when_nothing_was_verified(self):
        policy = AdaptiveStepPolicy(StepPricing(STEEP), window_length=8, levels=2)
        tree = _tree()
        for _ in range(30):
            # Nothing verified, but the accepted token equals a pooled candidate.
            policy.observe(_unverified(policy, tree), Verdict([1], [], [], []), NGramPool(2, 3), 0)
        self.assertGreater(policy.acceptance.match_rate[1], 0.9)
        self.assertIn(1, _plan(policy, tree, window_allowed=False).tree.tokens)

    def test_a_batch_budget_is_filled_by_likeliest_nodes(self):
        policy = AdaptiveStepPolicy(StepPricing(STEEP), window_length=8, levels=2)
        tree = _tree()
        options = policy.offer(tree, True, 1).options
        self.assertIn((1, 1.0), [(option.length, option.expected) for option in options])
        self.assertEqual(max(option.length for option in options), 1 + 8 + len(tree))
        # Alone, a steep cost verifies little; a batch that pays for 4 tokens per row verifies 3 nodes.
        choice = _plan(policy, tree, budget=4)
        self.assertFalse(choice.use_window)
        planned = choice.tree
        self.assertEqual(len(planned), 3)
        probability = policy.acceptance.node_probabilities(tree)
        kept = sorted(range(len(tree)), key=lambda node: -probability[node])[:3]
        self.assertEqual(sorted(planned.tokens), sorted(tree.tokens[node] for node in kept))

    def test_a_window_probe_stays_within_the_budget(self):
        policy = AdaptiveStepPolicy(
            StepPricing(STEEP), window_length=8, levels=2, tuning=dataclasses.replace(AUTO_TUNING, probe_every=0)
        )
        tree = _tree()
        choice = _plan(policy, tree, budget=10)
        self.assertTrue(choice.use_window)
        self.assertLessEqual(1 + 8 + len(choice.tree), 10)
        choice = _plan(policy, tree, budget=6)
        self.assertFalse(choice.use_window, "a window of 8 cannot fit in 6 tokens")
        self.assertLessEqual(1 + len(choice.tree), 6)

    def test_probes_that_do_not_pay_come_less_often(self):
        tuning = dataclasses.replace(AUTO_TUNING, probe_every=32, max_probe_every=128)
        policy = AdaptiveStepPolicy(StepPricing(STEEP), window_length=8, levels=2, tuning=tuning)
        probes = []
        for step in range(700):
            choice = _plan(policy, _tree())
            if choice.use_window:
                probes.append(step)
            policy.observe(choice, Verdict([9], [], [], []), NGramPool(2, 3), 0)
        gaps = [later - earlier for earlier, later in zip(probes, probes[1:])]
        self.assertEqual(probes[0], 32)
        self.assertEqual(gaps[:4], [65, 129, 129, 129], "the wait doubles up to its maximum")
        self.assertEqual(policy.estimates().probe_wait, 128.0)
        # A window worth running resets the wait, and a new call starts from the wait learnt.
        policy.start_from(dataclasses.replace(policy.estimates(), window_credit=5.0, window_steps=1.0))
        choice = _plan(policy, _tree())
        self.assertTrue(choice.use_window and not choice.probe)
        self.assertEqual(policy.estimates().probe_wait, 128.0, "planning alone changes nothing")
        policy.observe(choice, Verdict([9], [], [], []), NGramPool(2, 3), 0)
        self.assertEqual(policy.estimates().probe_wait, 32.0)
        fresh = AdaptiveStepPolicy(StepPricing(STEEP), window_length=8, levels=2)
        fresh.start_from(dataclasses.replace(fresh.estimates(), probe_wait=128.0))
        windows = 0
        for _ in range(100):
            choice = _plan(fresh, _tree())
            windows += choice.use_window
            fresh.observe(choice, Verdict([9], [], [], []), NGramPool(2, 3), 0)
        self.assertEqual(windows, 0)

    def test_node_probabilities_follow_pool_shares(self):
        policy = AdaptiveStepPolicy(StepPricing(FLAT), window_length=8, levels=2)
        tree = _tree()
        probability = policy.acceptance.node_probabilities(tree)
        one, four = tree.child(-1, 1), tree.child(-1, 4)
        self.assertAlmostEqual(probability[one], 2 * probability[four])
        two = tree.child(one, 2)
        self.assertLess(probability[two], probability[one])

    def test_memory_nodes_follow_their_counts_and_learnt_rate(self):
        policy = AdaptiveStepPolicy(StepPricing(FLAT), window_length=8, levels=2, memory_match=3, memory_depth=4)
        tree = TokenTree()
        tree.add_memory(2, ((1, 2), (1, 2), (1, 3), (4,)), max_nodes=10)
        probability = policy.acceptance.node_probabilities(tree)
        one, four = tree.child(-1, 1), tree.child(-1, 4)
        self.assertAlmostEqual(probability[one], 0.5 * 3 / 4)
        self.assertAlmostEqual(probability[four], 0.5 * 1 / 4)
        self.assertAlmostEqual(probability[tree.child(one, 2)], probability[one] * 0.5 * 2 / 3)
        for _ in range(40):
            policy.observe(_unverified(policy, tree), Verdict([1, 2, 9], [0, 1], [], []), NGramPool(2, 3), 0)
        self.assertGreater(policy.acceptance.memory_rate[2][1], 0.95)
        self.assertGreater(policy.acceptance.memory_rate[2][2], 0.95)
        self.assertEqual(policy.acceptance.memory_rate[3][1], 0.5, "rates are learnt per match length")
        for _ in range(40):
            policy.observe(_unverified(policy, tree), Verdict([9], [], [], []), NGramPool(2, 3), 0)
        self.assertLess(policy.acceptance.memory_rate[2][1], 0.05)
        fresh = AdaptiveStepPolicy(StepPricing(MODEST), 8, 2, memory_match=3, memory_depth=4)
        self.assertGreater(len(_plan(fresh, tree, False).tree), 0, "the prior verifies the likeliest continuation")
        policy.pricing.use_table(MODEST)
        self.assertEqual(len(_plan(policy, tree, False).tree), 0, "a memory that misses is not verified")


class CalibrationTest(unittest.TestCase):
    def _policy(self, predicted: float = 0.0, realized: float = 0.0) -> AdaptiveStepPolicy:
        policy = AdaptiveStepPolicy(StepPricing(MODEST), window_length=8, levels=2)
        policy.start_from(dataclasses.replace(policy.estimates(), predicted=predicted, realized=realized))
        return policy

    def test_probabilities_are_scaled_by_accepted_over_predicted(self):
        tree = _tree()
        raw = self._policy().acceptance.node_probabilities(tree)
        self.assertEqual(self._policy().acceptance.calibration, 1.0)
        doubtful = self._policy(predicted=9.0, realized=2.0)
        self.assertAlmostEqual(doubtful.acceptance.calibration, 3.0 / 10.0)
        for scaled, unscaled in zip(doubtful.acceptance.node_probabilities(tree), raw):
            self.assertAlmostEqual(scaled, 0.3 * unscaled)
        confident = self._policy(predicted=1.0, realized=19.0)
        self.assertEqual(confident.acceptance.calibration, 10.0)
        self.assertEqual(max(confident.acceptance.node_probabilities(tree)), 1.0, "a probability never exceeds 1")
        # The same tree, the same per-depth estimates: fewer nodes when verified nodes used to miss.
        self.assertLess(len(_plan(doubtful, tree, False).tree), len(_plan(self._policy(), tree, False).tree))
        self.assertEqual(len(_plan(doubtful, tree, False).tree), 0)

    def test_verified_steps_update_the_sums(self):
        policy = AdaptiveStepPolicy(StepPricing(FLAT), window_length=8, levels=2)
        tree = _tree()
        raw = policy.acceptance.node_probabilities(tree)
        choice = _plan(policy, tree, False)
        self.assertEqual(len(choice.tree), len(tree), "a flat cost verifies every node")
        self.assertAlmostEqual(choice.predicted, sum(raw), msg="the plan carries the probability it was chosen with")
        one = tree.child(-1, 1)
        policy.observe(choice, Verdict([1, 2, 9], [one, tree.child(one, 2)], [], []), NGramPool(2, 3), 0)
        estimates = policy.estimates()
        self.assertAlmostEqual(estimates.predicted, sum(raw))
        self.assertEqual(estimates.realized, 2.0)
        # A step that verified nothing only decays both sums.
        policy.observe(_unverified(policy, tree), Verdict([1], [], [], []), NGramPool(2, 3), 0)
        self.assertAlmostEqual(policy.estimates().predicted, 0.95 * sum(raw))
        self.assertAlmostEqual(policy.estimates().realized, 0.95 * 2.0)

    def test_misses_stop_verification_then_it_is_tried_again(self):
        policy = AdaptiveStepPolicy(StepPricing(MODEST), window_length=8, levels=2)
        tree = _tree()
        steps_with_nodes = []
        for step in range(200):
            choice = _plan(policy, tree, False)
            if len(choice.tree):
                steps_with_nodes.append(step)
            # The mechanism alone: the verdict credits no verified node, while the accepted token is one the pool
            # offered, so the per-depth estimate keeps rising and only the calibration sees the misses.
            policy.observe(choice, Verdict([4], [], [], []), NGramPool(2, 3), 0)
        self.assertGreater(policy.acceptance.match_rate[1], 0.9)
        self.assertLess(len(steps_with_nodes), 100, "misses lower the calibration: most steps verify nothing")
        self.assertGreater(steps_with_nodes[-1], 150, "and verification is tried again as the sums decay")


class PolicyEstimatesTest(unittest.TestCase):
    def _learnt_policy(self) -> AdaptiveStepPolicy:
        policy = AdaptiveStepPolicy(StepPricing(STEEP), window_length=8, levels=2, context_depth=3)
        for _ in range(10):
            policy.observe(
                _unverified(policy, _tree(), window_used=True), Verdict([9], [], [], []), NGramPool(2, 3), 0
            )
        return policy

    def test_a_new_policy_starts_from_learnt_estimates(self):
        learnt = self._learnt_policy()
        fresh = AdaptiveStepPolicy(StepPricing(MODEST), window_length=8, levels=2, context_depth=3)
        # The priors verify the likeliest pooled candidate...
        self.assertGreater(len(_plan(fresh, _tree(), False).tree), 0)
        self.assertNotEqual(fresh.estimates(), learnt.estimates())
        fresh.start_from(learnt.estimates())
        self.assertEqual(fresh.estimates(), learnt.estimates())
        # ...what was learnt says they never match.
        self.assertEqual(len(_plan(fresh, _tree(), False).tree), 0)

    def test_mean(self):
        # Binary fractions, so the expected means are exact.
        a = PolicyEstimates((0.25, 0.5), (1.0,), 2.0, 4.0)
        b = PolicyEstimates((0.75, 0.0), (0.0,), 0.0, 2.0)
        self.assertEqual(PolicyEstimates.mean([a, b]), PolicyEstimates((0.5, 0.25), (0.5,), 1.0, 3.0))
        c = PolicyEstimates((0.25,), (1.0,), 2.0, 4.0, ((0.5, 1.0), (0.25, 0.0)))
        d = PolicyEstimates((0.75,), (0.0,), 0.0, 2.0, ((0.0, 0.5), (0.75, 1.0)))
        self.assertEqual(PolicyEstimates.mean([c, d]).memory_rate, ((0.25, 0.75), (0.5, 0.5)))


class TimedPricingTest(unittest.TestCase):
    """A policy whose pricing is told step durations makes one one-token step for them to be judged against."""

    def test_a_timed_policy_makes_its_second_step_a_one_token_step_once(self):
        policy = AdaptiveStepPolicy(StepPricing(FLAT, timed=True), window_length=8, levels=2)
        first, second, third = (_plan(policy, _tree()) for _ in range(3))
        self.assertTrue(first.use_window and len(first.tree) == 5, "a flat table verifies everything")
        self.assertFalse(second.use_window)
        self.assertEqual(len(second.tree), 0)
        self.assertTrue(third.use_window and len(third.tree) == 5, "only once, even if no duration was reported")

    def test_no_one_token_step_is_forced_once_one_was_timed_or_without_timing(self):
        timed = AdaptiveStepPolicy(StepPricing(FLAT, timed=True), window_length=8, levels=2)
        timed.pricing.observe(1, 0.010)
        untimed = AdaptiveStepPolicy(StepPricing(FLAT), window_length=8, levels=2)
        for policy in (timed, untimed):
            choices = [_plan(policy, _tree()) for _ in range(3)]
            self.assertTrue(all(choice.use_window and len(choice.tree) == 5 for choice in choices))

    def test_a_batch_budget_is_not_overridden(self):
        policy = AdaptiveStepPolicy(StepPricing(FLAT, timed=True), window_length=8, levels=2)
        choices = [_plan(policy, _tree(), budget=20) for _ in range(3)]
        self.assertTrue(all(choice.use_window for choice in choices))
