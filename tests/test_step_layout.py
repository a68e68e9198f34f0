import unittest

import torch
from parameterized import parameterized
from transformers import DynamicCache

from transformers_lookahead import StepLayout
from transformers_lookahead.cache_commit import attention_groups, layer_types
from transformers_lookahead.step_layout import AttentionGroup

from .utils import pool_tree, random_prompt, tiny_model


class StepLayoutTest(unittest.TestCase):
    def test_positions_and_visibility(self):
        # W=2, N=3 (2 levels), a tree 7 -> {8 -> 9, 5}
        layout = StepLayout(2, 2, AttentionGroup(0, None), torch.float32, torch.device("cpu"))
        cache = DynamicCache()
        window = torch.tensor([20, 21, 30, 31])
        tree = pool_tree(4, [[7, 8], [7, 9], [5, 6]], 2)
        step = layout.build(cache, [layout.row(torch.tensor([4]), 10, window, tree)])
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

    @parameterized.expand([("llama",), ("gpt2",), ("gemma3",), ("mistral_window8",)])
    def test_every_row_computes_what_its_context_computes(self, name):
        """Each step row must produce the logits of a plain forward over exactly the tokens it is meant to see."""
        model = tiny_model(name, "eager")
        prompt = random_prompt(20, seed=3)[0]
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=prompt[None, :-1], cache=cache, use_cache=True)
        cache.activate_past_recording()
        layout = StepLayout(3, 2, attention_groups(cache, layer_types(model)), torch.float32, torch.device("cpu"))
        window = torch.tensor([10, 11, 12, 13, 14, 15])
        tree = pool_tree(int(prompt[-1]), [[40, 41], [40, 42], [50, 51]], 2)
        position = prompt.shape[0] - 1
        step = layout.build(cache, [layout.row(prompt[-1:], position, window, tree)])
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


def _step_visibility(step):
    mask = step.attention_mask
    if isinstance(mask, dict):
        mask = mask["full_attention"]
    length = step.length
    return mask[0, 0, :, -length:] == 0
