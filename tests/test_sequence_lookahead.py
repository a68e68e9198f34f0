import dataclasses
import unittest

import torch
from transformers import LogitsProcessorList

from transformers_lookahead import LookaheadConfig
from transformers_lookahead.cost_model import StepCostModel, StepPricing
from transformers_lookahead.sequence_lookahead import (
    CandidateSource,
    ContextCandidates,
    LookaheadFactory,
    PoolCandidates,
    SequenceLookahead,
    learn_from_step,
    offer_candidates,
)
from transformers_lookahead.step_layout import AttentionGroup, StepLayout
from transformers_lookahead.step_policy import AdaptiveStepPolicy, StaticStepPolicy
from transformers_lookahead.verification import GreedyVerifier, Verdict

FLAT = StepCostModel({1: 1.0, 64: 1.0})
TEXT = [5, 6, 7, 8, 5, 6, 7, 9, 5]


class FixedPath(CandidateSource):
    """A source that always proposes the same continuation: a new source is this much code."""

    def __init__(self, path: list[int]):
        super().__init__(len(path))
        self.path = path

    def propose(self, sequence, tree, depth):
        tree.add_path(self.path[:depth])


def _sequence(
    config: LookaheadConfig, limit: int = 40, recall=lambda key: None, pricing: StepPricing | None = None
) -> SequenceLookahead:
    pricing = pricing or (StepPricing(FLAT) if config.adaptive else None)
    factory = LookaheadFactory(config, window_size=3, do_sample=False, recall=recall, pricing=pricing)
    return factory.build(list(TEXT), limit, GreedyVerifier(LogitsProcessorList()))


class LookaheadFactoryTest(unittest.TestCase):
    def test_builds_a_complete_sequence_from_its_text(self):
        sequence = _sequence(LookaheadConfig(window=3, ngram=3, guess=4))
        self.assertEqual((sequence.length, sequence.position, sequence.pending), (9, 8, [5]))
        self.assertIsInstance(sequence.policy, StaticStepPolicy)
        self.assertIsNone(sequence.context)
        # The pool holds the text's n-grams; the window's guesses come from the text.
        self.assertEqual(sorted(sequence.pool.continuations(5)), [(6, 7)])
        self.assertEqual((sequence.window.window, sequence.window.levels), (3, 2))
        self.assertTrue(set(sequence.window.flat()) <= set(TEXT))

    def test_auto_starts_from_what_the_last_call_of_its_kind_left(self):
        asked = []
        learnt = _sequence(LookaheadConfig(window="auto", ngram=3)).policy.estimates()

        def recall(key):
            asked.append(key)
            return learnt

        sequence = _sequence(LookaheadConfig(window="auto", ngram=3), recall=recall)
        self.assertIsInstance(sequence.policy, AdaptiveStepPolicy)
        self.assertIsNotNone(sequence.context)
        self.assertEqual(asked, [(*sequence.policy.shape, False)], "greedy calls carry their own estimates")
        self.assertEqual(sequence.policy.estimates(), learnt)

    def test_sequences_share_one_pricing_that_starts_from_the_last_call_once(self):
        config = LookaheadConfig(window="auto", ngram=3)
        learnt = dataclasses.replace(_sequence(config).policy.estimates(), excess_scale=2.0, underpricing=((4, 1.5),))
        pricing = StepPricing(FLAT, timed=True)
        factory = LookaheadFactory(config, window_size=3, do_sample=False, recall=lambda key: learnt, pricing=pricing)
        first = factory.build(list(TEXT), 40, GreedyVerifier(LogitsProcessorList()))
        self.assertIs(first.policy.pricing, pricing)
        self.assertEqual(pricing.learnt(), (2.0, ((4, 1.5),)))
        # What the loop's steps teach it is kept when a later sequence joins (a continuous-batching request).
        pricing.observe(1, 0.01)
        pricing.observe(8, 0.04)
        taught = pricing.learnt()
        second = factory.build(list(TEXT), 40, GreedyVerifier(LogitsProcessorList()))
        self.assertIs(second.policy.pricing, pricing)
        self.assertEqual(pricing.learnt(), taught)
        self.assertNotEqual(taught, (2.0, ((4, 1.5),)))
        carried = factory.estimates([first.policy, second.policy])
        self.assertEqual((carried.excess_scale, carried.underpricing), taught)
        self.assertEqual(carried.match_rate, learnt.match_rate)


