import dataclasses
import unittest

import torch
from transformers import LogitsProcessorList

from transformers_lookahead import LookaheadConfig, LookaheadState
from transformers_lookahead.adaptive_planner import AdaptivePlanner, ContextCandidates
from transformers_lookahead.adaptive_policy import AdaptiveStepPolicy
from transformers_lookahead.cost_model import StepCostModel
from transformers_lookahead.sequence_lookahead import CandidateSource, PoolCandidates, SequenceLookahead, StepPlanner
from transformers_lookahead.step_layout import RowLayout
from transformers_lookahead.step_policy import StaticStepPolicy, StepChoice
from transformers_lookahead.token_tree import TokenTree
from transformers_lookahead.verification import GreedyVerifier, Verdict

from .utils import tiny_model

FLAT = StepCostModel({1: 1.0, 64: 1.0})
TEXT = [5, 6, 7, 8, 5, 6, 7, 9, 5]


class FixedPath(CandidateSource):
    """A source that always proposes the same continuation: a new source is this much code."""

    def __init__(self, path: list[int]):
        super().__init__(len(path))
        self.path = path

    def propose(self, sequence, tree, depth):
        tree.add_path(self.path[:depth])


class _State(LookaheadState):
    """A state without files whose `recall` is the test's."""

    def __init__(self, recall=lambda key: None, **kwargs):
        super().__init__(cost_dir=None, **kwargs)
        self.recall = recall


def _planner(config: LookaheadConfig, recall=lambda key: None, **kwargs) -> StepPlanner:
    # Without a model, so without the suffix memory.
    config = dataclasses.replace(config, memory=False)
    if not config.adaptive:
        return StepPlanner(None, config, do_sample=False, **kwargs)
    return AdaptivePlanner(None, config, _State(recall), do_sample=False, cost=FLAT, **kwargs)


def _sequence(config: LookaheadConfig, limit: int = 40, recall=lambda key: None, **kwargs) -> SequenceLookahead:
    planner = _planner(config, recall, **kwargs)
    return SequenceLookahead(list(TEXT), limit, planner, GreedyVerifier(LogitsProcessorList()))


LAYOUT = RowLayout(3, 2, torch.device("cpu"))


def _offer(sequence: SequenceLookahead, sources: list[CandidateSource], max_positions: int | None):
    """The sequence's offer from `sources`, for a model embedding `max_positions` positions."""
    sequence.sources, sequence.planner.max_positions = sources, max_positions
    return sequence.offer()


