"""
Every logits processor and warper `generate` builds from a `GenerationConfig`, on a batch of three rows: lookahead
verifies each row on its own, so each processor must act on a row called alone as it acts on the whole batch; a
user's processor keeps plain decoding's calls for one row and is refused by name in a batch.
"""

import collections
import unittest
import warnings

import torch
from parameterized import parameterized
from transformers import (
    LogitsProcessor,
    SynthIDTextWatermarkingConfig,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
    WatermarkingConfig,
)

from transformers_lookahead import enable_lookahead
from utils.distribution_check import homogeneity_p_value, token_counts
from utils.tiny_models import left_padded

from .test_batched_decoding import mixed_prompts
from .test_encoder_decoder import count_decoder_calls, whisper_features
from .test_model_registry import registry_model
from .test_verification import P_VALUE
from .utils import SMALL_VOCABULARY, flat_state, small_vocabulary_model, tiny_model

NEW_TOKENS = 30
# One setting per processor `GenerationMixin._get_logits_processor` builds outside sampling (3 is the EOS where one is
# needed). The encoder ones take the prompt as their "encoder input ids" on a decoder-only model.
PROCESSORS = [
    ("sequence_bias", {"sequence_bias": {(5,): 3.0, (9, 33): -4.0}}),
    ("repetition_penalty", {"repetition_penalty": 1.5}),
    ("encoder_repetition_penalty", {"encoder_repetition_penalty": 1.5}),
    ("no_repeat_ngram_size", {"no_repeat_ngram_size": 2}),
    ("encoder_no_repeat_ngram_size", {"encoder_no_repeat_ngram_size": 2}),
    ("bad_words_ids", {"bad_words_ids": [[7], [12, 13]]}),
    ("min_length", {"min_length": 40, "eos_token_id": 3}),
    ("min_new_tokens", {"min_new_tokens": 20, "eos_token_id": 3}),
    ("forced_bos_token_id", {"forced_bos_token_id": 8}),
    ("forced_eos_token_id", {"forced_eos_token_id": 4}),
    ("remove_invalid_values", {"remove_invalid_values": True}),
    ("exponential_decay_length_penalty", {"exponential_decay_length_penalty": (5, 1.5), "eos_token_id": 3}),
    ("suppress_tokens", {"suppress_tokens": [5, 9]}),
    ("begin_suppress_tokens", {"begin_suppress_tokens": [5, 9]}),
    ("renormalize_logits", {"renormalize_logits": True}),
    ("watermarking", {"watermarking_config": WatermarkingConfig(bias=2.5)}),
    ("synthid_watermarking", {"watermarking_config": SynthIDTextWatermarkingConfig(keys=[1, 2, 3, 4], ngram_len=3)}),
]
# The warpers, applied when sampling.
WARPERS = [
    ("temperature", {"temperature": 0.6}),
    ("top_k", {"top_k": 4}),
    ("top_p", {"top_p": 0.7}),
    ("min_p", {"min_p": 0.15}),
    ("typical_p", {"typical_p": 0.7}),
    ("epsilon_cutoff", {"epsilon_cutoff": 0.05}),
    ("eta_cutoff", {"eta_cutoff": 0.05}),
    ("top_h", {"top_h": 0.5}),
]


class BatchedProcessorsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.model = enable_lookahead(tiny_model("llama"), flat_state())
        cls.inputs = left_padded(mixed_prompts(3))

    @parameterized.expand(PROCESSORS)
    def test_greedy_batch_of_three_is_plain_greedy(self, _, settings):
        common = {**self.inputs, "max_new_tokens": NEW_TOKENS, "do_sample": False, **settings}
        with warnings.catch_warnings():
            # Some settings warn about the tiny model (no EOS of its own); the outputs are what is checked.
            warnings.simplefilter("ignore")
            expected = self.model.generate(**common)
            for window in (4, "auto"):
                with self.subTest(window=window):
                    out = self.model.generate(**common, lookahead_window=window, return_dict_in_generate=True)
                    self.assertTrue(torch.equal(out.sequences, expected))
                    multi_token = any(max(row, default=1) > 1 for row in out.accepted_per_step)
                    self.assertTrue(multi_token, "the rows must take multi-token steps")

    def test_classifier_free_guidance_is_refused_before_any_forward_pass(self):
        passes = []
        hook = self.model.register_forward_hook(lambda *_: passes.append(1))
        self.addCleanup(hook.remove)
        with self.assertRaisesRegex(ValueError, "cannot be combined with `guidance_scale` \\(got 1.5\\)"):
            self.model.generate(**self.inputs, max_new_tokens=5, guidance_scale=1.5, lookahead_window=4)
        self.assertEqual(passes, [])


class RowCounting(LogitsProcessor):
    """A user's processor of the kind that keeps state per batch row: it bans each row's most recent token once the
    row has been called an even number of times, and records the shapes it was called with."""

    def __init__(self):
        self.calls = collections.Counter()
        self.shapes = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.shapes.append(tuple(input_ids.shape))
        scores = scores.clone()
        for row in range(input_ids.shape[0]):
            self.calls[row] += 1
            if self.calls[row] % 2 == 0:
                scores[row, input_ids[row, -1]] = -float("inf")
        return scores


