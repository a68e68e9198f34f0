import unittest

import torch
from transformers import DynamicCache, EncoderDecoderCache
from transformers.modeling_outputs import BaseModelOutput

from transformers_lookahead.step_forward import StepForward, max_positions, select_rows, self_attention_cache
from transformers_lookahead.step_layout import StepLayout

from .test_model_registry import registry_model
from .utils import pool_tree, random_prompt, tiny_model


class StepForwardTest(unittest.TestCase):
    def test_decoder_only_step_returns_the_requested_rows(self):
        model = tiny_model("llama")
        prompt = random_prompt(12, seed=1)
        cache = DynamicCache(config=model.config)
        forward = StepForward(model, cache)
        with torch.no_grad():
            full = model(input_ids=prompt).logits[0]
            model(input_ids=prompt[:, :-3], cache=cache, use_cache=True)
            layout = StepLayout.for_model(model, forward.decoder_cache, 2, 2)
            step = layout.build(cache, [layout.row(prompt[0, -3:].tolist(), 11, None, pool_tree(0, [], 1))])
            logits = forward(step)
        self.assertEqual(tuple(logits.shape), (1, 1, model.config.vocab_size))
        torch.testing.assert_close(logits[0, 0], full[-1], rtol=1e-4, atol=1e-4)

    def test_encoder_decoder_needs_encoder_outputs(self):
        model, _ = registry_model("whisper")
        with self.assertRaisesRegex(ValueError, "pass the `encoder_outputs`"):
            StepForward(model, EncoderDecoderCache(DynamicCache(), DynamicCache()))

    def test_select_follows_the_rows(self):
        model, _ = registry_model("whisper")
        hidden = torch.arange(3 * 2 * 4, dtype=torch.float32).reshape(3, 2, 4)
        encoder_mask = torch.tensor([[1, 1], [0, 1], [1, 0]])
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        cache.self_attention_cache.update(torch.randn(3, 1, 5, 4), torch.randn(3, 1, 5, 4), 0)
        forward = StepForward(model, cache, BaseModelOutput(last_hidden_state=hidden), encoder_mask)
        keep = torch.tensor([2, 0])
        forward.select(keep)
        self.assertTrue(torch.equal(forward.encoder_outputs.last_hidden_state, hidden[keep]))
        self.assertTrue(torch.equal(forward.encoder_attention_mask, encoder_mask[keep]))
        self.assertEqual(cache.self_attention_cache.layers[0].keys.shape[0], 2)
        self.assertIs(forward.decoder_cache, cache.self_attention_cache)

    def test_select_rows_of_a_tuple(self):
        hidden = torch.randn(3, 2, 4)
        selected = select_rows((hidden, None), torch.tensor([1]))
        self.assertTrue(torch.equal(selected[0], hidden[1:2]))
        self.assertIsNone(selected[1])

    def test_self_attention_cache_and_positions(self):
        plain = DynamicCache()
        self.assertIs(self_attention_cache(plain), plain)
        whisper, _ = registry_model("whisper")
        self.assertEqual(max_positions(whisper), whisper.config.max_target_positions)
        llama = tiny_model("llama")
        self.assertEqual(max_positions(llama), llama.config.max_position_embeddings)
