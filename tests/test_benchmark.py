import unittest
from types import SimpleNamespace
from unittest import mock

import torch

from transformers_lookahead import LookaheadState, enable_lookahead
from utils.benchmark import (
    SPEECH,
    _decoded_tokens,
    _generated_lengths,
    format_batched_table,
    format_sampling_table,
    format_table,
    run_benchmark,
    summarize,
    summarize_batched,
    summarize_sampling,
)
from utils.faithfulness import (
    DEPARTURE_METHODS,
    _step_offset,
    first_departure,
    format_departures_table,
    run_departures,
    summarize_departures,
)
from utils.memory_benchmark import edit_prompts, format_memory_table, own_memory, summarize_memory

from .utils import flat_step_costs, random_prompt, tiny_model


def _run(method, prompt_id, category, seconds, passes, identical=True, repeat=0):
    return {
        "prompt_id": prompt_id,
        "category": category,
        "method": method,
        "repeat": repeat,
        "new_tokens": 100,
        "seconds": seconds,
        "forward_seconds": seconds * 0.9,
        "forward_passes": passes,
        "identical_to_greedy": identical,
    }


class BenchmarkSummaryTest(unittest.TestCase):
    def test_speedup_is_a_ratio_of_median_times(self):
        runs = []
        for repeat, noise in enumerate((0.0, 5.0, -0.5)):  # the median ignores the outlier
            runs.append(_run("greedy", "p1", "humaneval", 10.0 + noise, 100, repeat=repeat))
            runs.append(_run("lookahead_auto", "p1", "humaneval", 5.0 + noise / 10, 50, repeat=repeat))
            runs.append(_run("greedy", "q1", "writing", 4.0, 100, repeat=repeat))
            runs.append(_run("lookahead_auto", "q1", "writing", 8.0, 100, identical=False, repeat=repeat))
        rows = {(r["method"], r["category"]): r for r in summarize({"runs": runs})}
        humaneval = rows[("lookahead_auto", "humaneval")]
        self.assertAlmostEqual(humaneval["speedup"], 2.0)
        self.assertAlmostEqual(humaneval["tokens_per_forward"], 2.0)
        self.assertAlmostEqual(humaneval["host_share"], 0.1)
        self.assertEqual(humaneval["identical"], 1)
        writing = rows[("lookahead_auto", "writing")]
        self.assertAlmostEqual(writing["speedup"], 0.5)
        self.assertEqual(writing["identical"], 0)
        self.assertAlmostEqual(rows[("lookahead_auto", "mt_bench (all)")]["speedup"], 0.5)
        table = format_table(list(rows.values()))
        self.assertIn("lookahead_auto", table)
        self.assertIn("2.00x", table)

    def test_speech_prompts_are_their_own_group(self):
        runs = [_run("greedy", "s1", SPEECH, 2.0, 100), _run("lookahead_auto", "s1", SPEECH, 4.0, 100)]
        rows = {(r["method"], r["category"]): r for r in summarize({"runs": runs})}
        self.assertEqual(set(rows), {("greedy", SPEECH), ("lookahead_auto", SPEECH)})
        self.assertAlmostEqual(rows[("lookahead_auto", SPEECH)]["speedup"], 0.5)

    def test_decoded_tokens(self):
        text = SimpleNamespace(whisper=False, max_new_tokens=10)
        self.assertEqual(_decoded_tokens(torch.zeros(1, 12), 5, text), 7)
        speech = SimpleNamespace(whisper=True, max_new_tokens=10)
        # Whisper strips the EOS it decoded when the transcript ended before the limit.
        self.assertEqual(_decoded_tokens(torch.zeros(1, 6), 0, speech), 7)
        self.assertEqual(_decoded_tokens(torch.zeros(1, 10), 0, speech), 10)


