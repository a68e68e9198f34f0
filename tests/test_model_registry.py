"""
The support registry: every tiny model family with every cache class, either token-identical to plain greedy or
refused with a clear error. `utils/render_registry.py` renders `REGISTRY` into `docs/source/en/model_registry.md`, and
`test_document_is_current` keeps that page in step with what these tests check.
"""

import re
import unittest
from pathlib import Path

import torch
from parameterized import parameterized

from transformers_lookahead import enable_lookahead

from .utils import TINY_CONFIGS, random_prompt, tiny_model

EXACT = "exact"
CACHES = ("dynamic", "static", "offloaded", "quantized")
# Models whose sliding-window layers (window 8) are shorter than the generation below.
SHORT_SLIDING_WINDOW = ("mistral_window8", "qwen2_hybrid", "gemma3")
STATIC_SLIDING_REFUSAL = "cannot be rolled back once the generation outgrows its window"
QUANTIZED_REFUSAL = "cache_implementation='quantized' cannot be used"
OFFLOADED_REFUSAL = "cache_implementation='offloaded' cannot be used"


def _expected(name: str, cache: str) -> str:
    if cache == "quantized":
        return QUANTIZED_REFUSAL
    if cache == "offloaded":
        return OFFLOADED_REFUSAL
    if cache == "static" and name in SHORT_SLIDING_WINDOW:
        return STATIC_SLIDING_REFUSAL
    return EXACT


# (family, cache, expected): EXACT, or a fragment of the error lookahead raises before any forward pass.
REGISTRY = [(name, cache, _expected(name, cache)) for name in TINY_CONFIGS for cache in CACHES] + [
    ("t5", "dynamic", "encoder-decoder model"),
    ("bart", "dynamic", "encoder-decoder model"),
]
# (backend, expected) on a tiny Llama.
BACKENDS = [
    ("eager", EXACT),
    ("sdpa", EXACT),
    ("flash_attention_2", "needs an attention backend that applies custom 4D masks"),
    ("flex_attention", "needs an attention backend that applies custom 4D masks"),
]
DOCUMENT = Path(__file__).parents[1] / "docs" / "source" / "en" / "model_registry.md"


def registry_model(name: str, attn_implementation: str = "sdpa"):
    if name == "t5":
        from transformers import T5Config, T5ForConditionalGeneration

        config = T5Config(
            vocab_size=96, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8, decoder_start_token_id=0
        )
        return enable_lookahead(T5ForConditionalGeneration(config).eval())
    if name == "bart":
        from transformers import BartConfig, BartForConditionalGeneration

        config = BartConfig(
            vocab_size=96,
            d_model=16,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=32,
            decoder_ffn_dim=32,
        )
        return enable_lookahead(BartForConditionalGeneration(config).eval())
    return enable_lookahead(tiny_model(name, attn_implementation))


def _check(test: unittest.TestCase, model, expected: str, **kwargs) -> None:
    prompt = random_prompt(20, seed=6)
    common = {"max_new_tokens": 30, "do_sample": False, **kwargs}
    if expected != EXACT:
        with test.assertRaisesRegex(ValueError, re.escape(expected)):
            model.generate(prompt, lookahead_window=4, **common)
        return
    plain = model.generate(prompt, **common)
    for window in (4, "auto"):
        with test.subTest(window=window):
            test.assertTrue(torch.equal(model.generate(prompt, lookahead_window=window, **common), plain))


class ModelRegistryTest(unittest.TestCase):
    @parameterized.expand(REGISTRY)
    def test_family_and_cache(self, name, cache, expected):
        _check(self, registry_model(name), expected, cache_implementation=None if cache == "dynamic" else cache)

    @parameterized.expand(BACKENDS)
    def test_attention_backend(self, backend, expected):
        model = registry_model("llama")
        # Set after loading: the test only needs the name lookahead checks, not the kernels installed.
        model.config._attn_implementation = backend
        _check(self, model, expected)

    def test_document_is_current(self):
        from utils.render_registry import render

        self.assertEqual(
            DOCUMENT.read_text(), render(), "run `python utils/render_registry.py` to regenerate the registry page"
        )
