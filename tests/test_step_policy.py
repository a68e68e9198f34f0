import dataclasses
import json
import os
import tempfile
import unittest
from pathlib import Path
from unittest import mock

from transformers_lookahead.cost_model import (
    COST_DIR_VARIABLE,
    EngineStepCost,
    StepCostModel,
    _non_decreasing,
    default_cost_dir,
    measure_step_costs,
)
from transformers_lookahead.ngram_pool import NGramPool
from transformers_lookahead.step_policy import (
    AdaptiveStepPolicy,
    PolicyEstimates,
    StaticStepPolicy,
    StepChoice,
    choose_window,
)
from transformers_lookahead.suffix_memory import MemoryMatch
from transformers_lookahead.token_tree import TokenTree
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


def _plan(policy, tree: TokenTree, window_allowed: bool = True, budget: int | None = None) -> StepChoice:
    """What `policy` verifies of `tree` in a step with one pending token."""
    return policy.plan(policy.offer(tree, window_allowed, 1), budget)


def _unverified(policy, tree: TokenTree, window_used: bool = False) -> StepChoice:
    """A step that offered `tree` and verified none of it (a batch's one-token step)."""
    return StepChoice(policy.offer(tree, window_used, 1), window_used, tree.subtree([]))


class StepCostModelTest(unittest.TestCase):
    def test_interpolation_and_extrapolation(self):
        self.assertEqual(STEEP(1), 1.0)
        self.assertAlmostEqual(STEEP(5), 1.75)
        self.assertAlmostEqual(STEEP(36), 5.0)
        self.assertAlmostEqual(STEEP(72), 8.0 + 8 * 6 / 56)

    def test_a_measured_dip_is_noise(self):
        self.assertEqual(_non_decreasing([1.0, 1.75, 1.25, 1.5, 2.0]), [1.0, 1.5, 1.5, 1.5, 2.0])
        self.assertEqual(_non_decreasing([1.0, 1.5, 2.0]), [1.0, 1.5, 2.0])

    def test_batch_cost_is_the_cost_of_all_rows_tokens(self):
        batch = STEEP.for_batch(4)
        self.assertEqual(batch(1), 1.0)
        self.assertAlmostEqual(batch(2), STEEP(8) / STEEP(4))
        self.assertAlmostEqual(batch(9), STEEP(36) / STEEP(4))
        self.assertIs(STEEP.for_batch(1), STEEP)

    def test_measure_and_keep(self):
        model = tiny_model("llama")
        costs = measure_step_costs(model, grid=(1, 2, 4, 8))
        self.assertEqual(sorted(costs), [1, 2, 4, 8])
        self.assertEqual(costs[1], 1.0)
        self.assertEqual([costs[length] for length in (1, 2, 4, 8)], sorted(costs.values()), "never decreasing")
        with tempfile.TemporaryDirectory() as tmp, self._counting() as measure:
            StepCostModel.for_model(model, tmp)
            self.assertEqual(measure.call_count, 1)
            StepCostModel.for_model(model, tmp)
            self.assertEqual(measure.call_count, 1, "a kept table is read back, not measured again")
            (table,) = Path(tmp).glob("step-cost-*.json")
            table.write_text("{not json")
            StepCostModel.for_model(model, tmp)
            self.assertEqual(measure.call_count, 2, "a corrupt table is measured again")
            self.assertIn("relative_costs", json.loads(table.read_text()), "and replaced")
            table.write_text(json.dumps({"relative_costs": {"1": 1.0, "2": 1.5}}))
            StepCostModel.for_model(model, tmp)
            self.assertEqual(measure.call_count, 3, "a table measured the old way is measured again")
            StepCostModel.for_model(model, None)
            self.assertEqual(measure.call_count, 4, "without a directory every request measures")

    def test_unwritable_directory_is_harmless(self):
        model = tiny_model("llama")
        with tempfile.TemporaryDirectory() as tmp, self._counting() as measure:
            blocker = Path(tmp) / "a_file"
            blocker.write_text("")
            # A directory below a regular file can be neither created nor written, even by root.
            with self.assertLogs("transformers_lookahead.cost_model", level="WARNING") as logs:
                costs = StepCostModel.for_model(model, blocker / "tables")
            self.assertEqual(costs(1), 1.0)
            self.assertEqual(measure.call_count, 1)
            self.assertEqual(len(logs.output), 2, logs.output)
            self.assertIn("measuring the cost of forward passes", logs.output[0])
            self.assertIn(COST_DIR_VARIABLE, logs.output[1])

    def test_a_measurement_is_announced_with_where_the_table_goes(self):
        model = tiny_model("llama")
        with tempfile.TemporaryDirectory() as tmp, self._counting():
            with self.assertLogs("transformers_lookahead.cost_model", level="WARNING") as logs:
                StepCostModel.for_model(model, tmp)
            (table,) = Path(tmp).glob("step-cost-*.json")
            self.assertIn("84 forward passes", logs.output[0])
            self.assertIn(str(table), logs.output[0])
            self.assertIn("LookaheadState().cost_model(model)", logs.output[0], "how to measure ahead")
            with self.assertNoLogs("transformers_lookahead.cost_model", level="WARNING"):
                StepCostModel.for_model(model, tmp)

    def test_default_directory(self):
        with mock.patch.dict(os.environ, {COST_DIR_VARIABLE: "/somewhere/tables"}):
            self.assertEqual(default_cost_dir(), Path("/somewhere/tables"))
        with mock.patch.dict(os.environ, {COST_DIR_VARIABLE: "off"}):
            self.assertIsNone(default_cost_dir())
        environment = {k: v for k, v in os.environ.items() if k != COST_DIR_VARIABLE}
        with mock.patch.dict(os.environ, {**environment, "HF_HOME": "/hf"}, clear=True):
            self.assertEqual(default_cost_dir(), Path("/hf/lookahead/step_costs"))

    @staticmethod
    def _counting():
        return mock.patch(
            "transformers_lookahead.cost_model.measure_step_costs",
            side_effect=lambda model, encoder_outputs=None: measure_step_costs(model, (1, 2, 4)),
        )