class StepPlannerTest(unittest.TestCase):
    def test_builds_a_complete_sequence_from_its_text(self):
        sequence = _sequence(LookaheadConfig(window=3, ngram=3, guess=4))
        self.assertEqual((sequence.length, sequence.position, sequence.pending), (9, 8, [5]))
        self.assertIsInstance(sequence.policy, StaticStepPolicy)
        self.assertEqual([type(source) for source in sequence.sources], [PoolCandidates])
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
        self.assertEqual([type(source) for source in sequence.sources], [PoolCandidates, ContextCandidates])
        self.assertEqual(asked, [(*sequence.policy.shape, False)], "greedy calls carry their own estimates")
        self.assertEqual(sequence.policy.estimates(), learnt)

    def test_sequences_share_one_pricing_that_starts_from_the_last_call_once(self):
        config = LookaheadConfig(window="auto", ngram=3)
        learnt = dataclasses.replace(_sequence(config).policy.estimates(), excess_scale=2.0, underpricing=((4, 1.5),))
        planner = _planner(config, recall=lambda key: learnt, timed=True)
        pricing = planner.pricing
        first = SequenceLookahead(list(TEXT), 40, planner, GreedyVerifier(LogitsProcessorList()))
        self.assertIs(first.policy.pricing, pricing)
        self.assertEqual(pricing.learnt(), (2.0, ((4, 1.5),)))
        # What the loop's steps teach it is kept when a later sequence joins (a continuous-batching request).
        pricing.observe(1, 0.01)
        pricing.observe(8, 0.04)
        taught = pricing.learnt()
        second = SequenceLookahead(list(TEXT), 40, planner, GreedyVerifier(LogitsProcessorList()))
        self.assertIs(second.policy.pricing, pricing)
        self.assertEqual(pricing.learnt(), taught)
        self.assertNotEqual(taught, (2.0, ((4, 1.5),)))
        carried = planner.estimates([first.policy, second.policy])
        self.assertEqual((carried.excess_scale, carried.underpricing), taught)
        self.assertEqual(carried.match_rate, learnt.match_rate)

    def test_finished_sequences_leave_their_estimates_and_text(self):
        config = LookaheadConfig(window="auto", ngram=3, memory=True)
        state = LookaheadState(cost_dir=None)
        planner = AdaptivePlanner(tiny_model("llama"), config, state, do_sample=False, cost=FLAT)
        sequence = SequenceLookahead(list(TEXT), 40, planner, GreedyVerifier(LogitsProcessorList()))
        self.assertIsNone(state.recall(planner.estimates_key(sequence.policy)))
        self.assertIsNone(planner.memory.match(TEXT[:4], 4), "an empty memory matches nothing")
        planner.finish([sequence])
        self.assertEqual(state.recall(planner.estimates_key(sequence.policy)), planner.estimates([sequence.policy]))
        self.assertIsNotNone(planner.memory.match(TEXT[:4], 4), "the text joined the suffix memory")

    def test_a_batch_is_priced_per_row_and_again_when_it_shrinks(self):
        steep = StepCostModel({1: 1.0, 2: 1.5, 4: 2.5, 8: 4.5, 16: 8.5, 64: 32.5})
        planner = AdaptivePlanner(
            None, LookaheadConfig(window="auto", memory=False), _State(), False, steep, batch_size=4
        )
        self.assertEqual(planner.pricing(2), steep.for_batch(4)(2))
        planner.price_batch(2)
        self.assertEqual(planner.pricing(2), steep.for_batch(2)(2))


class OfferTest(unittest.TestCase):
    def test_every_source_proposes_into_one_tree(self):
        sequence = _sequence(LookaheadConfig(window=3, ngram=3, guess=4))
        sources = [PoolCandidates(2), FixedPath([40, 41, 42])]
        offer = _offer(sequence, sources, max_positions=None)
        tree = offer.tree
        # The pool's continuation of 5 (6, 7) and the new source's path, each cut at its depth, in one tree.
        six = tree.child(-1, 6)
        self.assertIsNotNone(tree.child(six, 7))
        forty = tree.child(-1, 40)
        self.assertIsNotNone(tree.child(tree.child(forty, 41), 42))
        self.assertEqual(len(tree), 5)

    def test_sources_stop_at_the_room_the_sequence_has_left(self):
        sequence = _sequence(LookaheadConfig(window=3, ngram=3, guess=4), limit=len(TEXT) + 2)
        offer = _offer(sequence, [FixedPath([40, 41, 42])], max_positions=None)
        self.assertEqual(offer.tree.tokens, [40], "two tokens left: one candidate and the model's next token")
        # Positions 0..9 embedded: a candidate at position 9 still fits, none at 10.
        offer = _offer(sequence, [FixedPath([40, 41, 42])], max_positions=len(TEXT) + 1)
        self.assertEqual(offer.tree.tokens, [40])
        offer = _offer(sequence, [FixedPath([40, 41, 42])], max_positions=len(TEXT))
        self.assertEqual(offer.tree.tokens, [], "no position left past the next token's")

    def test_context_proposes_what_followed_the_suffix_earlier(self):
        sequence = _sequence(LookaheadConfig(window="auto", ngram=3))
        offer = _offer(sequence, [ContextCandidates(4)], max_positions=None)
        # The text ends in 5, which was followed by 6 7 9 5 the last time.
        self.assertEqual(offer.tree.tokens, [6, 7, 9, 5])


