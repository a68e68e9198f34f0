import unittest

import torch
from parameterized import parameterized
from transformers import DynamicCache

from transformers_lookahead import CacheCommitter, NGramPool, StepLayout
from transformers_lookahead.cache_commit import attention_groups, layer_types
from transformers_lookahead.step_layout import AttentionGroup

from .utils import random_prompt, tiny_model


class CacheCommitTest(unittest.TestCase):
    @parameterized.expand(
        [("llama", "gather"), ("llama", "refeed"), ("gemma3", "gather"), ("mistral_window8", "gather")]
    )
    def test_commit_leaves_the_cache_of_plain_decoding(self, name, strategy):
        model = tiny_model(name, "eager")
        prompt = random_prompt(16, seed=5)[0]
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=prompt[None, :-1], cache=cache, use_cache=True)
        committer = CacheCommitter(cache, strategy)
        committer.start()
        # A tree whose first path is the model's own greedy continuation: it will be accepted whole.
        with torch.no_grad():
            greedy = model.generate(prompt[None], max_new_tokens=3, do_sample=False)[0, 16:].tolist()
        pool = NGramPool(continuation_length=3, max_per_key=2)
        pool.add(int(prompt[-1]), greedy)
        pool.add(int(prompt[-1]), [7, 8, 9])
        tree = pool.tree(int(prompt[-1]), 3)
        layout = StepLayout(2, 3, attention_groups(cache, layer_types(model)), torch.float32, torch.device("cpu"))
        step = layout.build(cache, prompt[-1:], 15, torch.arange(10, 16), tree)
        with torch.no_grad():
            model(
                input_ids=step.input_ids,
                position_ids=step.position_ids,
                attention_mask=step.attention_mask,
                cache=cache,
                use_cache=True,
            )
        path, node = [], -1
        for token in greedy[:2]:  # the last accepted token stays out of the cache
            node = tree.child(node, token)
            path.append(1 + 6 + node)
        committer.commit(step.length, 1, path)
        kept = 1 if strategy == "refeed" else 3
        expected_cache = DynamicCache(config=model.config)
        sequence = torch.cat([prompt, torch.tensor(greedy[:2])])[: 16 + kept - 1]
        with torch.no_grad():
            model(input_ids=sequence[None], cache=expected_cache, use_cache=True)
        self.assertEqual(cache.get_seq_length(), expected_cache.get_seq_length())
        for layer, expected in zip(cache.layers, expected_cache.layers):
            length = min(layer.keys.shape[-2], expected.keys.shape[-2])
            torch.testing.assert_close(layer.keys[..., -length:, :], expected.keys[..., -length:, :])
            torch.testing.assert_close(layer.values[..., -length:, :], expected.values[..., -length:, :])

    def test_unknown_strategy(self):
        with self.assertRaisesRegex(ValueError, "`lookahead_cache_commit` must be one of"):
            CacheCommitter(DynamicCache(), "copy")

    def test_groups(self):
        cache = DynamicCache(config=tiny_model("gemma3").config)
        groups = attention_groups(cache, layer_types(tiny_model("gemma3")))
        self.assertEqual(
            groups, {"sliding_attention": AttentionGroup(0, 8), "full_attention": AttentionGroup(1, None)}
        )
        self.assertEqual(
            attention_groups(DynamicCache(config=tiny_model("llama").config), None), AttentionGroup(0, None)
        )
