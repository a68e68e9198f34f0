"""The private Transformers APIs behind `compatibility.py` are where the package expects them."""

import unittest
from unittest import mock

import transformers
from transformers import GenerationMixin
from transformers.generation.continuous_batching.continuous_api import (
    ContinuousBatchingManager,
    ContinuousBatchProcessor,
)

from transformers_lookahead.compatibility import BatchProcessorHooks, become, check_private_apis


class PrivateApiTest(unittest.TestCase):
    def test_private_apis_are_in_place(self):
        problems = check_private_apis()
        self.assertEqual(
            problems,
            [],
            f"Transformers {transformers.__version__} changed private APIs lookahead decoding relies on; adapt "
            "src/transformers_lookahead/compatibility.py: " + "; ".join(problems),
        )

    def test_a_moved_api_is_named(self):
        with mock.patch.object(GenerationMixin, "_valid_auto_compile_criteria", None):
            problems = check_private_apis()
        self.assertEqual(len(problems), 1)
        self.assertIn("_valid_auto_compile_criteria", problems[0])

    def test_a_changed_signature_is_named(self):
        def _prefill(self, input_ids, model_kwargs):
            raise AssertionError("not called")

        with mock.patch.object(GenerationMixin, "_prefill", _prefill):
            problems = check_private_apis()
        self.assertEqual(len(problems), 1)
        self.assertIn("_prefill", problems[0])

    def test_a_moved_continuous_batching_hook_is_named(self):
        def _generation_step(self, model, batch):
            raise AssertionError("not called")

        with mock.patch.object(ContinuousBatchProcessor, "_generation_step", _generation_step):
            problems = check_private_apis()
        self.assertEqual(len(problems), 1)
        self.assertIn("ContinuousBatchProcessor._generation_step", problems[0])

    def test_a_pad_token_no_longer_resolved_is_named(self):
        original = GenerationMixin._prepare_special_tokens

        def _prepare_special_tokens(self, generation_config, *args, **kwargs):
            original(self, generation_config, *args, **kwargs)
            del generation_config._pad_token_tensor

        with mock.patch.object(GenerationMixin, "_prepare_special_tokens", _prepare_special_tokens):
            problems = check_private_apis()
        self.assertEqual(len(problems), 1)
        self.assertIn("_pad_token_tensor", problems[0])


class BecomeTest(unittest.TestCase):
    def test_takes_over_an_instance_of_the_transformers_class_only(self):
        class Hooks(BatchProcessorHooks):
            pass

        stock = object.__new__(ContinuousBatchProcessor)
        self.assertIs(become(stock, Hooks), stock)
        self.assertIsInstance(stock, Hooks)
        with self.assertRaisesRegex(TypeError, "extends ContinuousBatchProcessor"):
            become(object.__new__(ContinuousBatchingManager), Hooks)
