"""Encoder-decoder models: lookahead on the decoder side (Whisper), and the refusal for decoders without positions."""

import unittest

import torch
from parameterized import parameterized
from transformers import GenerationMixin

import transformers_lookahead
from transformers_lookahead import LookaheadEncoderDecoderOutput

from .test_model_registry import ENCODER_DECODER_REFUSAL, registry_model

MAX_NEW = 30


def whisper_features(batch: int, seed: int = 0) -> torch.Tensor:
    """Log-mel-like inputs for the tiny Whisper of the registry (8 bins, 32 frames)."""
    return torch.randn(batch, 8, 32, generator=torch.Generator().manual_seed(seed))


def count_decoder_calls(model) -> list:
    calls = []
    model.model.decoder.register_forward_hook(lambda *args: calls.append(1))
    return calls


class WhisperLookaheadTest(unittest.TestCase):
    @parameterized.expand([(4,), ("auto",)])
    def test_batch_identical_to_plain_greedy(self, window):
        model, _ = registry_model("whisper")
        features = whisper_features(3)
        expected = model.generate(features, max_new_tokens=MAX_NEW, do_sample=False)
        output = model.generate(features, max_new_tokens=MAX_NEW, do_sample=False, lookahead_window=window)
        self.assertTrue(torch.equal(output, expected))
        for row in range(3):
            alone = model.generate(features[row : row + 1], max_new_tokens=MAX_NEW, lookahead_window=window)
            self.assertTrue(torch.equal(alone, expected[row : row + 1]))

    def test_rows_finishing_at_different_steps(self):
        """Finished rows leave the batch: the encoder outputs and the cross-attention cache must follow."""
        model, _ = registry_model("whisper")
        features = whisper_features(3, seed=1)
        unstopped = model.generate(features, max_new_tokens=MAX_NEW, do_sample=False)
        eos = int(unstopped[0, 8])
        self.assertNotIn(eos, unstopped[1:, :8].flatten().tolist(), "pick an EOS that ends row 0 first")
        model.generation_config.eos_token_id = eos
        expected = model.generate(features, max_new_tokens=MAX_NEW, do_sample=False)
        calls = count_decoder_calls(model)
        output = model.generate(features, max_new_tokens=MAX_NEW, do_sample=False, lookahead_window=4)
        self.assertTrue(torch.equal(output, expected))
        lengths = (expected != model.generation_config.pad_token_id).sum(-1)
        self.assertGreater(len(set(lengths.tolist())), 1, "the rows must end at different lengths")
        self.assertLess(len(calls), int(lengths.max()), "lookahead must accept several tokens in some steps")

    def test_whisper_logits_processors(self):
        """Whisper's `generate` builds its own processors (suppressed tokens, tokens suppressed at the start)."""
        model, features = registry_model("whisper")
        plain = model.generate(features, max_new_tokens=MAX_NEW, do_sample=False)
        settings = {"suppress_tokens": [int(plain[0, 3])], "begin_suppress_tokens": [int(plain[0, 0])]}
        expected = model.generate(features, max_new_tokens=MAX_NEW, do_sample=False, **settings)
        self.assertFalse(torch.equal(expected, plain), "the processors must change the output")
        output = model.generate(features, max_new_tokens=MAX_NEW, do_sample=False, lookahead_window=4, **settings)
        self.assertTrue(torch.equal(output, expected))

    def test_custom_generate_returns_per_row_statistics(self):
        """Called through `GenerationMixin.generate` the output keeps what lookahead did, one row per sequence."""
        model, _ = registry_model("whisper")
        features = whisper_features(2)
        expected = GenerationMixin.generate(model, features, max_new_tokens=MAX_NEW, do_sample=False)
        output = GenerationMixin.generate(
            model,
            features,
            max_new_tokens=MAX_NEW,
            do_sample=False,
            return_dict_in_generate=True,
            custom_generate=transformers_lookahead.generate,
            lookahead_window=4,
        )
        self.assertIsInstance(output, LookaheadEncoderDecoderOutput)
        self.assertTrue(torch.equal(output.sequences, expected))
        self.assertEqual(output.accepted_per_step.sum(-1).tolist(), [MAX_NEW - 1] * 2)  # the prefill adds one
        self.assertEqual(output.num_forward_passes.tolist(), (output.accepted_per_step > 0).sum(-1).add(1).tolist())
        self.assertLess(int(output.num_forward_passes.max()), MAX_NEW)


class DecoderWithoutPositionsTest(unittest.TestCase):
    @parameterized.expand([("t5",), ("bart",)])
    def test_refused_before_any_forward_pass(self, name):
        model, inputs = registry_model(name)
        calls = []
        model.register_forward_hook(lambda *args: calls.append(1))
        with self.assertRaisesRegex(ValueError, ENCODER_DECODER_REFUSAL):
            model.generate(inputs, max_new_tokens=5, lookahead_window=4)
        self.assertEqual(calls, [])
