"""`RankSync` in one process (the multi-rank behaviour is tested under `torchrun` in `test_tensor_parallel.py`)."""

import unittest

import torch
import torch.distributed as dist
from transformers import LogitsProcessorList

from transformers_lookahead import LookaheadConfig
from transformers_lookahead.cost_model import StepCostModel
from transformers_lookahead.lookahead_decoding import SequenceState, step_fingerprint
from transformers_lookahead.rank_sync import RankSync
from transformers_lookahead.sequence_lookahead import SequenceStep, StepPlanner
from transformers_lookahead.step_layout import RowLayout
from transformers_lookahead.token_tree import TokenTree
from transformers_lookahead.verification import GreedyVerifier

from .utils import tiny_model


class RankSyncTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.started_group = not dist.is_initialized()
        if cls.started_group:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    @classmethod
    def tearDownClass(cls):
        if cls.started_group:
            dist.destroy_process_group()

    def test_a_model_on_one_device_needs_no_sync(self):
        self.assertIsNone(RankSync.for_model(tiny_model("llama")))

    def test_agree_and_check_in_a_group_of_one(self):
        sync = RankSync(dist.group.WORLD, torch.device("cpu"))
        table = StepCostModel({1: 1.0, 8: 1.5})
        agreed = sync.agree(table)
        self.assertEqual((agreed.lengths, agreed.costs), (table.lengths, table.costs))
        sync.check(3, 12345)
        sync.check(4, -(2**70))  # any Python int: reduced to 63 bits


class StepFingerprintTest(unittest.TestCase):
    def _plans(self, window_tokens):
        layout = RowLayout(2, 2, torch.device("cpu"))
        planner = StepPlanner(None, LookaheadConfig(window=2, ngram=3), False)
        sequence = SequenceState(
            0, torch.tensor([[5, 6, 7]]), 0, [5, 6, 7], 20, planner, GreedyVerifier(LogitsProcessorList())
        )
        offer = sequence.policy.offer(TokenTree(), True, 1)
        row = layout.row([7], 2, window_tokens, TokenTree())
        return [SequenceStep(sequence, sequence.policy.plan(offer), row)]

    def test_same_step_same_fingerprint_other_tokens_other_fingerprint(self):
        first = step_fingerprint(self._plans([1, 2, 3, 4]))
        self.assertEqual(first, step_fingerprint(self._plans([1, 2, 3, 4])))
        self.assertNotEqual(first, step_fingerprint(self._plans([1, 2, 3, 9])))
        self.assertNotEqual(first, step_fingerprint(self._plans(None)))
        self.assertEqual(step_fingerprint([]), 0)