class EngineStepCostTest(unittest.TestCase):
    @staticmethod
    def _engine(seconds, steps=64, table=STEEP) -> EngineStepCost:
        """An engine cost fitted to `steps` steps of several shapes timed by `seconds(queries, keys, verified)`."""
        cost = EngineStepCost(table, steps_kept=64, steps_needed=16)
        shapes = [
            (queries, keys, verified)
            for queries, verified in [(1, 0), (2, 1), (4, 0), (8, 2), (16, 0), (64, 8), (300, 0)]
            for keys in (100, 900, 2500)
        ]
        for index in range(steps):
            queries, keys, verified = shapes[index % len(shapes)]
            cost.observe(queries, keys, verified, seconds(queries, keys, verified))
        return cost

    def test_history_gives_a_new_engine_the_fit(self):
        def seconds(queries, keys, verified):
            return 0.01 + 0.02 * STEEP(queries) + 3e-3 * verified

        earlier = self._engine(seconds, steps=80)
        history = earlier.history()
        self.assertEqual(len(history), 64, "only the steps the fit uses are kept")
        later = EngineStepCost(STEEP, steps_kept=64, steps_needed=16, history=history)
        self.assertEqual(later.seconds(12, 2000, 4), earlier.seconds(12, 2000, 4))
        self.assertIsNone(EngineStepCost(STEEP, steps_kept=64, steps_needed=16).seconds(12, 2000, 4))
        # The new engine's own steps replace the earlier ones as they come.
        later.observe(1, 100, 0, 0.5)
        self.assertEqual(later.history()[-1][-1], 0.5)
        self.assertEqual(len(later.history()), 64)

    def test_fits_the_engine_steps(self):
        def seconds(queries, keys, verified):
            return (
                0.01 + 0.02 * STEEP(queries) + 1e-4 * queries + 2e-6 * keys + 1e-7 * queries * keys + 3e-3 * verified
            )

        cost = self._engine(seconds)
        for queries, keys, verified in [(3, 500, 0), (12, 2000, 4), (100, 1200, 16)]:
            self.assertAlmostEqual(cost.seconds(queries, keys, verified), seconds(queries, keys, verified), places=6)
        relative = cost.for_batch(4, 2000)
        self.assertAlmostEqual(relative(1), 1.0)
        # A step of 3 tokens per request verifies all 4 requests; the one-token step it is compared with, none.
        self.assertAlmostEqual(relative(3), seconds(12, 2012, 4) / seconds(4, 2004, 0), places=6)

    def test_host_work_per_verified_request_is_priced(self):
        # Forward passes cost the same whatever they hold; each request a step verifies costs 4 ms on the host.
        cost = self._engine(lambda queries, keys, verified: 0.05 + 0.004 * verified)
        relative = cost.for_batch(16, 1000)
        self.assertAlmostEqual(relative(1), 1.0, places=6)
        self.assertAlmostEqual(relative(2), (0.05 + 16 * 0.004) / 0.05, places=4)
        self.assertAlmostEqual(relative(8), relative(2), places=4)
        # A lone request pays for its verification once: still cheap next to a pass.
        self.assertAlmostEqual(cost.for_batch(1, 100)(8), (0.05 + 0.004) / 0.05, places=4)

    def test_fits_relative_errors(self):
        # Long prefill chunks whose time grows faster than the features follow (attention within the chunk) beside
        # decoding steps that follow them: the decoding steps, which the fit prices, stay within 2%. Fitted on
        # absolute errors, the chunks' residuals (tens of ms) outweigh every decoding step's, and the one-token step
        # came out 10% low.
        def formula(queries, keys, verified):
            return 0.02 + 0.01 * STEEP(queries) + 2e-6 * keys + 1e-3 * verified

        cost = EngineStepCost(STEEP, steps_kept=64, steps_needed=16)
        for _ in range(4):
            for queries, verified in [(8, 0), (16, 0), (32, 16), (48, 16)]:
                for keys in (500, 2000):
                    cost.observe(queries, keys, verified, formula(queries, keys, verified))
            for queries, keys in [(512, 600), (1024, 1100), (768, 2000), (900, 1500)]:
                cost.observe(queries, keys, 0, formula(queries, keys, 0) + 2e-7 * queries**2)
        for queries, keys, verified in [(16, 800, 0), (32, 1600, 16), (48, 1000, 16)]:
            error = cost.seconds(queries, keys, verified) / formula(queries, keys, verified) - 1
            self.assertLess(abs(error), 0.02, (queries, keys, verified))

    def test_prices_with_nothing_until_enough_steps(self):
        cost = self._engine(lambda queries, keys, verified: 0.05, steps=15)
        self.assertIsNone(cost.seconds(4, 100))
        self.assertIsNone(cost.for_batch(4, 100))
        cost.observe(1, 100, 0, 0.05)
        # A fixed time per step: extra tokens are free, whatever the table says.
        self.assertAlmostEqual(cost.for_batch(4, 100)(8), 1.0, places=6)

    def test_no_coefficient_is_negative(self):
        # Times that fall with the keys would fit a negative coefficient: it is dropped, never extrapolated.
        cost = self._engine(lambda queries, keys, verified: 0.05 + 1e-3 * queries - 1e-5 * keys)
        # The fit as it stands would reach zero at 5,100 keys.
        self.assertGreater(cost.seconds(1, 20000), 0.0)
        relative = cost.for_batch(2, 500)
        self.assertGreaterEqual(relative(4), relative(2))
        self.assertGreaterEqual(relative(2), relative(1))

    def test_follows_the_latest_steps(self):
        cost = self._engine(lambda queries, keys, verified: 0.05)
        self.assertAlmostEqual(cost.for_batch(1, 100)(16), 1.0, places=6)
        for queries in [1, 8, 16, 32] * 16:
            cost.observe(queries, 100, 0, 0.01 * queries)
        # Only the latest 64 steps count: each token now costs as much as the first.
        self.assertAlmostEqual(cost.seconds(16, 100) / cost.seconds(1, 100), 16.0, places=3)

    def test_refuses_an_impossible_window(self):
        with self.assertRaisesRegex(ValueError, "steps_needed"):
            EngineStepCost(FLAT, steps_kept=8, steps_needed=16)


