"""The core's way into `generate` (`lookahead_generation`): the fixed-shape loop, and the builder the package adds."""

import unittest

import torch
from parameterized import parameterized
from transformers import GenerationMixin

from transformers_lookahead.generation_mixin import lookahead_decoder
from transformers_lookahead.lookahead_generation import fixed_shape_decoder, generate, generate_with_lookahead

from .test_chain_steps import _tiny_hybrid
from .utils import ForwardCounter, left_padded, random_prompt, tiny_model


class FixedShapeDecoderTest(unittest.TestCase):
    @parameterized.expand([("greedy", False), ("sampling", True)])
    def test_the_core_alone_decodes_as_plain_generate(self, _, do_sample):
        model = tiny_model("qwen2")
        prompt = random_prompt(24, seed=3)
        settings = {"max_new_tokens": 30, "do_sample": do_sample}
        torch.manual_seed(0)
        # The core's `generate` with no builder of the package: `fixed_shape_decoder` builds the loop.
        out = generate_with_lookahead(model, prompt, lookahead_window=4, lookahead_ngram=3, **settings)
        torch.manual_seed(0)
        again = generate_with_lookahead(model, prompt, lookahead_window=4, lookahead_ngram=3, **settings)
        self.assertTrue(torch.equal(out, again), "the same seed, the same text")
        if not do_sample:
            self.assertTrue(torch.equal(out, model.generate(prompt, **settings)))

    def test_a_left_padded_batch_decodes_as_plain_generate(self):
        model = tiny_model("llama")
        inputs = left_padded([random_prompt(18, seed=1), random_prompt(11, seed=2)])
        expected = model.generate(**inputs, max_new_tokens=24, do_sample=False)
        out = generate_with_lookahead(model, **inputs, max_new_tokens=24, do_sample=False, lookahead_window=3)
        self.assertTrue(torch.equal(out, expected))

    def test_auto_is_refused_naming_the_package_before_any_pass(self):
        model = tiny_model("llama")
        counter = ForwardCounter(model)
        with self.assertRaisesRegex(ValueError, r'lookahead_window="auto".*`transformers-lookahead` package'):
            generate_with_lookahead(model, random_prompt(12), max_new_tokens=8, lookahead_window="auto")
        self.assertEqual(counter.count, 0)

    def test_a_hybrid_is_refused_by_name(self):
        # Chain steps for recurrent layers are the package's (`chain_steps`); the core keeps no recurrent state.
        model = _tiny_hybrid()
        with self.assertRaisesRegex(ValueError, r"`Qwen3NextForCausalLM` keeps .*Layer layers"):
            generate_with_lookahead(model, random_prompt(12), max_new_tokens=8, lookahead_window=3)

    def test_the_callable_needs_a_window(self):
        model = tiny_model("llama")
        with self.assertRaisesRegex(ValueError, "needs a `lookahead_window`"):
            GenerationMixin.generate(model, random_prompt(12), max_new_tokens=8, custom_generate=generate)


class BuilderTest(unittest.TestCase):
    def test_the_builder_is_what_the_call_was_given(self):
        model = tiny_model("llama")
        prompt = random_prompt(16, seed=4)
        built = []

        def recording(builder):
            def build(*args, **kwargs):
                built.append(builder)
                return builder(*args, **kwargs)

            return build

        for builder in (fixed_shape_decoder, lookahead_decoder):
            generate_with_lookahead(model, prompt, max_new_tokens=8, lookahead_window=2, build=recording(builder))
        self.assertEqual(built, [fixed_shape_decoder, lookahead_decoder])

    def test_off_and_no_window_are_plain_generate(self):
        model = tiny_model("llama")
        prompt = random_prompt(16, seed=5)
        counter = ForwardCounter(model)
        expected = model.generate(prompt, max_new_tokens=10, do_sample=False)
        plain_passes = counter.count
        for settings in ({}, {"lookahead_window": "off"}):
            counter.count = 0
            out = generate_with_lookahead(model, prompt, max_new_tokens=10, do_sample=False, **settings)
            self.assertTrue(torch.equal(out, expected))
            self.assertEqual(counter.count, plain_passes, "one pass per token")
