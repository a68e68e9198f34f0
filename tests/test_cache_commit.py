import unittest
from types import SimpleNamespace

import torch
from parameterized import parameterized
from transformers import DynamicCache

from transformers_lookahead.cache_commit import CacheCommitter, EntryMoves
from transformers_lookahead.ngram_pool import NGramPool
from transformers_lookahead.step_forward import cache_argument
from transformers_lookahead.step_layout import AttentionGroup, StepLayout, attention_groups, layer_types
from utils.faithfulness import greedy_margins, off_greedy_positions
from utils.transformers_compatibility import compile_config as compile_everywhere

from .utils import checked, flat_state, random_prompt, tiny_model


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
        step = layout.build(cache, [layout.row(prompt[-1:].tolist(), 15, list(range(10, 16)), tree)])
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
        committer.commit(step.length, [[0, *path]] if strategy == "gather" else [[0]])
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


class BatchedCommitTest(unittest.TestCase):
    """Rows keeping different numbers of tokens: full layers get holes, sliding layers stay right-aligned."""

    def _cache(self, held: int, step: int):
        config = tiny_model("gemma3").config  # layers 0 and 2 slide (window 8), layer 1 attends fully
        cache = DynamicCache(config=config)
        for layer_idx in range(len(cache.layers)):
            ids = torch.arange(held, dtype=torch.float32).expand(2, 1, held)[..., None]
            cache.update(ids, ids.clone(), layer_idx)
        cache.activate_past_recording()
        for layer_idx in range(len(cache.layers)):
            ids = (100 + torch.arange(step, dtype=torch.float32)).expand(2, 1, step)[..., None]
            cache.update(ids, ids.clone(), layer_idx)
        return cache

    @staticmethod
    def _entries(layer) -> list[list[int]]:
        return layer.keys[:, 0, :, 0].int().tolist()

    def test_sliding_rows_right_aligned_full_rows_with_holes(self):
        cache = self._cache(held=5, step=4)
        self.assertEqual(type(cache.layers[0]).__name__, "DynamicSlidingWindowLayer")
        added = CacheCommitter(cache).commit(4, [[0, 2], [0]])
        self.assertEqual(added, 2)
        sliding, full = self._entries(cache.layers[0]), self._entries(cache.layers[1])
        self.assertEqual(sliding[0], [0, 1, 2, 3, 4, 100, 102])
        self.assertEqual(sliding[1][1:], [0, 1, 2, 3, 4, 100])  # slot 0: filler
        self.assertEqual(full[0], [0, 1, 2, 3, 4, 100, 102])
        self.assertEqual(full[1][:6], [0, 1, 2, 3, 4, 100])  # slot 6: unused, masked from now on

    def test_sliding_layer_keeps_each_rows_latest_tokens(self):
        cache = self._cache(held=7, step=5)  # the sliding layer is full: 7 = window - 1 entries held
        CacheCommitter(cache).commit(5, [[0, 1, 3], [0]])
        sliding = self._entries(cache.layers[0])
        self.assertEqual(sliding[0], [3, 4, 5, 6, 100, 101, 103])
        self.assertEqual(sliding[1], [1, 2, 3, 4, 5, 6, 100])  # its filler fell out of the window


class StaticCacheTest(unittest.TestCase):
    """Static caches are written in place: a step lands after the held tokens and `crop` only moves the length."""

    def test_user_static_cache_is_never_reallocated(self):
        from transformers import StaticCache

        from transformers_lookahead import enable_lookahead

        # Checked first: the step check's own passes, which the first lookahead call runs, use caches of their own.
        model = checked(enable_lookahead(tiny_model("llama")))
        prompt = random_prompt(20, seed=8)
        expected = model.generate(prompt, max_new_tokens=40, do_sample=False)
        # Exactly the room plain decoding needs: steps near the end must shrink to fit.
        cache = StaticCache(config=model.config, max_cache_len=20 + 40 - 1)
        addresses = set()
        hook = model.register_forward_hook(lambda *args: addresses.add(cache.layers[0].keys.data_ptr()))
        try:
            out = model.generate(
                prompt,
                max_new_tokens=40,
                do_sample=False,
                lookahead_window=4,
                return_dict_in_generate=True,
                **{cache_argument(model): cache},
            )
        finally:
            hook.remove()
        self.assertTrue(torch.equal(out.sequences, expected))
        self.assertLess(out.num_forward_passes, 40, "the test text must let lookahead accept something")
        self.assertEqual(len(addresses), 1)

    def test_padded_row_with_static_cache(self):
        from transformers_lookahead import enable_lookahead

        model = enable_lookahead(tiny_model("qwen3"))
        prompt = random_prompt(16, seed=9)
        input_ids = torch.cat([torch.zeros(1, 4, dtype=torch.long), prompt], dim=1)
        attention_mask = torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.ones_like(prompt)], dim=1)
        common = {"max_new_tokens": 30, "do_sample": False, "cache_implementation": "static"}
        expected = model.generate(input_ids=input_ids, attention_mask=attention_mask, **common)
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, lookahead_window=4, **common)
        self.assertTrue(torch.equal(out, expected))

    def test_batch_with_static_cache_is_refused(self):
        from transformers_lookahead import enable_lookahead

        model = enable_lookahead(tiny_model("llama"))
        passes = []
        hook = model.register_forward_hook(lambda *_: passes.append(1))
        self.addCleanup(hook.remove)
        prompts = torch.cat([random_prompt(10, seed=1), random_prompt(10, seed=2)])
        for prompt, extra, rows in (
            (prompts, {}, 2),
            (prompts[:1], {"num_return_sequences": 3, "do_sample": True}, 3),
        ):
            with self.subTest(rows=rows):
                with self.assertRaisesRegex(
                    ValueError, f"static cache sized for plain decoding.*a batch of {rows} rows"
                ):
                    model.generate(
                        prompt, max_new_tokens=10, lookahead_window=4, cache_implementation="static", **extra
                    )
        self.assertEqual(passes, [], "refused before the prefill")


