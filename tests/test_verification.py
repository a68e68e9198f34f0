import math
import unittest

import torch
from parameterized import parameterized
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

from transformers_lookahead import enable_lookahead
from transformers_lookahead.verification import (
    GreedyVerifier,
    PositionNoise,
    SamplingVerifier,
    Verdict,
    _half_precision_argmax,
    greedy_tokens,
    read_choices,
)
from utils.distribution_check import chi_square_p_value, homogeneity_p_value

from .utils import SMALL_VOCABULARY, flat_state, pool_tree, small_vocabulary_model

# Two-sample and goodness-of-fit tests below reject at this p-value; with the handful of tests run, a false alarm
# is expected about once in ten thousand runs of the suite.
P_VALUE = 1e-5


class GreedyVerifierTest(unittest.TestCase):
    def test_walks_the_matching_path_and_adds_one_token(self):
        vocab = 10
        tree = pool_tree(0, [[3, 4], [5, 6]], 2)
        rows = torch.full((1 + len(tree), vocab), -5.0)

        def prefer(row, token):
            rows[row, token] = 5.0

        prefer(0, 5)  # after the key the model picks 5: the path through 5
        five = tree.child(-1, 5)
        prefer(1 + five, 6)
        six = tree.child(five, 6)
        prefer(1 + six, 9)
        for node in range(len(tree)):
            if node not in (five, six):
                prefer(1 + node, 1)
        verdict = GreedyVerifier(LogitsProcessorList()).verify(rows, tree, 1, torch.tensor([[0]]), max_tokens=10)
        self.assertEqual(verdict.tokens, [5, 6, 9])
        self.assertEqual(verdict.nodes, [five, six])
        verdict = GreedyVerifier(LogitsProcessorList()).verify(rows, tree, 1, torch.tensor([[0]]), max_tokens=2)
        self.assertEqual(verdict.tokens, [5, 6])


def _with_bits(row: torch.Tensor, index: int, bits: int) -> torch.Tensor:
    """`row` (half precision) with the value at `index` replaced by the 16-bit pattern `bits`."""
    row = row.clone()
    row.view(torch.int16)[index] = bits - (1 << 16) if bits >= 1 << 15 else bits
    return row


class VerdictTest(unittest.TestCase):
    def test_truncated_keeps_a_prefix_of_tokens_nodes_logits_and_scores(self):
        logits = [torch.full((1, 3), float(i)) for i in range(3)]
        verdict = Verdict([5, 6, 7], [0, 1], logits, [t + 1 for t in logits])
        kept = verdict.truncated(2)
        self.assertEqual((kept.tokens, kept.nodes), ([5, 6], [0]))
        self.assertEqual([t[0, 0].item() for t in kept.logits], [0.0, 1.0])
        self.assertEqual([t[0, 0].item() for t in kept.scores], [1.0, 2.0])
        self.assertEqual(verdict.truncated(1).nodes, [])


class GreedyTokensTest(unittest.TestCase):
    """`greedy_tokens` chooses what `torch.argmax` of the float32 logits chooses (plain greedy's rule)."""

    @parameterized.expand([("bfloat16", torch.bfloat16), ("float16", torch.float16), ("float32", torch.float32)])
    def test_first_maximum_of_the_float32_logits(self, _, dtype):
        generator = torch.Generator().manual_seed(0)
        logits = (torch.randn(6, 300, generator=generator) * 4 + 1).to(dtype)
        logits[1, 17] = logits[1, 250] = logits[1].max() + 1  # a tie: the first maximum wins
        expected = logits.float().argmax(-1)
        self.assertTrue(torch.equal(greedy_tokens(logits), expected))
        self.assertTrue(torch.equal(greedy_tokens(logits[2]), expected[2]))
        self.assertTrue(torch.equal(greedy_tokens(logits[None]), expected[None]))
        self.assertEqual(read_choices(logits[None]), expected[None].tolist())
        self.assertEqual(read_choices(logits[2]), int(expected[2]))
        if dtype != torch.float32:
            # The bit-pattern route answered, not the float32 fallback.
            self.assertEqual(_half_precision_argmax(logits).tolist(), expected.tolist())

    @parameterized.expand([("bfloat16", torch.bfloat16, 0x7F80), ("float16", torch.float16, 0x7C00)])
    def test_rows_the_bit_patterns_would_misorder_fall_back(self, _, dtype, infinity):
        row = (torch.randn(64, generator=torch.Generator().manual_seed(1)) - 1).abs().to(dtype)
        cases = {
            "all negative": -row,
            "zero maximum after a negative zero": torch.cat([torch.tensor([-0.0]), -row[1:]]).to(dtype),
            "positive infinity": _with_bits(row, 9, infinity),
            "positive NaN": _with_bits(row, 11, infinity | 0x40),
            "negative NaN": _with_bits(row, 13, infinity | 0x8040),
        }
        cases["zero maximum after a negative zero"][7] = 0.0
        for name, case in cases.items():
            with self.subTest(name):
                self.assertIsNone(_half_precision_argmax(case))
                self.assertEqual(int(greedy_tokens(case)), int(case.float().argmax()))