class StepPolicyTest(unittest.TestCase):
    def test_static_policy_keeps_everything(self):
        tree = _tree()
        policy = StaticStepPolicy(window_length=8)
        choice = _plan(policy, tree)
        self.assertEqual((choice.use_window, choice.tree), (True, tree))
        self.assertEqual([option.length for option in choice.offer.options], [1 + 8 + len(tree)])
        self.assertIs(_plan(policy, tree, budget=2).tree, tree, "a fixed shape ignores a batch's budget")

    def test_window_width_follows_cost(self):
        self.assertEqual(choose_window(FLAT, 4, 16), 16)
        self.assertEqual(choose_window(STEEP, 4, 16), 1)

    def test_flat_cost_verifies_everything(self):
        policy = AdaptiveStepPolicy(FLAT, window_length=8, levels=2)
        choice = _plan(policy, _tree())
        self.assertTrue(choice.use_window)
        self.assertEqual(len(choice.tree), 5)

    def test_steep_cost_and_misses_verify_nothing(self):
        policy = AdaptiveStepPolicy(STEEP, window_length=8, levels=2)
        for _ in range(30):
            # The model never follows the pool.
            policy.observe(_plan(policy, _tree()), Verdict([9], [], [], []), NGramPool(2, 3), 0)
        choice = _plan(policy, _tree(), window_allowed=False)
        self.assertFalse(choice.use_window)
        self.assertEqual(len(choice.tree), 0)
        self.assertLess(policy.match_rate[1], 0.05)

    def test_matches_raise_the_estimate_even_when_nothing_was_verified(self):
        policy = AdaptiveStepPolicy(STEEP, window_length=8, levels=2)
        tree = _tree()
        for _ in range(30):
            # Nothing verified, but the accepted token equals a pooled candidate.
            policy.observe(_unverified(policy, tree), Verdict([1], [], [], []), NGramPool(2, 3), 0)
        self.assertGreater(policy.match_rate[1], 0.9)
        self.assertIn(1, _plan(policy, tree, window_allowed=False).tree.tokens)

    def test_a_batch_budget_is_filled_by_likeliest_nodes(self):
        policy = AdaptiveStepPolicy(STEEP, window_length=8, levels=2)
        tree = _tree()
        options = policy.offer(tree, True, 1).options
        self.assertIn((1, 1.0), [(option.length, option.expected) for option in options])
        self.assertEqual(max(option.length for option in options), 1 + 8 + len(tree))
        # Alone, a steep cost verifies little; a batch that pays for 4 tokens per row verifies 3 nodes.
        choice = _plan(policy, tree, budget=4)
        self.assertFalse(choice.use_window)
        planned = choice.tree
        self.assertEqual(len(planned), 3)
        probability = policy.node_probabilities(tree)
        kept = sorted(range(len(tree)), key=lambda node: -probability[node])[:3]
        self.assertEqual(sorted(planned.tokens), sorted(tree.tokens[node] for node in kept))

    def test_a_window_probe_stays_within_the_budget(self):
        policy = AdaptiveStepPolicy(STEEP, window_length=8, levels=2, probe_every=0)
        tree = _tree()
        choice = _plan(policy, tree, budget=10)
        self.assertTrue(choice.use_window)
        self.assertLessEqual(1 + 8 + len(choice.tree), 10)
        choice = _plan(policy, tree, budget=6)
        self.assertFalse(choice.use_window, "a window of 8 cannot fit in 6 tokens")
        self.assertLessEqual(1 + len(choice.tree), 6)

    def test_probes_that_do_not_pay_come_less_often(self):
        policy = AdaptiveStepPolicy(STEEP, window_length=8, levels=2, probe_every=32, max_probe_every=128)
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
        fresh = AdaptiveStepPolicy(STEEP, window_length=8, levels=2)
        fresh.start_from(dataclasses.replace(fresh.estimates(), probe_wait=128.0))
        windows = 0
        for _ in range(100):
            choice = _plan(fresh, _tree())
            windows += choice.use_window
            fresh.observe(choice, Verdict([9], [], [], []), NGramPool(2, 3), 0)
        self.assertEqual(windows, 0)

    def test_node_probabilities_follow_pool_shares(self):
        policy = AdaptiveStepPolicy(FLAT, window_length=8, levels=2)
        tree = _tree()
        probability = policy.node_probabilities(tree)
        one, four = tree.child(-1, 1), tree.child(-1, 4)
        self.assertAlmostEqual(probability[one], 2 * probability[four])
        two = tree.child(one, 2)
        self.assertLess(probability[two], probability[one])

    def test_memory_nodes_follow_their_counts_and_learnt_rate(self):
        policy = AdaptiveStepPolicy(FLAT, window_length=8, levels=2, memory_match=3, memory_depth=4)
        tree = TokenTree()
        tree.add_memory(MemoryMatch(2, ((1, 2), (1, 2), (1, 3), (4,))), max_nodes=10)
        probability = policy.node_probabilities(tree)
        one, four = tree.child(-1, 1), tree.child(-1, 4)
        self.assertAlmostEqual(probability[one], 0.5 * 3 / 4)
        self.assertAlmostEqual(probability[four], 0.5 * 1 / 4)
        self.assertAlmostEqual(probability[tree.child(one, 2)], probability[one] * 0.5 * 2 / 3)
        for _ in range(40):
            policy.observe(_unverified(policy, tree), Verdict([1, 2, 9], [0, 1], [], []), NGramPool(2, 3), 0)
        self.assertGreater(policy.memory_rate[2][1], 0.95)
        self.assertGreater(policy.memory_rate[2][2], 0.95)
        self.assertEqual(policy.memory_rate[3][1], 0.5, "rates are learnt per match length")
        for _ in range(40):
            policy.observe(_unverified(policy, tree), Verdict([9], [], [], []), NGramPool(2, 3), 0)
        self.assertLess(policy.memory_rate[2][1], 0.05)
        fresh = AdaptiveStepPolicy(MODEST, 8, 2, memory_match=3, memory_depth=4)
        self.assertGreater(len(_plan(fresh, tree, False).tree), 0, "the prior verifies the likeliest continuation")
        policy.use_cost(MODEST)
        self.assertEqual(len(_plan(policy, tree, False).tree), 0, "a memory that misses is not verified")


