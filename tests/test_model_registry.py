"""
The support registry: every tiny model family with every cache class, either token-identical to plain greedy or
refused with a clear error; and in bfloat16 and float16, where no multi-token pass can promise equality with one-token decoding,
every generated token a near-tie of plain greedy's choice along the same text (`utils.faithfulness`). `utils/render_registry.py` renders `REGISTRY` into `docs/source/en/model_registry.md`, and
`test_document_is_current` keeps that page in step with what these tests check.
"""

import re
import unittest
from pathlib import Path

import torch
import transformers
from parameterized import parameterized

from transformers_lookahead import enable_lookahead
from utils.faithfulness import greedy_margins, off_greedy_positions
from utils.transformers_compatibility import model_from_config, set_attention_implementation_unchecked

from .utils import TINY_CONFIGS, checked, flat_state, random_prompt, tiny_model

EXACT = "exact"
NEW_TOKENS = 30
# Half precision: each token generated is plain greedy's choice, or within `near_tie_tolerance` of it, where plain greedy
# decodes the same text one token per pass.
NEAR_GREEDY = "near-greedy"
CACHES = ("dynamic", "static", "offloaded", "quantized")
# Models whose sliding-window layers (window 8) are shorter than the generation below.
SHORT_SLIDING_WINDOW = ("mistral_window8", "qwen2_hybrid", "gemma2", "gemma3", "cohere2")
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
ENCODER_DECODER_REFUSAL = "encoder-decoder model whose decoder takes no"
REGISTRY = (
    [(name, cache, _expected(name, cache)) for name in TINY_CONFIGS for cache in CACHES]
    + [("whisper", cache, _expected("whisper", cache)) for cache in CACHES]
    + [("t5", "dynamic", ENCODER_DECODER_REFUSAL), ("bart", "dynamic", ENCODER_DECODER_REFUSAL)]
)
# (backend, expected) on a tiny Llama.
BACKENDS = [
    ("eager", EXACT),
    ("sdpa", EXACT),
    ("flash_attention_2", "needs an attention backend that applies custom 4D masks"),
    ("flex_attention", "is not available on the CPU"),
]
# The caches every family runs in half precision too (the refusals do not depend on the dtype). float16 is native on
# CPUs with AVX512-FP16 and on accelerators; where it is not, torch still computes it, slowly.
HALF_PRECISION_CACHES = ("dynamic", "static")
HALF_PRECISION_DTYPES = ("bfloat16", "float16")
HALF_PRECISION_REGISTRY = [
    (name, cache, dtype, NEAR_GREEDY)
    for dtype in HALF_PRECISION_DTYPES
    for name, cache, expected in REGISTRY
    if expected == EXACT and cache in HALF_PRECISION_CACHES
]
DOCUMENT = Path(__file__).parents[1] / "docs" / "source" / "en" / "model_registry.md"


# Encoder-decoder families: architecture and a tiny config (built in `registry_model`).
ENCODER_DECODERS = {
    "whisper": "WhisperForConditionalGeneration",
    "t5": "T5ForConditionalGeneration",
    "bart": "BartForConditionalGeneration",
}
_ENCODER_DECODER_CONFIGS = {
    "whisper": {
        "vocab_size": 96,
        "d_model": 32,
        "encoder_layers": 2,
        "decoder_layers": 2,
        "encoder_attention_heads": 2,
        "decoder_attention_heads": 2,
        "encoder_ffn_dim": 64,
        "decoder_ffn_dim": 64,
        "num_mel_bins": 8,
        "max_source_positions": 16,
        "max_target_positions": 64,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "begin_suppress_tokens": None,
        "suppress_tokens": None,
        "init_std": 1.0,
    },
    "t5": {"vocab_size": 96, "d_model": 16, "d_ff": 32, "num_layers": 1, "num_heads": 2, "d_kv": 8},
    "bart": {
        "vocab_size": 96,
        "d_model": 16,
        "encoder_layers": 1,
        "decoder_layers": 1,
        "encoder_attention_heads": 2,
        "decoder_attention_heads": 2,
        "encoder_ffn_dim": 32,
        "decoder_ffn_dim": 32,
    },
}


