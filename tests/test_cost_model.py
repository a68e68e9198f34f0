import unittest

from transformers_lookahead.cost_model import EngineStepCost, StepCostModel, StepPricing
from transformers_lookahead.step_layout import padded_length

FLAT = StepCostModel({1: 1.0, 64: 1.0})
STEEP = StepCostModel({1: 1.0, 2: 1.5, 8: 2.0, 64: 8.0})
MODEST = StepCostModel({1: 1.0, 2: 1.1, 8: 1.5, 64: 4.0})


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


class StepPricingTest(unittest.TestCase):
    """What measured step durations teach the pricing about the cost of steps."""

    def _timed(self, pricing: StepPricing, cost_of, steps: int = 12) -> None:
        """Reports a one-token step of 10 ms, then `steps` steps of every length 2-64 costing `cost_of(length)`."""
        pricing.observe(1, 0.010)
        for _ in range(steps):
            for length in (2, 4, 8, 16, 32, 64):
                pricing.observe(length, 0.010 * cost_of(length))

    def test_untimed_pricing_is_the_table(self):
        pricing = StepPricing(MODEST)
        for length in (1, 2, 5, 64, 80):
            self.assertEqual(pricing(length), MODEST(length))
        self.assertFalse(pricing.wants_reference)
        pricing.use_table(STEEP)
        self.assertEqual(pricing(8), STEEP(8))

    def test_a_flat_table_learns_what_long_steps_cost(self):
        # A table that prices every step at one token, where steps cost more (a GPU driven by a slow host).
        pricing = StepPricing(FLAT, timed=True)
        self.assertTrue(pricing.wants_reference)
        self._timed(pricing, lambda length: 2.0 if length < 32 else 3.0)
        self.assertFalse(pricing.wants_reference)
        for length in (2, 8, 16):
            self.assertAlmostEqual(pricing(length), 2.0, delta=0.15)
        self.assertAlmostEqual(pricing(64), 3.0, delta=0.2)
        self.assertEqual(pricing(1), 1.0)

    def test_durations_before_a_timed_one_token_step_teach_nothing(self):
        pricing = StepPricing(FLAT, timed=True)
        for length in (2, 8, 64):
            pricing.observe(length, 0.5)
        self.assertEqual(pricing.learnt(), (1.0, ()))

    def test_a_right_table_is_left_alone(self):
        pricing = StepPricing(MODEST, timed=True)
        self._timed(pricing, MODEST)
        for length in (2, 8, 16, 64):
            self.assertAlmostEqual(pricing(length), MODEST(length), places=6)

    def test_a_table_too_low_by_a_factor_is_rescaled(self):
        # Steps whose excess over one token is twice the table's: the excess factor explains it all.
        pricing = StepPricing(MODEST, timed=True)
        self._timed(pricing, lambda length: 1.0 + 2.0 * (MODEST(length) - 1.0))
        self.assertAlmostEqual(pricing(8), 2.0, delta=0.05)
        excess_scale, underpricing = pricing.learnt()
        self.assertAlmostEqual(excess_scale, 2.0, delta=0.05)
        self.assertEqual(underpricing, tuple((band, 1.0) for band in (2, 3, 4, 5, 6, 7)))

    def test_what_steps_cost_is_carried_to_the_next_call(self):
        learnt = StepPricing(MODEST, timed=True)
        self._timed(learnt, lambda length: 2.0 * MODEST(length))
        fresh = StepPricing(MODEST, timed=True)
        fresh.start_from(*learnt.learnt())
        for length in (1, 2, 8, 64):
            self.assertEqual(fresh(length), learnt(length))
        self.assertGreater(fresh(8), 1.5 * MODEST(8))
        self.assertTrue(fresh.wants_reference, "the one-token time is not carried: it grows with the context")


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


class PaddedLengthTest(unittest.TestCase):
    def test_compiled_buckets_and_engine_intervals_pad_alike(self):
        # `generate`'s compiled buckets: the shortest that holds the step; past the longest, the longest.
        self.assertEqual([padded_length(length, (8, 16, 32)) for length in (2, 8, 9, 32, 40)], [8, 8, 16, 32, 32])
        # An engine's padding interval: its next multiple.
        self.assertEqual([padded_length(length, 64) for length in (1, 64, 65, 130)], [64, 64, 128, 192])
