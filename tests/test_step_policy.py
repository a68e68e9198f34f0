import tempfile
import unittest

from transformers_lookahead import NGramPool
from transformers_lookahead.cost_model import StepCostModel, measure_step_costs
from transformers_lookahead.step_policy import (
    AdaptiveStepPolicy,
    EstimateMemory,
    PolicyEstimates,
    StaticStepPolicy,
    choose_window,
)
from transformers_lookahead.verification import Verdict

from .utils import tiny_model

FLAT = StepCostModel({1: 1.0, 64: 1.0})
STEEP = StepCostModel({1: 1.0, 2: 1.5, 8: 2.0, 64: 8.0})
MODEST = StepCostModel({1: 1.0, 2: 1.1, 8: 1.5, 64: 4.0})


def _tree():
    pool = NGramPool(continuation_length=2, max_per_key=3)
    pool.add(0, [1, 2])
    pool.add(0, [1, 3])
    pool.add(0, [4, 5])
    return pool.tree(0, 2)


class StepCostModelTest(unittest.TestCase):
    def test_interpolation_and_extrapolation(self):
        self.assertEqual(STEEP(1), 1.0)
        self.assertAlmostEqual(STEEP(5), 1.75)
        self.assertAlmostEqual(STEEP(36), 5.0)
        self.assertAlmostEqual(STEEP(72), 8.0 + 8 * 6 / 56)

    def test_batch_cost_is_the_cost_of_all_rows_tokens(self):
        batch = STEEP.for_batch(4)
        self.assertEqual(batch(1), 1.0)
        self.assertAlmostEqual(batch(2), STEEP(8) / STEEP(4))
        self.assertAlmostEqual(batch(9), STEEP(36) / STEEP(4))
        self.assertIs(STEEP.for_batch(1), STEEP)

    def test_measure_and_cache(self):
        model = tiny_model("llama")
        costs = measure_step_costs(model, grid=(1, 2, 4))
        self.assertEqual(sorted(costs), [1, 2, 4])
        self.assertEqual(costs[1], 1.0)
        with tempfile.TemporaryDirectory() as tmp:
            first = StepCostModel.for_model(model, cache_dir=tmp)
            second = StepCostModel.for_model(model, cache_dir=tmp)  # read back, not measured again
        self.assertEqual(first.costs, second.costs)