def registry_model(name: str, attn_implementation: str | None = None, dtype: torch.dtype = torch.float32):
    """The tiny model of family `name` in `dtype` with lookahead enabled, and the inputs its `generate` takes."""
    if name not in ENCODER_DECODERS:
        # Checked first: the first lookahead call checks the model with passes of its own, not counted here.
        model = checked(enable_lookahead(tiny_model(name, attn_implementation).to(dtype), flat_state()))
        return model, random_prompt(20, seed=6)
    architecture = ENCODER_DECODERS[name]
    config_class = getattr(transformers, architecture.replace("ForConditionalGeneration", "Config"))
    config = config_class(**_ENCODER_DECODER_CONFIGS[name], decoder_start_token_id=1)
    torch.manual_seed(0)
    model = model_from_config(getattr(transformers, architecture), config, attn_implementation or "sdpa")
    model.generation_config.eos_token_id = None  # 30 tokens every time
    if name == "whisper":
        features = torch.randn(1, config.num_mel_bins, 2 * config.max_source_positions, generator=_seed(0))
        return enable_lookahead(model.to(dtype).eval(), flat_state()), features.to(dtype)
    return enable_lookahead(model.to(dtype).eval(), flat_state()), random_prompt(20, seed=6)


def _seed(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _check(test: unittest.TestCase, model, inputs: torch.Tensor, expected: str, **kwargs) -> None:
    common = {"max_new_tokens": NEW_TOKENS, "do_sample": False, **kwargs}
    if expected not in (EXACT, NEAR_GREEDY):
        with test.assertRaisesRegex(ValueError, re.escape(expected)):
            model.generate(inputs, lookahead_window=4, **common)
        return
    plain = model.generate(inputs, **common)
    passes = []
    hook = model.register_forward_hook(lambda *_: passes.append(1))
    for window in (4, "auto"):
        with test.subTest(window=window):
            passes.clear()
            # "auto" plans with a flat cost table: what it verifies must not depend on this machine's timings.
            out = model.generate(inputs, lookahead_window=window, **common)
            # Exactness alone would also hold for a decoder that never speculates: one pass per token (the prefill
            # gives the first) means no step accepted several.
            test.assertLess(len(passes), NEW_TOKENS, "no step accepted several tokens")
            if expected == EXACT:
                test.assertTrue(torch.equal(out, plain))
            else:
                _check_near_greedy(test, model, inputs, out, plain, **kwargs)
    hook.remove()


def _check_near_greedy(test: unittest.TestCase, model, inputs: torch.Tensor, out, plain, **kwargs) -> None:
    test.assertEqual(out.shape, plain.shape)
    name = "input_features" if model.config.is_encoder_decoder else "input_ids"
    margins, scales = greedy_margins(model, {name: inputs}, out[:, -NEW_TOKENS:], **kwargs)
    test.assertEqual(margins.shape[1], NEW_TOKENS)
    off = off_greedy_positions(margins, scales, model.dtype)
    test.assertEqual(off, [], f"tokens no near-tie of plain greedy's choice (largest margin {margins.max():.4f})")


class ModelRegistryTest(unittest.TestCase):
    @parameterized.expand(REGISTRY)
    def test_family_and_cache(self, name, cache, expected):
        model, inputs = registry_model(name)
        _check(self, model, inputs, expected, cache_implementation=None if cache == "dynamic" else cache)

    @parameterized.expand(
        [
            (f"{dtype}_{name}_{cache}", name, cache, dtype, expected)
            for name, cache, dtype, expected in HALF_PRECISION_REGISTRY
        ]
    )
    def test_family_and_cache_in_half_precision(self, _, name, cache, dtype, expected):
        model, inputs = registry_model(name, dtype=getattr(torch, dtype))
        self.assertEqual(model.dtype, getattr(torch, dtype))
        _check(self, model, inputs, expected, cache_implementation=None if cache == "dynamic" else cache)

    @parameterized.expand(BACKENDS)
    def test_attention_backend(self, backend, expected):
        model, inputs = registry_model("llama")
        if expected == EXACT:
            model.set_attn_implementation(backend)
        else:
            # Set by hand: the refusal only needs the name, not the kernels installed.
            set_attention_implementation_unchecked(model, backend)
        _check(self, model, inputs, expected)

    def test_document_is_current(self):
        from utils.render_registry import render

        self.assertEqual(
            DOCUMENT.read_text(), render(), "run `python utils/render_registry.py` to regenerate the registry page"
        )