class UserProcessorContractTest(unittest.TestCase):
    """A processor lookahead does not know sees the batch as plain decoding passes it, or is refused by name."""

    @classmethod
    def setUpClass(cls):
        cls.model = enable_lookahead(tiny_model("llama"), flat_state())

    def test_one_row_sees_the_calls_plain_decoding_makes(self):
        prompt = mixed_prompts(1)[0]
        plain = RowCounting()
        expected = self.model.generate(prompt, max_new_tokens=NEW_TOKENS, logits_processor=[plain])
        for window in (4, "auto"):
            with self.subTest(window=window):
                ours = RowCounting()
                out = self.model.generate(
                    prompt,
                    max_new_tokens=NEW_TOKENS,
                    logits_processor=[ours],
                    lookahead_window=window,
                    return_dict_in_generate=True,
                )
                self.assertTrue(torch.equal(out.sequences, expected))
                self.assertEqual(ours.shapes, plain.shapes)
                self.assertLess(out.num_forward_passes, NEW_TOKENS, "multi-token steps")

    def test_a_batch_is_refused_by_the_processor_name_before_any_pass(self):
        passes = []
        hook = self.model.register_forward_hook(lambda *_: passes.append(1))
        self.addCleanup(hook.remove)
        inputs = left_padded(mixed_prompts(2))
        for extra in ({}, {"num_return_sequences": 2, "do_sample": True}):
            with self.subTest(**extra):
                rows = 2 * extra.get("num_return_sequences", 1)
                with self.assertRaisesRegex(ValueError, f"`RowCounting` is not one of .* a batch of {rows} rows"):
                    self.model.generate(
                        **inputs, max_new_tokens=5, logits_processor=[RowCounting()], lookahead_window=4, **extra
                    )
        self.assertEqual(passes, [])

    def test_transformers_batch_wide_processors_are_refused_in_a_batch(self):
        guidance = UnbatchedClassifierFreeGuidanceLogitsProcessor(1.5, self.model)
        with self.assertRaisesRegex(ValueError, "`UnbatchedClassifierFreeGuidanceLogitsProcessor` is not one of"):
            self.model.generate(
                **left_padded(mixed_prompts(2)), max_new_tokens=5, logits_processor=[guidance], lookahead_window=4
            )


class WhisperProcessorsTest(unittest.TestCase):
    """Whisper's `generate` builds processors of its own around `GenerationMixin.generate`."""

    @parameterized.expand(
        [
            ("suppress_tokens", {"suppress_tokens": [5, 9]}),
            ("begin_suppress_tokens", {"begin_suppress_tokens": [5, 9]}),
            ("no_repeat_ngram_size", {"no_repeat_ngram_size": 2}),
            ("repetition_penalty", {"repetition_penalty": 1.5}),
        ]
    )
    def test_batch_of_three(self, _, settings):
        model, _ = registry_model("whisper")
        features = whisper_features(3, seed=2)
        common = {"max_new_tokens": NEW_TOKENS, "do_sample": False, **settings}
        expected = model.generate(features, **common)
        self.assertFalse(torch.equal(expected, model.generate(features, max_new_tokens=NEW_TOKENS, do_sample=False)))
        calls = count_decoder_calls(model)
        self.assertTrue(torch.equal(model.generate(features, **common, lookahead_window=4), expected))
        self.assertLess(len(calls), NEW_TOKENS, "multi-token steps")


class BatchedWarpersTest(unittest.TestCase):
    """
    Each warper, sampled with `num_return_sequences` over two prompts: every row keeps plain's distribution. Many
    copies per call rather than many calls: the same samples, in a twentieth of the calls.
    """

    RUNS, NEW_TOKENS, COPIES = 20, 4, 40

    @classmethod
    def setUpClass(cls):
        cls.model = enable_lookahead(small_vocabulary_model(), flat_state())
        cls.inputs = left_padded([torch.tensor([[3, 4, 5, 3, 4, 5, 3, 4]]), torch.tensor([[6, 7, 6, 7, 6]])])

    def _samples(self, settings: dict, lookahead: dict) -> tuple[torch.Tensor, int]:
        drawn, multi_token = [], 0
        for _ in range(self.RUNS):
            out = self.model.generate(
                **self.inputs,
                do_sample=True,
                max_new_tokens=self.NEW_TOKENS,
                num_return_sequences=self.COPIES,
                return_dict_in_generate=True,
                **settings,
                **lookahead,
            )
            drawn.append(out.sequences[:, -self.NEW_TOKENS :])
            if lookahead:
                multi_token += sum(any(kept > 1 for kept in row) for row in out.accepted_per_step)
        return torch.stack(drawn), multi_token  # (runs, prompts x copies, new tokens)

    @parameterized.expand(WARPERS)
    def test_rows_keep_plain_sampling_distribution(self, _, settings):
        torch.manual_seed(0)
        plain, _ = self._samples(settings, {})
        # "auto" priced as on an accelerator verifies candidates in every step, whatever this CPU's timings; its suffix
        # memory of the earlier runs proposes long continuations, so that many steps accept several tokens.
        looked, multi_token = self._samples(settings, {"lookahead_window": "auto", "lookahead_memory": True})
        sampled_rows = self.RUNS * 2 * self.COPIES
        self.assertGreater(multi_token, sampled_rows // 20, "the test must exercise multi-token acceptance")
        for prompt in range(2):
            rows = slice(prompt * self.COPIES, (prompt + 1) * self.COPIES)
            expected = token_counts(plain[:, rows].reshape(-1, self.NEW_TOKENS), SMALL_VOCABULARY)
            observed = token_counts(looked[:, rows].reshape(-1, self.NEW_TOKENS), SMALL_VOCABULARY)
            for position in range(self.NEW_TOKENS):
                with self.subTest(prompt=prompt, position=position):
                    self.assertGreater(homogeneity_p_value(expected[position], observed[position]), P_VALUE)