class SamplingVerifierTest(unittest.TestCase):
    CANDIDATES = [("two_candidates", [[2], [5]]), ("likely_candidate", [[0], [1], [2]]), ("no_candidate", [])]
    LOGITS = torch.tensor([[2.0, 1.5, 0.3, -1.0, 0.0, 1.0, -0.5, 0.7]])

    def _first_token(self, continuations, seed: int) -> int:
        tree = pool_tree(9, continuations, 1) if continuations else pool_tree(9, [[1]], 0)
        rows = torch.cat([self.LOGITS, torch.zeros(len(tree), self.LOGITS.shape[1])])
        verifier = SamplingVerifier(LogitsProcessorList(), PositionNoise(seed))
        return verifier.verify(rows, tree, 1, torch.tensor([[9]]), max_tokens=1).tokens[0]

    @parameterized.expand(CANDIDATES)
    def test_first_token_follows_the_model_distribution(self, _, continuations):
        vocab, draws = self.LOGITS.shape[1], 20000
        counts = torch.zeros(vocab)
        for seed in range(draws):
            counts[self._first_token(continuations, seed)] += 1
        expected = torch.softmax(self.LOGITS[0].double(), -1) * draws
        statistic = float(((counts.double() - expected) ** 2 / expected).sum())
        self.assertGreater(chi_square_p_value(statistic, vocab - 1), P_VALUE)

    def test_the_token_does_not_depend_on_the_candidates(self):
        for seed in range(200):
            tokens = {self._first_token(continuations, seed) for _, continuations in self.CANDIDATES}
            self.assertEqual(len(tokens), 1, f"seed {seed}")


class PositionNoiseTest(unittest.TestCase):
    def test_a_function_of_seed_and_position(self):
        noise = PositionNoise(7)
        self.assertTrue(torch.equal(noise(3, 50), PositionNoise(7)(3, 50)))
        self.assertFalse(torch.equal(noise(3, 50), noise(4, 50)))
        self.assertFalse(torch.equal(noise(3, 50), PositionNoise(8)(3, 50)))

    def test_standard_gumbel(self):
        values = torch.cat([PositionNoise(0)(position, 1000) for position in range(100)])
        # Mean: the Euler-Mascheroni constant; variance: pi^2 / 6 (standard errors about 0.004 and 0.02).
        self.assertAlmostEqual(float(values.mean()), 0.5772, delta=0.03)
        self.assertAlmostEqual(float(values.var()), math.pi**2 / 6, delta=0.1)


class LookaheadSamplingDistributionTest(unittest.TestCase):
    """The first tokens sampled with lookahead follow plain sampling's distribution, under several warpers."""

    @classmethod
    def setUpClass(cls):
        cls.model = enable_lookahead(small_vocabulary_model(), flat_state())
        # A repetitive prompt: the pool and the context copy then propose candidates that often get accepted.
        cls.prompt = torch.tensor([[3, 4, 5, 3, 4, 5, 3, 4, 5, 3, 4]])

    @parameterized.expand(
        [
            ("temperature_0.7", {"temperature": 0.7}, {"lookahead_window": 2, "lookahead_ngram": 3}),
            (
                "top_k_top_p",
                {"temperature": 1.0, "top_k": 6, "top_p": 0.9},
                {"lookahead_window": 2, "lookahead_ngram": 3},
            ),
            # "auto" with the suffix memory: every call adds its sample, so later calls verify earlier samples.
            ("auto_with_memory", {"temperature": 0.7}, {"lookahead_window": "auto"}),
        ]
    )
    def test_first_tokens(self, _, warpers, lookahead):
        runs, new_tokens = 1500, 5
        counts = {label: torch.zeros(new_tokens, SMALL_VOCABULARY) for label in ("plain", "lookahead")}
        accepted_more_than_one = 0
        # A flat cost table: "auto" verifies what it is offered, whatever this machine's timings.
        for _ in range(runs):
            for label, extra in (("plain", {}), ("lookahead", lookahead)):
                out = self.model.generate(
                    self.prompt,
                    do_sample=True,
                    max_new_tokens=new_tokens,
                    return_dict_in_generate=True,
                    **warpers,
                    **extra,
                )
                generated = out.sequences[0, self.prompt.shape[1] :]
                counts[label][torch.arange(new_tokens), generated] += 1
                if label == "lookahead":
                    accepted_more_than_one += any(a > 1 for a in out.accepted_per_step)
        self.assertGreater(accepted_more_than_one, runs // 20, "the test must exercise multi-token acceptance")
        for position in range(new_tokens):
            with self.subTest(position=position):
                p_value = homogeneity_p_value(counts["plain"][position], counts["lookahead"][position])
                self.assertGreater(p_value, P_VALUE)

    def test_reproducible_with_a_seed(self):
        outputs = []
        for _ in range(2):
            torch.manual_seed(123)
            outputs.append(self.model.generate(self.prompt, do_sample=True, max_new_tokens=20, lookahead_window=3))
        self.assertTrue(torch.equal(outputs[0], outputs[1]))


class WarperListTest(unittest.TestCase):
    def test_processors_are_applied_before_the_rule(self):
        processors = LogitsProcessorList([TemperatureLogitsWarper(0.5), TopKLogitsWarper(2)])
        logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
        tree = pool_tree(0, [[2], [3]], 1)  # both candidates are outside the top 2: never accepted
        rows = torch.cat([logits, torch.zeros(len(tree), 4)])
        tokens = {
            SamplingVerifier(processors, PositionNoise(seed)).verify(rows, tree, 1, torch.tensor([[0]]), 1).tokens[0]
            for seed in range(300)
        }
        self.assertEqual(tokens, {0, 1})
