import unittest

import torch
from parameterized import parameterized
from transformers import DynamicCache

from transformers_lookahead.chain_steps import ChainCommitter, ChainLayout, committer_for
from transformers_lookahead.step_forward import cache_argument
from transformers_lookahead.token_tree import TokenTree

from .utils import random_prompt, tiny_model


def _tiny_hybrid(model_type: str = "qwen3_next", class_name: str = "Qwen3NextForCausalLM"):
    """A tiny random hybrid model from Transformers' own config class (`tests/model_zoo.py`)."""
    from .model_zoo import Architecture, build

    return build(Architecture(model_type, class_name, "causal_lm"))


def _prefilled_cache(model, prompt):
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=prompt, **{cache_argument(model): cache}, use_cache=True)
    return cache


class ChainLayoutTest(unittest.TestCase):
    def test_consecutive_positions_and_the_padding_mask_plain_decoding_passes(self):
        layout = ChainLayout(torch.float32, torch.device("cpu"))
        tree = TokenTree()
        tree.add_path([8, 9])
        one = layout.build(DynamicCache(), [layout.row([4, 5], 10, None, tree)])
        self.assertEqual(one.input_ids.tolist(), [[4, 5, 8, 9]])
        self.assertEqual(one.position_ids.tolist(), [[9, 10, 11, 12]])
        self.assertEqual(one.logits_rows.tolist(), [1, 2, 3])
        self.assertIsNone(one.attention_mask, "one unpadded sequence: the model builds its causal mask")
        slot_valid = torch.tensor([[False, True, True], [True, True, True]])
        rows = [layout.row([4], 2, None, tree), layout.row([6], 3, None, TokenTree())]
        batch = layout.build(DynamicCache(), rows, slot_valid)
        self.assertEqual(batch.attention_mask.tolist(), [[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
        self.assertEqual(batch.input_ids[1, 0].item(), 6)

    def test_a_chain_row_holds_one_path_and_no_window(self):
        layout = ChainLayout(torch.float32, torch.device("cpu"))
        branching = TokenTree()
        branching.add_path([8, 9])
        branching.add_path([5])
        with self.assertRaisesRegex(ValueError, "one candidate continuation"):
            layout.row([4], 10, None, branching)
        with self.assertRaisesRegex(ValueError, "no window"):
            layout.row([4], 10, [1, 2], TokenTree())

    def test_a_chain_step_holds_one_candidate_path_and_every_row_keeps_as_many_tokens(self):
        layout = ChainLayout(torch.float32, torch.device("cpu"))
        tree = TokenTree()
        tree.add_path([8, 9, 10])
        tree.add_path([8, 4])
        chosen, window = layout.candidates(tree, True, pending=14)
        self.assertEqual((chosen.tokens, window), ([8, 9], False), "16 tokens in all, no window")
        from transformers_lookahead.verification import Verdict

        verdicts = [Verdict([1, 2, 3], [0, 1], [], []), Verdict([5], [], [], [])]
        self.assertEqual([v.tokens for v in layout.even_out(verdicts)], [[1], [5]])

    def test_full_caches_get_the_plain_committer(self):
        self.assertNotIsInstance(committer_for(DynamicCache(config=tiny_model("llama").config)), ChainCommitter)


class RecurrentStatesTest(unittest.TestCase):
    @parameterized.expand([("qwen3_next", "Qwen3NextForCausalLM"), ("falcon_h1", "FalconH1ForCausalLM")])
    def test_an_undone_step_leaves_the_model_as_before_it(self, model_type, class_name):
        model = _tiny_hybrid(model_type, class_name)
        prompt = random_prompt(12, seed=2)
        step, after = random_prompt(4, seed=3), random_prompt(2, seed=4)
        kwargs = {"use_cache": True}
        cache = _prefilled_cache(model, prompt)
        with torch.no_grad():
            expected = model(input_ids=after, **{cache_argument(model): cache}, **kwargs).logits
        cache = _prefilled_cache(model, prompt)
        committer = committer_for(cache)
        committer.start()
        self.assertIsInstance(committer, ChainCommitter)
        self.assertIsNotNone(committer.states)
        committer.before_step(feeds_guesses=True)
        with torch.no_grad():
            model(input_ids=step, **{cache_argument(model): cache}, **kwargs)
        committer.undo(step.shape[1])
        with torch.no_grad():
            again = model(input_ids=after, **{cache_argument(model): cache}, **kwargs).logits
        self.assertTrue(torch.equal(again, expected), "states put back and entries cropped: the same pass")

    def test_a_kept_step_must_keep_every_token(self):
        model = _tiny_hybrid()
        cache = _prefilled_cache(model, random_prompt(12, seed=2))
        committer = committer_for(cache)
        committer.start()
        committer.before_step(feeds_guesses=True)
        with torch.no_grad():
            model(input_ids=random_prompt(3, seed=3), **{cache_argument(model): cache}, use_cache=True)
        with self.assertRaisesRegex(RuntimeError, "must be undone"):
            committer.commit(3, [[0, 1]])
        self.assertEqual(committer.commit(3, [[0, 1, 2]]), 3)

    def test_keeping_batch_rows_selects_the_recurrent_states_too(self):
        from transformers_lookahead.cache_commit import keep_cache_rows

        model = _tiny_hybrid()
        prompts = torch.cat([random_prompt(8, seed=5), random_prompt(8, seed=6)])
        cache = _prefilled_cache(model, prompts)
        alone = _prefilled_cache(model, prompts[1:])
        keep_cache_rows(cache, torch.tensor([1]))
        after = random_prompt(2, seed=7)
        with torch.no_grad():
            selected = model(input_ids=after, **{cache_argument(model): cache}, use_cache=True).logits
            expected = model(input_ids=after, **{cache_argument(model): alone}, use_cache=True).logits
        torch.testing.assert_close(selected, expected, rtol=1e-5, atol=1e-5)


class IndexedAttentionBoundTest(unittest.TestCase):
    """Indexed (top-k sparse) attention: multi-token steps while a query sees at most `index_topk` keys, no later."""

    def test_steps_stay_within_the_top_k(self):
        from transformers_lookahead import enable_lookahead

        from .model_zoo import Architecture, build
        from .utils import flat_state

        architecture = Architecture("glm_moe_dsa", "GlmMoeDsaForCausalLM", "causal_lm")
        model = enable_lookahead(build(architecture, seed=1, index_topk=100), flat_state())
        model.generation_config.eos_token_id = None
        prompt = torch.cat([torch.randint(2, 120, (20,), generator=torch.Generator().manual_seed(0))] * 4)[None]
        expected = model.generate(prompt, max_new_tokens=40, do_sample=False)
        for window in (4, "auto"):
            with self.subTest(window=window):
                out = model.generate(
                    prompt, max_new_tokens=40, do_sample=False, lookahead_window=window, return_dict_in_generate=True
                )
                self.assertTrue(torch.equal(out.sequences, expected))
                # The context each step started from: the prompt, its first token, what earlier steps accepted.
                context = prompt.shape[1] + torch.tensor((0, *out.accepted_per_step)).cumsum(0)[:-1]
                within = [accepted for accepted, start in zip(out.accepted_per_step, context.tolist()) if start < 99]
                beyond = [accepted for accepted, start in zip(out.accepted_per_step, context.tolist()) if start >= 99]
                self.assertGreater(max(within), 1, "multi-token steps within the top-k")
                self.assertEqual(set(beyond), {1})


if __name__ == "__main__":
    unittest.main()
