"""
The masked attention of lookahead passes over grouped key/value heads (`grouped_attention.py`): bit-identical to
Transformers' sdpa, which repeats the heads; registered under its own name and named only by lookahead passes, so
that another model compiled in the same process runs on untouched; and a lookahead pass then dispatches no more
operators than a plain one-token pass.
"""

import unittest

import torch
from parameterized import parameterized
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from experiments.operator_count import compare
from transformers_lookahead import LookaheadState, enable_lookahead
from transformers_lookahead.compatibility import GROUPED_SDPA, attention_implementation
from transformers_lookahead.grouped_attention import (
    grouped_sdpa,
    register_grouped_attention,
    takes_grouped_kv,
)

from .utils import random_prompt, tiny_model


class _Attention(torch.nn.Module):
    """What the attention function reads of a model's attention module."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def _inputs(batch, heads, groups, queries, keys, dim, dtype):
    generator = torch.Generator().manual_seed(queries * keys)
    query = torch.randn(batch, heads, queries, dim, generator=generator).to(dtype)
    key = torch.randn(batch, heads // groups, keys, dim, generator=generator).to(dtype)
    value = torch.randn(batch, heads // groups, keys, dim, generator=generator).to(dtype)
    hidden = torch.rand(batch, 1, queries, keys, generator=generator) < 0.3
    mask = torch.zeros(batch, 1, queries, keys, dtype=dtype).masked_fill(hidden, torch.finfo(dtype).min)
    return query, key, value, mask


class GroupedSdpaTest(unittest.TestCase):
    @parameterized.expand(
        [
            (dtype, shape)
            for dtype in (torch.float32, torch.bfloat16, torch.float16)
            for shape in ((1, 9, 3, 29, 300, 64), (2, 8, 4, 7, 1024, 64), (3, 14, 7, 33, 77, 64), (1, 4, 2, 2, 5, 8))
        ]
    )
    def test_bit_identical_to_repeated_heads(self, dtype, shape):
        batch, heads, groups, queries, keys, dim = shape
        query, key, value, mask = _inputs(*shape, dtype)
        module = _Attention(groups)
        stock, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=dim**-0.5)
        grouped, _ = grouped_sdpa(module, query, key, value, mask, scaling=dim**-0.5)
        self.assertEqual(grouped.shape, stock.shape)
        self.assertTrue(torch.equal(grouped, stock))

    @parameterized.expand(
        [
            ("one query token", 1, True, 2),
            ("no mask", 7, False, 2),
            ("no grouped heads", 7, True, 1),
        ]
    )
    def test_every_other_call_runs_the_registered_sdpa(self, _, queries, masked, groups):
        calls = []

        def registered_sdpa(module, query, key, value, attention_mask, *args, **kwargs):
            calls.append(attention_mask)
            return query.transpose(1, 2), None

        query, key, value, mask = _inputs(1, 4, groups, queries, 9, 8, torch.float32)
        with _registered_sdpa(registered_sdpa):
            grouped_sdpa(_Attention(groups), query, key, value, mask if masked else None)
        self.assertEqual(len(calls), 1)

    def test_a_masked_pass_over_grouped_heads_does_not_run_the_registered_sdpa(self):
        def registered_sdpa(*args, **kwargs):
            raise AssertionError("the registered sdpa ran")

        query, key, value, mask = _inputs(1, 4, 2, 7, 9, 8, torch.float32)
        with _registered_sdpa(registered_sdpa):
            output, _ = grouped_sdpa(_Attention(2), query, key, value, mask)
        self.assertEqual(output.shape, (1, 7, 4, 8))

    def test_registering_leaves_sdpa_as_it_was(self):
        stock = ALL_ATTENTION_FUNCTIONS["sdpa"]
        register_grouped_attention()
        register_grouped_attention()
        self.assertIs(ALL_ATTENTION_FUNCTIONS["sdpa"], stock)
        self.assertIs(ALL_ATTENTION_FUNCTIONS[GROUPED_SDPA], grouped_sdpa)


class _registered_sdpa:
    """Registers `function` as `"sdpa"` for the block, as a user's own sdpa would be, then puts the stock one back."""

    def __init__(self, function):
        self.function = function

    def __enter__(self):
        self.stock = ALL_ATTENTION_FUNCTIONS["sdpa"]
        AttentionInterface.register("sdpa", self.function)

    def __exit__(self, *exc):
        AttentionInterface.register("sdpa", self.stock)


class MarkedModelsTest(unittest.TestCase):
    @parameterized.expand(
        [
            ("llama, sdpa, grouped heads", "llama", "sdpa", {}, True),
            ("llama, eager", "llama", "eager", {}, False),
            ("llama, as many key/value heads as heads", "llama", "sdpa", {"num_key_value_heads": 4}, False),
        ]
    )
    def test_which_models_are_marked(self, _, name, attention, overrides, expected):
        self.assertEqual(takes_grouped_kv(tiny_model(name, attention, **overrides)), expected)

    @parameterized.expand([("llama",), ("qwen2",), ("qwen3",), ("gemma3",)])
    def test_a_lookahead_pass_dispatches_no_more_operators_than_a_one_token_pass(self, name):
        # Repeating the key/value heads for the masked attention added four operators per layer (unsqueeze, expand,
        # clone, view) to every lookahead pass.
        model = enable_lookahead(tiny_model(name), state=LookaheadState(cost_dir=None))
        counts = compare(model, random_prompt(24), new_tokens=8)
        self.assertLessEqual(counts["ratio"], 1.02, counts["difference"])
        self.assertGreater(counts["lookahead_tokens"], 1)

    def test_lookahead_greedy_is_plain_greedy(self):
        model = enable_lookahead(tiny_model("llama"), state=LookaheadState(cost_dir=None))
        prompt = random_prompt(24)
        plain = model.generate(prompt, max_new_tokens=40, do_sample=False)
        lookahead = model.generate(prompt, max_new_tokens=40, do_sample=False, lookahead_window=4)
        self.assertTrue(torch.equal(plain, lookahead))


class ProcessWideStateTest(unittest.TestCase):
    def test_another_compiled_model_neither_recompiles_nor_changes(self):
        # Enabling lookahead once re-registered `"sdpa"` for the whole process: a model compiled before then failed
        # the guard on that function at its next call and recompiled.
        torch._dynamo.reset()
        plain = tiny_model("llama")
        compiled = torch.compile(plain.forward, backend="eager")
        prompt = random_prompt(12)
        with torch.no_grad():
            before = compiled(input_ids=prompt, use_cache=False).logits
        counters = torch._dynamo.utils.counters
        graphs, recompiles = counters["stats"]["unique_graphs"], sum(counters["recompiles"].values())

        other = enable_lookahead(tiny_model("qwen2"), state=LookaheadState(cost_dir=None))
        self.assertTrue(takes_grouped_kv(other))
        outputs = other.generate(
            random_prompt(24), max_new_tokens=24, do_sample=False, lookahead_window=4, return_dict_in_generate=True
        )
        self.assertGreater(max(outputs.accepted_per_step), 1)
        self.assertEqual(attention_implementation(other), "sdpa")

        with torch.no_grad():
            after = compiled(input_ids=prompt, use_cache=False).logits
        self.assertEqual(counters["stats"]["unique_graphs"], graphs)
        self.assertEqual(sum(counters["recompiles"].values()), recompiles)
        self.assertTrue(torch.equal(before, after))


if __name__ == "__main__":
    unittest.main()
