"""The private Transformers APIs behind `compatibility.py` are where the package expects them."""

import unittest
from unittest import mock

import transformers
from transformers import GenerationMixin

from transformers_lookahead.compatibility import check_private_apis


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