class StepPolicyTest(unittest.TestCase):
    def test_static_policy_keeps_everything(self):
        tree = _tree()
        self.assertEqual(StaticStepPolicy().plan(tree, True, 1), (True, tree))

    def test_window_width_follows_cost(self):
        self.assertEqual(choose_window(FLAT, 4, 16), 16)
        self.assertEqual(choose_window(STEEP, 4, 16), 1)

    def test_flat_cost_verifies_everything(self):
        policy = AdaptiveStepPolicy(FLAT, window_length=8, levels=2)
        use_window, tree = policy.plan(_tree(), True, 1)
        self.assertTrue(use_window)
        self.assertEqual(len(tree), 5)

    def test_steep_cost_and_misses_verify_nothing(self):
        policy = AdaptiveStepPolicy(STEEP, window_length=8, levels=2)
        for _ in range(30):
            policy.plan(_tree(), True, 1)
            policy.observe(
                _tree(), Verdict([9], [], [], []), False, NGramPool(2, 3), 0
            )  # the model never follows the pool
        use_window, tree = policy.plan(_tree(), False, 1)
        self.assertFalse(use_window)
        self.assertEqual(len(tree), 0)
        self.assertLess(policy.match_rate[1], 0.05)

    def test_matches_raise_the_estimate_even_when_nothing_was_verified(self):
        policy = AdaptiveStepPolicy(STEEP, window_length=8, levels=2)
        tree = _tree()
        for _ in range(30):
            policy.plan(tree, False, 1)
            # Nothing verified (no nodes matched), but the accepted token equals a pooled candidate.
            policy.observe(tree.subtree([]), Verdict([1], [], [], []), False, NGramPool(2, 3), 0)
        self.assertGreater(policy.match_rate[1], 0.9)
        _, planned = policy.plan(tree, False, 1)
        self.assertIn(1, planned.tokens)

    def test_a_batch_budget_is_filled_by_likeliest_nodes(self):
        policy = AdaptiveStepPolicy(STEEP, window_length=8, levels=2)
        tree = _tree()
        options = policy.step_options(tree, True, 1)
        self.assertIn((1, 1.0), options)
        self.assertEqual(max(length for length, _ in options), 1 + 8 + len(tree))
        # Alone, a steep cost verifies little; a batch that pays for 4 tokens per row verifies 3 nodes.
        use_window, planned = policy.plan(tree, True, 1, budget=4)
        self.assertFalse(use_window)
        self.assertEqual(len(planned), 3)
        probability = policy.node_probabilities(tree)
        kept = sorted(range(len(tree)), key=lambda node: -probability[node])[:3]
        self.assertEqual(sorted(planned.tokens), sorted(tree.tokens[node] for node in kept))

    def test_a_window_probe_stays_within_the_budget(self):
        policy = AdaptiveStepPolicy(STEEP, window_length=8, levels=2, probe_every=0)
        tree = _tree()
        use_window, planned = policy.plan(tree, True, 1, budget=10)
        self.assertTrue(use_window)
        self.assertLessEqual(1 + 8 + len(planned), 10)
        use_window, planned = policy.plan(tree, True, 1, budget=6)
        self.assertFalse(use_window, "a window of 8 cannot fit in 6 tokens")
        self.assertLessEqual(1 + len(planned), 6)

    def test_node_probabilities_follow_pool_shares(self):
        policy = AdaptiveStepPolicy(FLAT, window_length=8, levels=2)
        tree = _tree()
        probability = policy.node_probabilities(tree)
        one, four = tree.child(-1, 1), tree.child(-1, 4)
        self.assertAlmostEqual(probability[one], 2 * probability[four])
        two = tree.child(one, 2)
        self.assertLess(probability[two], probability[one])


class EstimateMemoryTest(unittest.TestCase):
    def _learnt_policy(self) -> AdaptiveStepPolicy:
        policy = AdaptiveStepPolicy(STEEP, window_length=8, levels=2, context_depth=3)
        for _ in range(10):
            policy.plan(_tree(), True, 1)
            policy.observe(_tree(), Verdict([9], [], [], []), True, NGramPool(2, 3), 0)
        return policy

    def test_a_new_policy_starts_from_learnt_estimates(self):
        learnt = self._learnt_policy()
        fresh = AdaptiveStepPolicy(MODEST, window_length=8, levels=2, context_depth=3)
        # The priors verify the likeliest pooled candidate...
        self.assertGreater(len(fresh.plan(_tree(), False, 1)[1]), 0)
        self.assertNotEqual(fresh.estimates(), learnt.estimates())
        fresh.start_from(learnt.estimates())
        self.assertEqual(fresh.estimates(), learnt.estimates())
        # ...what was learnt says they never match.
        self.assertEqual(len(fresh.plan(_tree(), False, 1)[1]), 0)

    def test_mean(self):
        a = PolicyEstimates((0.2, 0.4), (1.0,), 2.0, 4.0)
        b = PolicyEstimates((0.4, 0.0), (0.0,), 0.0, 2.0)
        self.assertEqual(PolicyEstimates.mean([a, b]), PolicyEstimates((0.30000000000000004, 0.2), (0.5,), 1.0, 3.0))

    def test_memory_is_per_model_and_shape(self):
        memory = EstimateMemory()
        first, second = tiny_model("llama"), tiny_model("llama")
        policy = self._learnt_policy()
        memory.remember(first, policy.shape, policy.estimates())
        self.assertEqual(memory.recall(first, policy.shape), policy.estimates())
        self.assertIsNone(memory.recall(second, policy.shape))
        other_shape = AdaptiveStepPolicy(STEEP, window_length=4, levels=2, context_depth=3).shape
        self.assertIsNone(memory.recall(first, other_shape))
        del first
        import gc

        gc.collect()
        self.assertEqual(len(memory._by_model), 0, "the memory must not keep a model alive")
