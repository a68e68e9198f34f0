import unittest

from utils.recurrent_state_cost import measure
from utils.render_results import result_table

from .model_zoo import Architecture, build


class RecurrentStateCostTest(unittest.TestCase):
    def test_measures_the_copy_against_the_passes(self):
        model = build(Architecture("qwen3_next", "Qwen3NextForCausalLM", "causal_lm"))
        row = measure(model, context=12, chain=4, repeats=2)
        self.assertEqual(row["recurrent_layers"], 1)
        self.assertEqual((row["context"], row["chain"]), (12, 4))
        self.assertGreater(row["state_mib_per_sequence"], 0)
        for name in ("save_ms", "restore_ms", "one_token_pass_ms", "chain_pass_ms"):
            self.assertGreater(row[name], 0, name)
        table = "\n".join(result_table("state.json", {"recurrent_state": row}))
        self.assertIn("4-token chain pass", table)
        self.assertIn(f"{row['state_mib_per_sequence']} MiB", table)
