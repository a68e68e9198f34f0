import unittest

import torch

from transformers_lookahead.lookahead_window import LookaheadWindow


class LookaheadWindowTest(unittest.TestCase):
    def test_initial_guesses_come_from_the_prompt_and_are_reproducible(self):
        prompt = [11, 12, 13, 14]
        state = torch.random.get_rng_state()
        first = LookaheadWindow(5, 3, prompt)
        self.assertTrue(torch.equal(state, torch.random.get_rng_state()), "the user's RNG must not move")
        second = LookaheadWindow(5, 3, prompt)
        self.assertEqual([len(level) for level in first.tokens], [5, 5, 5])
        self.assertEqual(first.tokens, second.tokens)
        self.assertTrue(set(first.flat()) <= set(prompt))
        self.assertEqual(len(first.flat()), 15)
        self.assertEqual(len(first), 15)

    def test_update_shifts_levels_and_yields_ngrams_after_warmup(self):
        window = LookaheadWindow(2, 3, [1, 2, 3])
        self.assertEqual(window.update([10, 20]), [])  # levels 0 and 1 still hold initial guesses
        self.assertEqual(window.update([11, 21]), [])
        self.assertEqual(window.tokens[1:], [[10, 20], [11, 21]])
        ngrams = window.update([12, 22])
        self.assertEqual(ngrams[0][1:], [10, 11, 12])
        self.assertEqual(ngrams[1][1:], [20, 21, 22])
        self.assertEqual(window.tokens, [[10, 20], [11, 21], [12, 22]])
        self.assertEqual(window.flat(), [10, 20, 11, 21, 12, 22])
        self.assertEqual(window.update([13, 23]), [[10, 11, 12, 13], [20, 21, 22, 23]])

    def test_two_gram_window_has_no_warmup(self):
        window = LookaheadWindow(3, 1, [5])
        self.assertEqual(window.update([1, 2, 3]), [[5, 1], [5, 2], [5, 3]])
        self.assertEqual(window.tokens, [[1, 2, 3]])