class RepeatsTest(unittest.TestCase):
    def test_only_methods_that_keep_a_memory_get_a_namespace(self):
        self.assertEqual(own_memory({"lookahead_window": "auto"}, "r"), {"lookahead_memory_namespace": "r"})
        self.assertEqual(own_memory({"lookahead_window": "auto", "lookahead_memory": False}, "r"), {})
        self.assertEqual(own_memory({"lookahead_window": 7}, "r"), {})
        self.assertEqual(own_memory({}, "r"), {})

    def test_a_repeat_is_not_answered_from_the_memory_of_the_one_before(self):
        model = enable_lookahead(tiny_model("llama"), LookaheadState(cost_dir=None))
        ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
        args = SimpleNamespace(
            whisper=False,
            methods=["greedy", "lookahead_auto"],
            max_new_tokens=24,
            repeats=3,
            sweep_prompts=0,
            dtype="float32",
            command="test",
        )
        with (
            mock.patch("utils.benchmark._load", return_value=(model, None, torch.device("cpu"))),
            mock.patch("utils.benchmark._prompts", return_value=[("p", "c", ids, ids.shape[1])]),
        ):
            result = run_benchmark(args)
        passes = [run["forward_passes"] for run in result["runs"] if run["method"] == "lookahead_auto"]
        self.assertEqual(len(passes), 3)
        self.assertGreater(min(passes), 0.75 * max(passes), f"no repeat is answered from memory: {passes}")
        self.assertTrue(all(run["identical_to_greedy"] for run in result["runs"]))
        # The same call with the memory the repeats had shared is answered from it: what the namespaces prevent.
        again = model.generate(
            ids,
            max_new_tokens=24,
            do_sample=False,
            lookahead_window="auto",
            lookahead_memory_namespace="repeat-0",
            return_dict_in_generate=True,
        )
        self.assertLess(
            again.num_forward_passes, min(passes) / 2, f"repeats {passes}, from memory {again.num_forward_passes}"
        )


class SamplingAndBatchedSummaryTest(unittest.TestCase):
    def test_sampling_speedup_is_a_ratio_of_token_rates(self):
        runs = []
        for repeat in range(2):
            for prompt_id, category in (("h1", "humaneval"), ("m1", "writing")):
                runs.append(
                    {
                        "prompt_id": prompt_id,
                        "category": category,
                        "method": "sample",
                        "temperature": 0.7,
                        "repeat": repeat,
                        "new_tokens": 100,
                        "seconds": 10.0,
                        "forward_passes": 100,
                    }
                )
                runs.append(
                    {
                        "prompt_id": prompt_id,
                        "category": category,
                        "method": "lookahead_sample",
                        "temperature": 0.7,
                        "repeat": repeat,
                        "new_tokens": 50,
                        "seconds": 4.0,
                        "forward_passes": 25,
                    }
                )
        rows = {row["dataset"]: row for row in summarize_sampling({"runs": runs})}
        self.assertAlmostEqual(rows["all"]["sample_tokens_per_s"], 10.0)
        self.assertAlmostEqual(rows["all"]["lookahead_tokens_per_s"], 12.5)
        self.assertAlmostEqual(rows["humaneval"]["speedup"], 1.25)
        self.assertAlmostEqual(rows["mt_bench"]["median_prompt_speedup"], 1.25)
        self.assertAlmostEqual(rows["all"]["tokens_per_forward"], 2.0)
        checks = [
            {
                "temperature": 0.7,
                "new_tokens": 6,
                "runs": 300,
                "p_values": [0.5, 0.2],
                "runs_with_multi_token_steps": 10,
            }
        ]
        self.assertIn("lowest per-position p-value 0.200", format_sampling_table(list(rows.values()), checks))

    def test_batched_speedup_uses_median_batch_times(self):
        runs = []
        for repeat, noise in enumerate((0.0, 9.0, 0.0)):
            runs.append(
                {
                    "batch_size": 2,
                    "batch": 0,
                    "method": "greedy",
                    "repeat": repeat,
                    "new_tokens": 200,
                    "seconds": 10.0 + noise,
                    "forward_seconds": 9.0,
                    "identical_to_greedy": True,
                }
            )
            runs.append(
                {
                    "batch_size": 2,
                    "batch": 0,
                    "method": "lookahead_auto",
                    "repeat": repeat,
                    "new_tokens": 200,
                    "seconds": 8.0,
                    "forward_seconds": 7.6,
                    "identical_to_greedy": repeat != 1,
                }
            )
        (row,) = summarize_batched({"runs": runs})
        self.assertAlmostEqual(row["speedup"], 1.25)
        self.assertAlmostEqual(row["lookahead_tokens_per_s"], 25.0)
        self.assertAlmostEqual(row["lookahead_host_share"], 0.05)
        self.assertEqual((row["identical"], row["runs"]), (2, 3))
        self.assertIn("1.25x", format_batched_table([row]))

    def test_generated_lengths_stop_at_the_first_eos(self):
        generated = torch.tensor([[5, 2, 0, 0], [5, 6, 7, 8]])
        self.assertEqual(_generated_lengths(generated, 2).tolist(), [2, 4])
        self.assertEqual(_generated_lengths(generated, None).tolist(), [4, 4])