class StepDurationTest(unittest.TestCase):
    """What measured step durations teach the adaptive policy about the cost of its steps."""

    def _timed(self, policy: AdaptiveStepPolicy, cost_of, steps: int = 12) -> None:
        """Reports a one-token step of 10 ms, then `steps` steps of every length 2-64 costing `cost_of(length)`."""
        policy.observe_duration(1, 0.010)
        for _ in range(steps):
            for length in (2, 4, 8, 16, 32, 64):
                policy.observe_duration(length, 0.010 * cost_of(length))

    def test_a_flat_table_learns_what_long_steps_cost(self):
        # A table that prices every step at one token, where steps cost more (a GPU driven by a slow host).
        policy = AdaptiveStepPolicy(FLAT, window_length=8, levels=2)
        self._timed(policy, lambda length: 2.0 if length < 32 else 3.0)
        for length in (2, 8, 16):
            self.assertAlmostEqual(policy.step_cost(length), 2.0, delta=0.15)
        self.assertAlmostEqual(policy.step_cost(64), 3.0, delta=0.2)
        self.assertEqual(policy.step_cost(1), 1.0)

    def test_a_right_table_is_left_alone(self):
        policy = AdaptiveStepPolicy(MODEST, window_length=8, levels=2)
        self._timed(policy, MODEST)
        for length in (2, 8, 16, 64):
            self.assertAlmostEqual(policy.step_cost(length), MODEST(length), places=6)

    def test_a_table_too_low_by_a_factor_is_rescaled(self):
        # Steps whose excess over one token is twice the table's: the excess factor explains it all.
        policy = AdaptiveStepPolicy(MODEST, window_length=8, levels=2)
        self._timed(policy, lambda length: 1.0 + 2.0 * (MODEST(length) - 1.0))
        self.assertAlmostEqual(policy.step_cost(8), 2.0, delta=0.05)
        self.assertEqual(policy._underpricing, {band: 1.0 for band in (2, 3, 4, 5, 6, 7)})

    def test_what_steps_cost_is_carried_to_the_next_call(self):
        learnt = AdaptiveStepPolicy(MODEST, window_length=8, levels=2)
        self._timed(learnt, lambda length: 2.0 * MODEST(length))
        fresh = AdaptiveStepPolicy(MODEST, window_length=8, levels=2)
        fresh.start_from(learnt.estimates())
        for length in (1, 2, 8, 64):
            self.assertEqual(fresh.step_cost(length), learnt.step_cost(length))
        self.assertGreater(fresh.step_cost(8), 1.5 * MODEST(8))

    def test_carried_step_costs_average_over_sequences(self):
        a = PolicyEstimates((0.5,), (0.5,), 1.0, 1.0, excess_scale=1.0, underpricing=((2, 2.0),))
        b = PolicyEstimates((0.5,), (0.5,), 1.0, 1.0, excess_scale=3.0, underpricing=((2, 1.0), (4, 3.0)))
        mean = PolicyEstimates.mean([a, b])
        self.assertEqual((mean.excess_scale, mean.underpricing), (2.0, ((2, 1.5), (4, 2.0))))

    def test_a_timed_policy_makes_its_second_step_a_one_token_step_once(self):
        policy = AdaptiveStepPolicy(FLAT, window_length=8, levels=2, times_steps=True)
        first, second, third = (_plan(policy, _tree()) for _ in range(3))
        self.assertTrue(first.use_window and len(first.tree) == 5, "a flat table verifies everything")
        self.assertFalse(second.use_window)
        self.assertEqual(len(second.tree), 0)
        self.assertTrue(third.use_window and len(third.tree) == 5, "only once, even if no duration was reported")

    def test_no_one_token_step_is_forced_once_one_was_timed_or_without_timing(self):
        timed = AdaptiveStepPolicy(FLAT, window_length=8, levels=2, times_steps=True)
        timed.observe_duration(1, 0.010)
        untimed = AdaptiveStepPolicy(FLAT, window_length=8, levels=2)
        for policy in (timed, untimed):
            choices = [_plan(policy, _tree()) for _ in range(3)]
            self.assertTrue(all(choice.use_window and len(choice.tree) == 5 for choice in choices))

    def test_a_batch_budget_is_not_overridden(self):
        policy = AdaptiveStepPolicy(FLAT, window_length=8, levels=2, times_steps=True)
        choices = [_plan(policy, _tree(), budget=20) for _ in range(3)]
        self.assertTrue(all(choice.use_window for choice in choices))