class CompiledStepTest(unittest.TestCase):
    """With a static cache and a compile config, steps have two shapes only, so the forward compiles at most twice."""

    @parameterized.expand(
        [(window, dtype) for dtype in (torch.float32, torch.bfloat16, torch.float16) for window in (4, "auto")]
    )
    def test_compiles_once_per_shape_and_stays_exact(self, window, dtype):
        import torch._dynamo

        from transformers_lookahead import enable_lookahead

        model = enable_lookahead(tiny_model("llama").to(dtype), flat_state())
        prompt = random_prompt(20, seed=6)
        common = {"max_new_tokens": 40, "do_sample": False, "cache_implementation": "static"}
        expected = model.generate(prompt, **common)
        # The eager backend traces and guards like inductor without generating code: fast enough for a unit test.
        compile_config = compile_everywhere(backend="eager", mode="default")
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        # With a flat cost table, as on an accelerator, "auto" takes full fixed-length steps wherever guesses exist,
        # whatever this machine's timings say.
        out = model.generate(
            prompt, compile_config=compile_config, lookahead_window=window, return_dict_in_generate=True, **common
        )
        if dtype == torch.float32:
            self.assertTrue(torch.equal(out.sequences, expected))
        else:
            margins, scales = greedy_margins(
                model, {"input_ids": prompt}, out.sequences[:, -40:], cache_implementation="static"
            )
            self.assertEqual(off_greedy_positions(margins, scales, dtype), [], "half precision: near-ties only")
        self.assertGreater(max(out.accepted_per_step), 1, "multi-token steps must have run")
        self.assertLess(out.num_forward_passes, 40)
        self.assertLessEqual(torch._dynamo.utils.counters["stats"]["unique_graphs"], 2)
        self.assertEqual(sum(torch._dynamo.utils.counters["recompiles"].values()), 0)


class EntryMovesTest(unittest.TestCase):
    """Every route of `EntryMoves` leaves what indexing each row's entries would."""

    @parameterized.expand(
        [
            ("one_row_in_place", [[0, 1, 2]]),
            ("one_row_overlapping_run", [[0, 2, 3, 4]]),
            ("one_row_distant_run", [[0, 6, 7]]),
            ("one_row_several_runs", [[0, 3, 5, 6]]),
            ("two_rows", [[0, 3, 4], [0, 1, 1]]),
            # Multi-head latent attention (DeepSeek-V3): keys and values of different head sizes.
            ("one_row_other_value_size", [[0, 2, 3, 4]], 6),
            ("two_rows_other_value_size", [[0, 3, 4], [0, 1, 1]], 6),
        ]
    )
    def test_moves_match_indexing(self, _, index, value_size=4):
        start, generator = 2, torch.Generator().manual_seed(0)
        keys = torch.randn(len(index), 3, 12, 4, generator=generator)
        values = torch.randn(len(index), 3, 12, value_size, generator=generator)
        layer = SimpleNamespace(keys=keys.clone(), values=values.clone())
        EntryMoves(index).apply(layer, start)
        for expected, moved in ((keys, layer.keys), (values, layer.values)):
            for b, offsets in enumerate(index):
                width = len(offsets)
                source = torch.tensor(offsets) + start
                self.assertTrue(torch.equal(moved[b, :, start : start + width], expected[b, :, source]))
                # Entries before `start` and past what moved stay as they were.
                self.assertTrue(torch.equal(moved[b, :, :start], expected[b, :, :start]))
                self.assertTrue(torch.equal(moved[b, :, start + width :], expected[b, :, start + width :]))