class MemoryBenchmarkSummaryTest(unittest.TestCase):
    def _runs(self):
        runs = []
        for method, seconds, passes in (
            ("greedy", 10.0, 100),
            ("prompt_lookup", 8.0, 80),
            ("auto_no_memory", 8.0, 70),
            ("auto_memory", 5.0, 40),
        ):
            for workload in ("humaneval_sequence", "sampled_repeat"):
                sampled = workload == "sampled_repeat"
                run = _run(method, "p1", "humaneval", seconds, passes, identical=None if sampled else True)
                del run["category"]
                runs.append({**run, "workload": workload})
        return runs

    def test_ratios_to_greedy_and_to_prompt_lookup(self):
        result = {
            "runs": self._runs(),
            "memory": [{"repeat": 0, "tokens": 300, "documents": 2}],
            "memory_bytes": 2**20,
        }
        rows = {(r["workload"], r["method"]): r for r in summarize_memory(result)}
        memory = rows[("humaneval_sequence", "auto_memory")]
        self.assertAlmostEqual(memory["speedup"], 2.0)
        self.assertAlmostEqual(memory["vs_prompt_lookup"], 2.0 / 1.25)
        self.assertAlmostEqual(memory["tokens_per_forward"], 2.5)
        self.assertAlmostEqual(memory["host_share"], 0.1)
        self.assertEqual(memory["identical"], "1/1")
        self.assertEqual(rows[("sampled_repeat", "auto_memory")]["identical"], "sampled")
        self.assertAlmostEqual(rows[("sampled_repeat", "auto_memory")]["speedup"], 2.0, msg="tokens/s ratio")
        table = format_memory_table(list(rows.values()), result)
        self.assertIn("300 tokens in 2 calls", table)
        self.assertIn("1.0 MiB", table)

    def test_edit_prompts_cycle_over_the_rewrites(self):
        prompts = edit_prompts(3)
        self.assertEqual(
            [prompt_id for prompt_id, _ in prompts], ["edit/HumanEval/0/0", "edit/HumanEval/1/1", "edit/HumanEval/2/2"]
        )
        self.assertNotIn('"""', prompts[0][1], "the docstring is for the answer to add")
        self.assertIn("Rename the variable `", prompts[1][1])
        self.assertIn("_renamed`", prompts[1][1])


class DeparturesTest(unittest.TestCase):
    def test_first_departure(self):
        self.assertIsNone(first_departure([1, 2, 3], [1, 2, 3]))
        self.assertEqual(first_departure([1, 5, 3], [1, 2, 3]), 1)
        self.assertEqual(first_departure([1, 2], [1, 2, 3]), 2, "stopping early is a departure")

    def test_where_a_token_sits_in_its_step(self):
        steps = (1, 3, 2)  # after the prefill's token 0: [1], [2, 3, 4], [5, 6]
        self.assertEqual([_step_offset(steps, position) for position in range(7)], [None, 0, 0, 1, 2, 0, 1])

    def test_nothing_departs_in_fp32_and_a_changed_method_does(self):
        model = enable_lookahead(tiny_model("llama"))
        tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=None)
        rows = [random_prompt(length, seed=seed) for seed, length in enumerate((9, 14, 6))]
        prompts = [(f"p{index}", "test", row, row.shape[1]) for index, row in enumerate(rows)]
        args = SimpleNamespace(max_new_tokens=20, dtype="float32")
        with flat_step_costs():
            result = run_departures(args, model, tokenizer, prompts)
        self.assertEqual(
            [row["departed"] for row in summarize_departures(result)], [0] * len(DEPARTURE_METHODS), result["prompts"]
        )
        self.assertIn("| lookahead_auto | 0 / 3 |", format_departures_table(summarize_departures(result), result))
        # A method that changes the text is seen departing where it does.
        changed = {**DEPARTURE_METHODS, "lookahead_auto": {"lookahead_window": 4, "repetition_penalty": 5.0}}
        with mock.patch.dict("utils.faithfulness.DEPARTURE_METHODS", changed):
            result = run_departures(args, model, tokenizer, prompts)
        changed_row = summarize_departures(result)[2]
        self.assertGreater(changed_row["departed"], 0)
        self.assertIsInstance(changed_row["median_margin_at_departure"], float, "plain greedy's margin there")
        self.assertRegex(
            changed_row["first_of_step"], r"^\d+ / \d+$", "where in its step the departing token was chosen"
        )
