"""The private Transformers APIs behind `compatibility.py` are where the package expects them."""

import unittest
from types import SimpleNamespace
from unittest import mock

import torch
import transformers
from parameterized import parameterized
from transformers import GenerationMixin, StoppingCriteria, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from transformers_lookahead.compatibility import EntryMoves, TokenStoppingCriteria, check_private_apis


class PrivateApiTest(unittest.TestCase):
    def test_private_apis_are_in_place(self):
        problems = check_private_apis()
        self.assertEqual(
            problems,
            [],
            f"Transformers {transformers.__version__} changed private APIs lookahead decoding relies on; adapt "
            "src/transformers_lookahead/compatibility.py: " + "; ".join(problems),
        )

    def test_a_moved_api_is_named(self):
        with mock.patch.object(GenerationMixin, "_valid_auto_compile_criteria", None):
            problems = check_private_apis()
        self.assertEqual(len(problems), 1)
        self.assertIn("_valid_auto_compile_criteria", problems[0])

    def test_a_changed_signature_is_named(self):
        def _prefill(self, input_ids, model_kwargs):
            raise AssertionError("not called")

        with mock.patch.object(GenerationMixin, "_prefill", _prefill):
            problems = check_private_apis()
        self.assertEqual(len(problems), 1)
        self.assertIn("_prefill", problems[0])


class EntryMovesTest(unittest.TestCase):
    """Every route of `EntryMoves` leaves what indexing each row's entries would."""

    @parameterized.expand(
        [
            ("one_row_in_place", [[0, 1, 2]]),
            ("one_row_overlapping_run", [[0, 2, 3, 4]]),
            ("one_row_distant_run", [[0, 6, 7]]),
            ("one_row_several_runs", [[0, 3, 5, 6]]),
            ("two_rows", [[0, 3, 4], [0, 1, 1]]),
        ]
    )
    def test_moves_match_indexing(self, _, index):
        start, generator = 2, torch.Generator().manual_seed(0)
        keys = torch.randn(len(index), 3, 12, 4, generator=generator)
        values = torch.randn(len(index), 3, 12, 4, generator=generator)
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


class TokenStoppingCriteriaTest(unittest.TestCase):
    def test_decides_as_the_default_criteria(self):
        criteria = StoppingCriteriaList([MaxLengthCriteria(6), EosTokenCriteria([2, 5])])
        stops = TokenStoppingCriteria.of(criteria)
        for tokens in ([1, 3, 4], [1, 3, 2], [1, 3, 5], [1, 3, 4, 4, 4, 4], [1, 3, 4, 4, 4, 2, 4]):
            with self.subTest(tokens=tokens):
                expected = bool(criteria(torch.tensor([tokens]), None).any())
                self.assertEqual(stops(len(tokens), tokens[-1]), expected)

    def test_other_criteria_are_left_to_themselves(self):
        class Never(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return torch.zeros(input_ids.shape[0], dtype=torch.bool)

        self.assertIsNone(TokenStoppingCriteria.of(StoppingCriteriaList([MaxLengthCriteria(6), Never()])))
        # Past `max_position_embeddings`, `MaxLengthCriteria` warns: the criteria themselves are asked there.
        stops = TokenStoppingCriteria.of(StoppingCriteriaList([MaxLengthCriteria(9, max_position_embeddings=4)]))
        self.assertFalse(stops(4, 1))
        self.assertIsNone(stops(5, 1))