class OfferCandidatesTest(unittest.TestCase):
    def test_every_source_proposes_into_one_tree(self):
        sequence = _sequence(LookaheadConfig(window=3, ngram=3, guess=4))
        sources = [PoolCandidates(2), FixedPath([40, 41, 42])]
        offer = offer_candidates(sequence, sources, max_positions=None)
        tree = offer.tree
        # The pool's continuation of 5 (6, 7) and the new source's path, each cut at its depth, in one tree.
        six = tree.child(-1, 6)
        self.assertIsNotNone(tree.child(six, 7))
        forty = tree.child(-1, 40)
        self.assertIsNotNone(tree.child(tree.child(forty, 41), 42))
        self.assertEqual(len(tree), 5)

    def test_sources_stop_at_the_room_the_sequence_has_left(self):
        sequence = _sequence(LookaheadConfig(window=3, ngram=3, guess=4), limit=len(TEXT) + 2)
        offer = offer_candidates(sequence, [FixedPath([40, 41, 42])], max_positions=None)
        self.assertEqual(offer.tree.tokens, [40], "two tokens left: one candidate and the model's next token")
        # Positions 0..9 embedded: a candidate at position 9 still fits, none at 10.
        offer = offer_candidates(sequence, [FixedPath([40, 41, 42])], max_positions=len(TEXT) + 1)
        self.assertEqual(offer.tree.tokens, [40])
        offer = offer_candidates(sequence, [FixedPath([40, 41, 42])], max_positions=len(TEXT))
        self.assertEqual(offer.tree.tokens, [], "no position left past the next token's")

    def test_context_proposes_what_followed_the_suffix_earlier(self):
        sequence = _sequence(LookaheadConfig(window="auto", ngram=3))
        offer = offer_candidates(sequence, [ContextCandidates(4)], max_positions=None)
        # The text ends in 5, which was followed by 6 7 9 5 the last time.
        self.assertEqual(offer.tree.tokens, [6, 7, 9, 5])


class LearnFromStepTest(unittest.TestCase):
    def test_moves_the_sequence_past_a_step(self):
        config = LookaheadConfig(window=3, ngram=3, guess=4)
        sequence = _sequence(config)
        offer = offer_candidates(sequence, [PoolCandidates(2)], max_positions=None)
        choice = sequence.policy.plan(offer)
        layout = StepLayout(3, 2, AttentionGroup(0, None), torch.float32, torch.device("cpu"))
        row = layout.row(sequence.pending, sequence.position, sequence.window.flat(), choice.tree)
        before = [list(level) for level in sequence.window.tokens]
        # The step accepted 6 and 7 from the tree, then 11: three tokens appended to the text.
        sequence.tokens.extend([6, 7, 11])
        verdict = Verdict([6, 7, 11], [0, choice.tree.child(0, 7)], [], [])
        choices = [6, 21, 22, 23, 7, 11, 9]
        learn_from_step(sequence, choice, row, verdict, 3, choices, config)
        self.assertEqual(sequence.pending, [11])
        self.assertEqual(sequence.accepted, [3])
        # The window's top level is the model's choices at its rows; the old top moved down.
        self.assertEqual(sequence.window.tokens, [before[1], [21, 22, 23]])
        # The text's new n-grams joined the pool.
        self.assertIn((7, 11), sequence.pool.continuations(6))

    def test_a_refeeding_step_feeds_what_it_kept_again(self):
        config = LookaheadConfig(window=3, ngram=3, guess=4, cache_commit="refeed")
        sequence = _sequence(config)
        choice = sequence.policy.plan(offer_candidates(sequence, [PoolCandidates(2)], max_positions=None))
        layout = StepLayout(3, 2, AttentionGroup(0, None), torch.float32, torch.device("cpu"))
        row = layout.row(sequence.pending, sequence.position, None, choice.tree)
        sequence.tokens.extend([6, 7, 11])
        verdict = Verdict([6, 7, 11], [0, choice.tree.child(0, 7)], [], [])
        learn_from_step(sequence, choice, row, verdict, 3, [6, 7, 11], config, refeed=True)
        self.assertEqual(sequence.pending, [6, 7, 11])


if __name__ == "__main__":
    unittest.main()