class CalibrationTest(unittest.TestCase):
    def _policy(self, predicted: float = 0.0, realized: float = 0.0) -> AdaptiveStepPolicy:
        policy = AdaptiveStepPolicy(MODEST, window_length=8, levels=2)
        policy.start_from(dataclasses.replace(policy.estimates(), predicted=predicted, realized=realized))
        return policy

    def test_probabilities_are_scaled_by_accepted_over_predicted(self):
        tree = _tree()
        raw = self._policy().node_probabilities(tree)
        self.assertEqual(self._policy().calibration, 1.0)
        doubtful = self._policy(predicted=9.0, realized=2.0)
        self.assertAlmostEqual(doubtful.calibration, 3.0 / 10.0)
        for scaled, unscaled in zip(doubtful.node_probabilities(tree), raw):
            self.assertAlmostEqual(scaled, 0.3 * unscaled)
        confident = self._policy(predicted=1.0, realized=19.0)
        self.assertEqual(confident.calibration, 10.0)
        self.assertEqual(max(confident.node_probabilities(tree)), 1.0, "a probability never exceeds 1")
        # The same tree, the same per-depth estimates: fewer nodes when verified nodes used to miss.
        self.assertLess(len(_plan(doubtful, tree, False).tree), len(_plan(self._policy(), tree, False).tree))
        self.assertEqual(len(_plan(doubtful, tree, False).tree), 0)

    def test_verified_steps_update_the_sums(self):
        policy = AdaptiveStepPolicy(FLAT, window_length=8, levels=2)
        tree = _tree()
        raw = policy.node_probabilities(tree)
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
        policy = AdaptiveStepPolicy(MODEST, window_length=8, levels=2)
        tree = _tree()
        steps_with_nodes = []
        for step in range(200):
            choice = _plan(policy, tree, False)
            if len(choice.tree):
                steps_with_nodes.append(step)
            # The mechanism alone: the verdict credits no verified node, while the accepted token is one the pool
            # offered, so the per-depth estimate keeps rising and only the calibration sees the misses.
            policy.observe(choice, Verdict([4], [], [], []), NGramPool(2, 3), 0)
        self.assertGreater(policy.match_rate[1], 0.9)
        self.assertLess(len(steps_with_nodes), 100, "misses lower the calibration: most steps verify nothing")
        self.assertGreater(steps_with_nodes[-1], 150, "and verification is tried again as the sums decay")


class PolicyEstimatesTest(unittest.TestCase):
    def _learnt_policy(self) -> AdaptiveStepPolicy:
        policy = AdaptiveStepPolicy(STEEP, window_length=8, levels=2, context_depth=3)
        for _ in range(10):
            policy.observe(
                _unverified(policy, _tree(), window_used=True), Verdict([9], [], [], []), NGramPool(2, 3), 0
            )
        return policy

    def test_a_new_policy_starts_from_learnt_estimates(self):
        learnt = self._learnt_policy()
        fresh = AdaptiveStepPolicy(MODEST, window_length=8, levels=2, context_depth=3)
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
