"""`LookaheadState`: what `"auto"` keeps between calls, held by the model, safe under threads."""

import copy
import dataclasses
import pickle
import tempfile
import threading
import time
import unittest
from pathlib import Path
from unittest import mock

import torch
from parameterized import parameterized

from transformers_lookahead import LookaheadConfig, LookaheadState, enable_lookahead
from transformers_lookahead import generate as lookahead_generate
from transformers_lookahead.adaptive_policy import PolicyEstimates
from transformers_lookahead.auto_tuning import AUTO_TUNING, AutoTuning
from transformers_lookahead.cost_model import StepCostModel

from .utils import MeasurementCounter, flat_state, random_prompt, tiny_model


class LookaheadStateTest(unittest.TestCase):
    def test_cost_table_is_measured_once_per_state_and_kept_on_disk(self):
        model = tiny_model("llama")
        with tempfile.TemporaryDirectory() as tmp, MeasurementCounter() as measure:
            state = LookaheadState(cost_dir=tmp)
            first = state.cost_model(model)
            self.assertIs(state.cost_model(model), first)
            self.assertEqual(measure.count, 1)
            self.assertEqual(len(list(Path(tmp).glob("step-cost-*.json"))), 1)
            LookaheadState(cost_dir=tmp).cost_model(model)
            self.assertEqual(measure.count, 1, "a new state reads the kept table")

    def test_no_directory_writes_nothing(self):
        model = tiny_model("llama")
        with tempfile.TemporaryDirectory() as tmp, mock.patch.dict("os.environ", {"HOME": tmp, "HF_HOME": tmp}):
            with MeasurementCounter() as measure:
                state = LookaheadState(cost_dir=None)
                state.cost_model(model)
                state.cost_model(model)
                LookaheadState(cost_dir=None).cost_model(model)
            self.assertEqual(measure.count, 2, "kept in memory per state")
            self.assertEqual(list(Path(tmp).iterdir()), [])

    def test_estimates_per_shape(self):
        state = LookaheadState(cost_dir=None)
        estimates = PolicyEstimates((0.5, 0.25), (0.5,), 1.0, 2.0)
        state.remember((28, 5, 9), estimates)
        self.assertEqual(state.recall((28, 5, 9)), estimates)
        self.assertIsNone(state.recall((4, 5, 9)))

    def test_engine_steps_per_model_key(self):
        state = LookaheadState(cost_dir=None)
        steps = ((1.0, 1.0, 4.0, 1.0, 100.0, 400.0, 1.0, 0.05),)
        state.remember_engine_steps("fp32-key", steps)
        self.assertEqual(state.recall_engine_steps("fp32-key"), steps)
        self.assertEqual(state.recall_engine_steps("bf16-key"), ())

    def test_copies_start_empty(self):
        state = LookaheadState(cost_dir=None)
        state.remember((1,), PolicyEstimates((0.5,), (0.5,), 1.0, 1.0))
        state.remember_engine_steps("key", ((1.0, 0.02),))
        for copied in (copy.deepcopy(state), pickle.loads(pickle.dumps(state))):
            self.assertIsNone(copied.recall((1,)))
            self.assertEqual(copied.recall_engine_steps("key"), ())
            self.assertIsNone(copied.cost_dir)

    def test_enable_lookahead_gives_a_state_once(self):
        model = enable_lookahead(tiny_model("llama"))
        state = model.lookahead_state
        self.assertIsInstance(state, LookaheadState)
        self.assertIs(enable_lookahead(model).lookahead_state, state, "enabling again keeps the state")
        mine = LookaheadState(cost_dir=None)
        self.assertIs(enable_lookahead(model, state=mine).lookahead_state, mine)
        with self.assertRaisesRegex(TypeError, "`state` must be a `LookaheadState`"):
            enable_lookahead(model, state={})


class FixedPricingTest(unittest.TestCase):
    """A state given a cost table prices every step by it, and without `follow_durations` learns nothing from time."""

    def test_a_given_table_is_used_without_measuring(self):
        table = StepCostModel({1: 1.0, 2: 1.0})
        with tempfile.TemporaryDirectory() as folder, MeasurementCounter() as measure:
            state = LookaheadState(cost_dir=folder, step_costs=table)
            self.assertIs(state.cost_model(tiny_model("llama")), table)
            self.assertEqual(measure.count, 0)
            self.assertEqual(list(Path(folder).iterdir()), [])
        self.assertIs(copy.deepcopy(state).step_costs, table)
        self.assertFalse(pickle.loads(pickle.dumps(LookaheadState(follow_durations=False))).follow_durations)

    def test_bad_settings_are_refused(self):
        with self.assertRaisesRegex(ValueError, "`follow_durations` must be True or False"):
            LookaheadState(follow_durations="no")
        with self.assertRaisesRegex(ValueError, "`step_costs` must be a `StepCostModel`"):
            LookaheadState(step_costs={1: 1.0})

    def test_steps_do_not_follow_durations_when_told_not_to(self):
        # Passes slowed in proportion to their tokens: "auto" following durations learns that long steps cost more
        # than its flat table says and shortens them; told not to follow them, it takes the steps of an unslowed run.
        prompt = random_prompt(24, seed=4)

        def steps(follow: bool, slow: bool) -> tuple[int, ...]:
            state = LookaheadState(cost_dir=None, step_costs=StepCostModel({1: 1.0, 2: 1.0}), follow_durations=follow)
            model = enable_lookahead(tiny_model("llama"), state=state)
            if slow:
                model.register_forward_pre_hook(
                    lambda module, args, kwargs: time.sleep(0.004 * kwargs["input_ids"].shape[-1]), with_kwargs=True
                )
            out = model.generate(
                prompt, max_new_tokens=40, do_sample=False, lookahead_window="auto", return_dict_in_generate=True
            )
            return tuple(out.accepted_per_step)

        unslowed = steps(follow=False, slow=False)
        self.assertEqual(steps(follow=False, slow=True), unslowed)
        self.assertNotEqual(steps(follow=True, slow=True), unslowed)