class SequenceStepTest(unittest.TestCase):
    def test_plans_within_the_budget_and_the_room(self):
        sequence = _sequence(LookaheadConfig(window=3, ngram=3, guess=4))
        offer = _offer(sequence, [PoolCandidates(2)], max_positions=None)
        whole = sequence.plan(offer, LAYOUT)
        self.assertTrue(whole.choice.use_window)
        self.assertEqual(whole.row.length, 1 + 6 + 2)
        self.assertEqual(sequence.plan(offer, LAYOUT, budget=1).row.length, 1, "a budget of 1 verifies nothing")
        # Cut to the room: the window goes first, then the least likely candidates; a cut choice does not calibrate.
        cut = sequence.plan(offer, LAYOUT, room=8)
        self.assertEqual((cut.choice.use_window, cut.row.length, cut.choice.predicted), (False, 3, 0.0))
        self.assertEqual(sequence.plan(offer, LAYOUT, room=2).row.length, 2)

    def test_accepts_until_it_stops(self):
        sequence = _sequence(LookaheadConfig(window=3, ngram=3, guess=4))
        verdict = Verdict([6, 7, 11], [0, 1], [torch.zeros(1, 4)] * 3, [torch.zeros(1, 4)] * 3)
        kept = sequence.accept(verdict, lambda token, raw, scores: token == 7)
        self.assertEqual((kept, sequence.tokens[-2:]), (2, [6, 7]))
        short = _sequence(LookaheadConfig(window=3, ngram=3, guess=4), limit=len(TEXT) + 1)
        self.assertEqual(short.accept(verdict, lambda *_: False), 1, "stops at its limit")

    def test_moves_the_sequence_past_a_step(self):
        sequence = _sequence(LookaheadConfig(window=3, ngram=3, guess=4))
        step = sequence.plan(_offer(sequence, [PoolCandidates(2)], max_positions=None), LAYOUT)
        before = [list(level) for level in sequence.window.tokens]
        # The step accepted 6 and 7 from the tree, then 11: three tokens appended to the text.
        sequence.tokens.extend([6, 7, 11])
        verdict = Verdict([6, 7, 11], [0, step.choice.tree.child(0, 7)], [], [])
        choices = [6, 21, 22, 23, 7, 11, 9]
        sequence.learn(step, verdict, 3, choices)
        self.assertEqual(sequence.pending, [11])
        self.assertEqual(sequence.accepted, [3])
        # The window's top level is the model's choices at its rows; the old top moved down.
        self.assertEqual(sequence.window.tokens, [before[1], [21, 22, 23]])
        # The text's new n-grams joined the pool.
        self.assertIn((7, 11), sequence.pool.continuations(6))

    def test_a_refeeding_step_feeds_what_it_kept_again(self):
        config = LookaheadConfig(window=3, ngram=3, guess=4, cache_commit="refeed")
        sequence = _sequence(config, refeed=True)
        offer = _offer(sequence, [PoolCandidates(2)], max_positions=None)
        choice = sequence.policy.plan(offer)
        step = sequence.plan(offer, LAYOUT, room=3)
        sequence.tokens.extend([6, 7, 11])
        verdict = Verdict([6, 7, 11], [0, choice.tree.child(0, 7)], [], [])
        sequence.learn(step, verdict, 3, [6, 7, 11])
        self.assertEqual(sequence.pending, [6, 7, 11])

    def test_an_undone_step_feeds_its_pending_and_kept_tokens_again(self):
        sequence = _sequence(LookaheadConfig(window=3, ngram=3, guess=4))
        step = sequence.plan(StepChoice.empty(sequence.policy.offer(TokenTree(), False, 1)).offer, LAYOUT)
        sequence.tokens.extend([6, 7])
        sequence.learn(step, Verdict([6, 7], [0], [], []), 2, [6, 7], undone=True)
        self.assertEqual(sequence.pending, [5, 6, 7])


if __name__ == "__main__":
    unittest.main()
