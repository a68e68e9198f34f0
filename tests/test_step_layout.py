import unittest

import torch
from parameterized import parameterized
from transformers import DynamicCache

from transformers_lookahead.step_layout import (
    AttentionGroup,
    StepLayout,
    attention_groups,
    layer_types,
)

from .utils import pool_tree, random_prompt, tiny_model


class StepLayoutTest(unittest.TestCase):
    def test_positions_and_visibility(self):
        # W=2, N=3 (2 levels), a tree 7 -> {8 -> 9, 5}
        layout = StepLayout(2, 2, AttentionGroup(0, None), torch.float32, torch.device("cpu"))
        cache = DynamicCache()
        window = [20, 21, 30, 31]
        tree = pool_tree(4, [[7, 8], [7, 9], [5, 6]], 2)
        step = layout.build(cache, [layout.row([4], 10, window, tree)])
        self.assertEqual(step.input_ids[0, :5].tolist(), [4, 20, 21, 30, 31])
        # cur at p, L[l][i] at p + 1 + l + i, tree nodes at p + depth
        self.assertEqual(step.position_ids[0, :5].tolist(), [10, 11, 12, 12, 13])
        self.assertEqual(step.position_ids[0, 5:].tolist(), [10 + d for d in tree.depths])
        visible = step.attention_mask[0, 0] == 0
        expected_window = [
            [1, 1, 0, 0, 0],  # L0[0]: cur, itself
            [1, 1, 1, 0, 0],  # L0[1]: cur, L0[0], itself
            [1, 1, 0, 1, 0],  # L1[0]: cur, L0[0], itself
            [1, 1, 1, 0, 1],  # L1[1]: cur, L0[0..1], itself
        ]
        self.assertEqual(visible[1:5, :5].int().tolist(), expected_window)
        self.assertFalse(visible[1:5, 5:].any(), "the window must not see the tree")
        self.assertFalse(visible[5:, 1:5].any(), "the tree must not see the window")
        for node in range(len(tree)):
            seen = set(torch.nonzero(visible[5 + node, 5:]).flatten().tolist())
            self.assertEqual(seen, set(tree.ancestors(node)))
        top = [3, 4]  # the window's top level
        self.assertEqual(step.logits_rows.tolist(), [0] + top + list(range(5, 5 + len(tree))))

    @parameterized.expand([("llama",), ("gpt2",), ("gemma2",), ("gemma3",), ("cohere2",), ("mistral_window8",)])
    def test_every_row_computes_what_its_context_computes(self, name):
        """Each step row must produce the logits of a plain forward over exactly the tokens it is meant to see."""
        model, prompt, cache = _prefilled(name)
        cache.activate_past_recording()
        layout = StepLayout(3, 2, attention_groups(cache, layer_types(model)), torch.float32, torch.device("cpu"))
        window = [10, 11, 12, 13, 14, 15]
        tree = pool_tree(int(prompt[-1]), [[40, 41], [40, 42], [50, 51]], 2)
        position = prompt.shape[0] - 1
        step = layout.build(cache, [layout.row(prompt[-1:].tolist(), position, window, tree)])
        with torch.no_grad():
            logits = model(
                input_ids=step.input_ids,
                position_ids=step.position_ids,
                attention_mask=step.attention_mask,
                cache=cache,
                use_cache=True,
            ).logits[0]
        visible = _step_visibility(step)
        for row in range(step.length):
            context = step.input_ids[0, visible[row]]
            order = torch.argsort(step.position_ids[0, visible[row]])
            sequence = torch.cat([prompt[:-1], context[order]])
            self.assertEqual(int(step.position_ids[0, row]), sequence.shape[0] - 1)
            with torch.no_grad():
                expected = model(input_ids=sequence[None]).logits[0, -1]
            torch.testing.assert_close(logits[row], expected, rtol=1e-4, atol=1e-4)


def _prefilled(name: str):
    """A tiny eager model, a 20-token prompt and the cache of all but its last token."""
    model = tiny_model(name, "eager")
    prompt = random_prompt(20, seed=3)[0]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=prompt[None, :-1], cache=cache, use_cache=True)
    return model, prompt, cache


def _step_visibility(step):
    mask = step.attention_mask
    if isinstance(mask, dict):
        mask = mask["full_attention"]
    length = step.length
    return mask[0, 0, :, -length:] == 0


class FlexAttentionMaskTest(unittest.TestCase):
    """Flex attention takes the step's masks as `BlockMask`s; they must let through exactly what the float masks do."""

    @parameterized.expand([("llama",), ("gemma3",)])
    def test_block_mask_attends_like_the_additive_mask(self, name):
        from torch.nn.attention.flex_attention import flex_attention

        model, prompt, cache = _prefilled(name)
        groups = attention_groups(cache, layer_types(model))
        window = [10, 11, 12, 13, 14, 15]
        tree = pool_tree(int(prompt[-1]), [[40, 41], [40, 42], [50, 51]], 2)
        steps = {}
        for mask_format in ("additive", "block"):
            layout = StepLayout(3, 2, groups, torch.float32, torch.device("cpu"), mask_format)
            steps[mask_format] = layout.build(cache, [layout.row(prompt[-1:].tolist(), 19, window, tree)])
        additive, block = steps["additive"].attention_mask, steps["block"].attention_mask
        if not isinstance(additive, dict):
            additive, block = {"all": additive}, {"all": block}
        self.assertEqual(additive.keys(), block.keys())
        generator = torch.Generator().manual_seed(0)
        for kind in additive:
            length, kv_length = additive[kind].shape[-2:]
            query = torch.randn(1, 2, length, 8, generator=generator)
            key, value = torch.randn(2, 1, 2, kv_length, 8, generator=generator)
            expected = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=additive[kind])
            with self.subTest(kind=kind):
                self.assertEqual(tuple(block[kind].shape), (1, 1, length, kv_length))
                torch.testing.assert_close(flex_attention(query, key, value, block_mask=block[kind]), expected)

    def test_layout_for_a_flex_model_builds_block_masks(self):
        from torch.nn.attention.flex_attention import BlockMask

        model = tiny_model("llama", "flex_attention")
        layout = StepLayout.for_model(model, DynamicCache(config=model.config), 3, 2)
        step = layout.build(DynamicCache(), [layout.row([4, 5], 1, None, pool_tree(5, [[6]], 1))])
        self.assertIsInstance(step.attention_mask, BlockMask)
