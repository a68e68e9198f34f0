import tempfile
import unittest

from parameterized import parameterized
from transformers import GenerationConfig

from transformers_lookahead import LookaheadConfig


class LookaheadConfigTest(unittest.TestCase):
    def test_defaults_when_only_window_is_given(self):
        config = LookaheadConfig.from_sources({"lookahead_window": 7})
        self.assertEqual((config.window, config.ngram, config.guess), (7, 5, 7))
        self.assertTrue(config.pool_from_prompt)
        self.assertEqual(config.cache_commit, "gather")
        self.assertEqual(config.levels, 4)
        self.assertFalse(config.adaptive)

    def test_auto(self):
        config = LookaheadConfig.from_sources({"lookahead_window": "auto"})
        self.assertTrue(config.adaptive)
        self.assertEqual((config.ngram, config.guess), (5, 8))
        config = LookaheadConfig.from_sources(
            {"lookahead_window": 3, "lookahead_ngram": "auto", "lookahead_guess": "auto"}
        )
        self.assertEqual((config.window, config.ngram, config.guess), (3, 5, 8))

    def test_no_window_means_off(self):
        self.assertIsNone(LookaheadConfig.from_sources({}, GenerationConfig()))

    def test_off_turns_a_saved_setting_off(self):
        saved = GenerationConfig(lookahead_window="auto", lookahead_ngram=4)
        self.assertIsNone(LookaheadConfig.from_sources({"lookahead_window": "off"}, saved))
        self.assertIsNone(LookaheadConfig.from_sources(GenerationConfig(lookahead_window="off"), default_window=4))
        self.assertEqual(LookaheadConfig.from_sources({}, saved, default_window=7).window, "auto")
        self.assertEqual(LookaheadConfig.from_sources({}, GenerationConfig(), default_window=7).window, 7)

    def test_fields_without_window_are_refused(self):
        with self.assertRaisesRegex(ValueError, "`lookahead_ngram` set without `lookahead_window`"):
            LookaheadConfig.from_sources({"lookahead_ngram": 3})

    def test_priority_of_sources(self):
        generation_config = GenerationConfig(lookahead_window=3, lookahead_ngram=4)
        config = LookaheadConfig.from_sources({"lookahead_window": 9, "lookahead_guess": None}, generation_config)
        self.assertEqual((config.window, config.ngram, config.guess), (9, 4, 9))

    @parameterized.expand(
        [
            ("lookahead_window", 0, "`lookahead_window` must be an integer >= 1"),
            ("lookahead_window", -3, "`lookahead_window` must be an integer >= 1"),
            ("lookahead_window", 2.5, "`lookahead_window` must be an integer >= 1"),
            ("lookahead_window", "big", "`lookahead_window` must be an integer >= 1"),
            ("lookahead_window", True, "`lookahead_window` must be an integer >= 1"),
            ("lookahead_ngram", 1, "`lookahead_ngram` must be an integer >= 2"),
            ("lookahead_ngram", 3.0, "`lookahead_ngram` must be an integer >= 2"),
            ("lookahead_guess", -1, "`lookahead_guess` must be an integer >= 0"),
            ("lookahead_pool_from_prompt", "yes", "`lookahead_pool_from_prompt` must be a bool"),
            ("lookahead_cache_commit", "copy", "`lookahead_cache_commit` must be one of"),
            ("lookahead_memory", "yes", "`lookahead_memory` must be a bool"),
            ("lookahead_memory_size", 0, "`lookahead_memory_size` must be an integer >= 1"),
            ("lookahead_memory_size", "big", "`lookahead_memory_size` must be an integer >= 1"),
            ("lookahead_memory_size", True, "`lookahead_memory_size` must be an integer >= 1"),
            ("lookahead_window", 65, "`lookahead_window` must be an integer >= 1 and <= 64"),
            ("lookahead_ngram", 17, "`lookahead_ngram` must be an integer >= 2 and <= 16"),
            ("lookahead_guess", 65, "`lookahead_guess` must be an integer >= 0 and <= 64"),
            ("lookahead_memory_size", (1 << 20) + 1, "`lookahead_memory_size` must be an integer >= 1 and <= 1048576"),
            ("lookahead_memory_namespace", "", "`lookahead_memory_namespace` must be a string of 1 to 64"),
            ("lookahead_memory_namespace", "../etc", "`lookahead_memory_namespace` must be a string of 1 to 64"),
            ("lookahead_memory_namespace", ".hidden", "`lookahead_memory_namespace` must be a string of 1 to 64"),
            ("lookahead_memory_namespace", 7, "`lookahead_memory_namespace` must be a string of 1 to 64"),
        ]
    )
    def test_invalid_values(self, field, value, message):
        sources = {"lookahead_window": "auto", field: value}
        with self.assertRaisesRegex(ValueError, message) as context:
            LookaheadConfig.from_sources(sources)
        self.assertIn(repr(value), str(context.exception))

    def test_largest_settings_and_the_step_they_imply(self):
        widest = LookaheadConfig.from_sources({"lookahead_window": 64, "lookahead_ngram": 9, "lookahead_guess": 63})
        self.assertEqual(widest.max_step_length(), 1 + 64 * 8 + 63 * 8)
        with self.assertRaisesRegex(ValueError, "make a step of up to 1025 tokens.*at most 1024") as context:
            LookaheadConfig.from_sources({"lookahead_window": 64, "lookahead_ngram": 9, "lookahead_guess": 64})
        for field in ("`lookahead_window`", "`lookahead_guess`", "`lookahead_ngram`"):
            self.assertIn(field, str(context.exception))

    def test_memory_defaults(self):
        auto = LookaheadConfig.from_sources({"lookahead_window": "auto"})
        self.assertEqual((auto.memory, auto.memory_size, auto.memory_namespace), (False, 65536, "default"))
        self.assertTrue(LookaheadConfig.from_sources({"lookahead_window": "auto", "lookahead_memory": True}).memory)
        self.assertFalse(LookaheadConfig.from_sources({"lookahead_window": 4}).memory)
        self.assertFalse(LookaheadConfig.from_sources({"lookahead_window": "auto", "lookahead_memory": False}).memory)

    def test_memory_with_a_fixed_window_is_refused(self):
        with self.assertRaisesRegex(
            ValueError, '`lookahead_memory=True` needs `lookahead_window="auto"`.*got lookahead_window=4'
        ):
            LookaheadConfig.from_sources({"lookahead_window": 4, "lookahead_memory": True})

    def test_generation_config_round_trip(self):
        generation_config = GenerationConfig(
            lookahead_window=7, lookahead_ngram=4, lookahead_guess=6, lookahead_pool_from_prompt=False
        )
        with tempfile.TemporaryDirectory() as tmp:
            generation_config.save_pretrained(tmp)
            loaded = GenerationConfig.from_pretrained(tmp)
        config = LookaheadConfig.from_sources(loaded)
        self.assertEqual((config.window, config.ngram, config.guess, config.pool_from_prompt), (7, 4, 6, False))
        memory_config = GenerationConfig(
            lookahead_window="auto",
            lookahead_memory=True,
            lookahead_memory_size=1000,
            lookahead_memory_namespace="tenant-a",
        )
        with tempfile.TemporaryDirectory() as tmp:
            memory_config.save_pretrained(tmp)
            config = LookaheadConfig.from_sources(GenerationConfig.from_pretrained(tmp))
        self.assertEqual((config.memory, config.memory_size, config.memory_namespace), (True, 1000, "tenant-a"))