class ToolHooksTest(unittest.TestCase):
    """What tools inject through the state: the tuned constants `"auto"` decides with, and an observer of steps."""

    def _steps(self, tuning: AutoTuning) -> list[tuple]:
        """Every step of an `"auto"` call under `tuning`, as the observer saw it (choice, row, verdict)."""
        steps = []
        state = flat_state(
            tuning=tuning, step_observer=lambda choice, row, verdict: steps.append((choice, row, verdict))
        )
        model = enable_lookahead(tiny_model("llama"), state=state)
        prompt = random_prompt(24, seed=5)
        expected = model.generate(prompt, max_new_tokens=40, do_sample=False)
        out = model.generate(
            prompt, max_new_tokens=40, do_sample=False, lookahead_window="auto", return_dict_in_generate=True
        )
        self.assertTrue(torch.equal(out.sequences, expected))
        self.assertEqual([len(verdict.tokens) for _, _, verdict in steps], list(out.accepted_per_step))
        return steps

    @parameterized.expand([("narrow", 2, 3), ("wide", 6, 0)])
    def test_every_step_is_observed_and_decided_with_the_given_tuning(self, _, max_window, context_depth):
        steps = self._steps(dataclasses.replace(AUTO_TUNING, max_window=max_window, context_depth=context_depth))
        levels = AUTO_TUNING.ngram - 1
        windowed = [row for choice, row, _ in steps if choice.use_window]
        self.assertTrue(windowed, "a flat table runs the window")
        for row in windowed:
            # The flat table makes the widest window pay: the tuning's.
            self.assertEqual(row.tree_start - row.pending_length, max_window * levels)
        deepest_copy = max(len(choice.offer.tree.context_path()) for choice, _, _ in steps)
        self.assertEqual(deepest_copy, context_depth, "the context's copies go as deep as the tuning says")

    def test_bad_tuning_is_refused(self):
        with self.assertRaisesRegex(ValueError, "`tuning` must be an `AutoTuning`"):
            LookaheadState(tuning={"max_window": 2})


class ConcurrentCallsTest(unittest.TestCase):
    """One enabled model, several threads calling `generate` at once: every caller gets its own exact output."""

    def test_threads_get_their_own_exact_outputs(self):
        model = enable_lookahead(tiny_model("llama"))
        prompts = [random_prompt(12 + 4 * i, seed=i) for i in range(6)]
        settings = [{"lookahead_window": "auto"}, {"lookahead_window": 4, "lookahead_guess": 3}, {}]
        expected = [model.generate(p, max_new_tokens=40, do_sample=False) for p in prompts]
        attributes = set(vars(model))
        seen_attributes = []
        model.register_forward_hook(lambda *_: seen_attributes.append(set(vars(model))))
        results: dict[tuple[int, int], torch.Tensor] = {}
        errors = []
        barrier = threading.Barrier(len(prompts))

        def call(index: int) -> None:
            try:
                barrier.wait(timeout=60)
                for round_ in range(2):
                    kwargs = settings[(index + round_) % len(settings)]
                    results[index, round_] = model.generate(
                        prompts[index], max_new_tokens=40, do_sample=False, return_dict_in_generate=True, **kwargs
                    )
            except Exception as error:  # reported below, with the thread's index
                errors.append((index, error))

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        self.assertFalse(any(thread.is_alive() for thread in threads), "a thread did not finish")
        self.assertEqual(errors, [])
        speculated = 0
        for (index, _), out in results.items():
            self.assertTrue(torch.equal(out.sequences, expected[index]), f"thread {index}")
            if hasattr(out, "accepted_per_step"):
                speculated += max(out.accepted_per_step) > 1
        self.assertGreater(speculated, 0, "lookahead calls accepted several tokens in some step")
        self.assertTrue(all(seen == attributes for seen in seen_attributes), "no attribute set on the model")

    def test_static_cache_room_is_per_call(self):
        model = enable_lookahead(tiny_model("llama"))
        prompt = random_prompt(16, seed=3)
        plain = model.generate(prompt, max_new_tokens=20, do_sample=False, cache_implementation="static")
        looked = model.generate(
            prompt,
            max_new_tokens=20,
            do_sample=False,
            cache_implementation="static",
            lookahead_window=4,
            return_dict_in_generate=True,
        )
        self.assertTrue(torch.equal(looked.sequences, plain))
        room = LookaheadConfig(window=4).max_step_length()
        # Plain decoding never caches its last token: its static cache holds prompt + new tokens - 1.
        self.assertEqual(looked.cache.layers[0].max_cache_len, 16 + 20 - 1 + room)
        self.assertIsNone(model.generation_config.max_cache_len, "the room is asked for by the call, not kept")


class UnenabledModelTest(unittest.TestCase):
    def test_custom_generate_on_a_plain_model_sets_nothing_on_it(self):
        model = tiny_model("llama")
        prompt = random_prompt(20, seed=5)
        attributes = set(vars(model))
        expected = model.generate(prompt, max_new_tokens=24, do_sample=False)
        out = model.generate(
            prompt, max_new_tokens=24, do_sample=False, custom_generate=lookahead_generate, lookahead_window="auto"
        )
        self.assertTrue(torch.equal(out, expected))
        self.assertEqual(set(vars(model)), attributes)
