import json
import os
import tempfile
import unittest
from pathlib import Path
from unittest import mock

from transformers_lookahead.cost_measurement import (
    COST_DIR_VARIABLE,
    _non_decreasing,
    default_cost_dir,
    load_or_measure,
    measure_step_costs,
)

from .utils import MeasurementCounter, tiny_model


class CostMeasurementTest(unittest.TestCase):
    def test_a_measured_dip_is_noise(self):
        self.assertEqual(_non_decreasing([1.0, 1.75, 1.25, 1.5, 2.0]), [1.0, 1.5, 1.5, 1.5, 2.0])
        self.assertEqual(_non_decreasing([1.0, 1.5, 2.0]), [1.0, 1.5, 2.0])

    def test_measure_and_keep(self):
        model = tiny_model("llama")
        costs = measure_step_costs(model, grid=(1, 2, 4, 8))
        self.assertEqual(sorted(costs), [1, 2, 4, 8])
        self.assertEqual(costs[1], 1.0)
        self.assertEqual([costs[length] for length in (1, 2, 4, 8)], sorted(costs.values()), "never decreasing")
        with tempfile.TemporaryDirectory() as tmp, MeasurementCounter() as measure:
            load_or_measure(model, tmp)
            self.assertEqual(measure.count, 1)
            load_or_measure(model, tmp)
            self.assertEqual(measure.count, 1, "a kept table is read back, not measured again")
            (table,) = Path(tmp).glob("step-cost-*.json")
            table.write_text("{not json")
            load_or_measure(model, tmp)
            self.assertEqual(measure.count, 2, "a corrupt table is measured again")
            self.assertIn("relative_costs", json.loads(table.read_text()), "and replaced")
            table.write_text(json.dumps({"relative_costs": {"1": 1.0, "2": 1.5}}))
            load_or_measure(model, tmp)
            self.assertEqual(measure.count, 3, "a table measured the old way is measured again")
            load_or_measure(model, None)
            self.assertEqual(measure.count, 4, "without a directory every request measures")

    def test_a_hybrid_model_is_timed_in_chain_steps_each_undone(self):
        from .model_zoo import Architecture, build

        model = build(Architecture("qwen3_next", "Qwen3NextForCausalLM", "causal_lm"))
        passes = []
        model.register_forward_pre_hook(lambda module, args, kwargs: passes.append(kwargs), with_kwargs=True)
        costs = measure_step_costs(model, grid=(1, 2, 4), chain=True)
        self.assertEqual(sorted(costs), [1, 2, 4])
        steps = passes[1:]
        self.assertTrue(steps and all(step["attention_mask"] is None for step in steps), "chain steps: no 4D mask")
        cache = steps[-1]["cache"]
        # Every timed step was undone: the recurrent states and the attention entries are the prompt's alone.
        self.assertEqual(cache.layers[-1].get_seq_length(), passes[0]["input_ids"].shape[1])

    def test_unwritable_directory_is_harmless(self):
        model = tiny_model("llama")
        with tempfile.TemporaryDirectory() as tmp:
            blocker = Path(tmp) / "a_file"
            blocker.write_text("")
            # A directory below a regular file can be neither created nor written, even by root.
            with self.assertLogs("transformers_lookahead.cost_measurement", level="WARNING") as logs:
                costs = load_or_measure(model, blocker / "tables")
            self.assertEqual(costs(1), 1.0)
            self.assertEqual(len(logs.output), 2, logs.output)
            self.assertIn("measuring the cost of forward passes", logs.output[0])
            self.assertIn(COST_DIR_VARIABLE, logs.output[1])

    def test_a_measurement_is_announced_with_where_the_table_goes(self):
        model = tiny_model("llama")
        with tempfile.TemporaryDirectory() as tmp:
            with self.assertLogs("transformers_lookahead.cost_measurement", level="WARNING") as logs:
                load_or_measure(model, tmp)
            (table,) = Path(tmp).glob("step-cost-*.json")
            self.assertIn("84 forward passes", logs.output[0])
            self.assertIn(str(table), logs.output[0])
            self.assertIn("LookaheadState().cost_model(model)", logs.output[0], "how to measure ahead")
            with self.assertNoLogs("transformers_lookahead.cost_measurement", level="WARNING"):
                load_or_measure(model, tmp)

    def test_default_directory(self):
        with mock.patch.dict(os.environ, {COST_DIR_VARIABLE: "/somewhere/tables"}):
            self.assertEqual(default_cost_dir(), Path("/somewhere/tables"))
        with mock.patch.dict(os.environ, {COST_DIR_VARIABLE: "off"}):
            self.assertIsNone(default_cost_dir())
        environment = {k: v for k, v in os.environ.items() if k != COST_DIR_VARIABLE}
        with mock.patch.dict(os.environ, {**environment, "HF_HOME": "/hf"}, clear=True):
            self.assertEqual(default_cost_dir(), Path("/hf/lookahead/step_costs"))
