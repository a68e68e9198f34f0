import io
import json
import os
import statistics
import tempfile
import threading
import unittest
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch
from parameterized import parameterized

from transformers_lookahead import LookaheadState, enable_lookahead
from utils import benchmark, cb_benchmark
from utils.batched_benchmark import _generated_lengths, summarize_batched
from utils.benchmark import (
    REFERENCE,
    _decoded_tokens,
    native_half_precision,
    run_benchmark,
    summarize,
)
from utils.cb_benchmark import ENGINES as CB_ENGINES
from utils.cb_benchmark import (
    PADDED_ENGINES,
    arrival_times,
    engine_config,
    full_load_rate,
    run_continuous_batching,
    summarize_continuous_batching,
)
from utils.faithfulness import (
    DEPARTURE_METHODS,
    DEPARTURE_SIGNIFICANCE,
    STATIC_CACHE_ROOM,
    _batch_pair,
    _step_offset,
    first_departure,
    greedy_margins,
    near_tie_tolerance,
    off_greedy_positions,
    paired_departure_test,
    run_departures,
    summarize_departures,
)
from utils.memory_benchmark import edit_prompts, own_memory, summarize_memory
from utils.quality import (
    QUALITY_METHODS,
    completion_program,
    merge_quality,
    program_passes,
    summarize_quality,
)
from utils.quality import main as quality_main
from utils.render_results import result_table
from utils.sampling_benchmark import summarize_sampling
from utils.timing import ForwardTimer
from utils.tiny_models import left_padded
from utils.workload import SPEECH, Workload

from .utils import flat_state, random_prompt, tiny_model


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


def _benchmark_args(**settings) -> SimpleNamespace:
    """The parsed arguments `run_benchmark` reads: greedy and "auto", plus `settings`."""
    return SimpleNamespace(whisper=False, methods=["greedy", "lookahead_auto"], command="test", **settings)


class FixedWorkload(Workload):
    """
    A benchmark's workload of given models (by dtype; `None`: the run's own) and prompts, on the CPU; with no models,
    one that fails the test if a benchmark loads anything.
    """

    def __init__(self, models: dict | None = None, prompts: list | None = None):
        super().__init__(SimpleNamespace(device="cpu"))
        self.models, self.fixed_prompts = models, prompts

    def load(self, dtype=None, **loading):
        if self.models is None:
            raise AssertionError("a model was loaded")
        return self.models.get(dtype, self.models[None]), None, self.device

    def prompts(self, tokenizer, device):
        return self.fixed_prompts


def _assert_refused_before_loading(test: unittest.TestCase, argv: list[str], message: str) -> None:
    """`utils/benchmark.py argv` exits with `message` before loading any model."""
    with mock.patch("sys.stderr", new_callable=io.StringIO) as stderr, test.assertRaises(SystemExit):
        benchmark.main(argv, workload=FixedWorkload())
    test.assertIn(message, stderr.getvalue())


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

    def test_half_precision_rates_over_own_outputs_and_the_fp32_reference(self):
        runs = []
        for repeat in range(3):
            runs.append(_run("greedy", "p1", "humaneval", 10.0, 100, repeat=repeat))
            # A text that departed and ended earlier: 60 tokens in 3 s is 2x greedy's rate, not 10 / 3.
            run = _run("lookahead_auto", "p1", "humaneval", 3.0, 30, identical=False, repeat=repeat)
            runs.append({**run, "new_tokens": 60})
            runs.append(_run(REFERENCE, "p1", "humaneval", 20.0, 100, identical=False, repeat=repeat))
        rows = {(r["method"], r["category"]): r for r in summarize({"runs": runs})}
        lookahead = rows[("lookahead_auto", "humaneval")]
        self.assertAlmostEqual(lookahead["speedup"], 2.0)
        self.assertAlmostEqual(lookahead["speedup_vs_fp32"], 4.0)
        self.assertAlmostEqual(rows[("greedy", "humaneval")]["speedup_vs_fp32"], 2.0)
        self.assertAlmostEqual(lookahead["host_ms_per_forward"], 1000 * 0.3 / 30)
        alone = summarize({"runs": [run for run in runs if run["method"] != REFERENCE]})
        self.assertIsNone(alone[0]["speedup_vs_fp32"])

    def test_a_half_precision_run_times_float32_greedy_on_its_own_model(self):
        half = enable_lookahead(tiny_model("llama").to(torch.bfloat16), LookaheadState(cost_dir=None))
        full = enable_lookahead(tiny_model("llama"), LookaheadState(cost_dir=None))
        dtypes = []
        full.register_forward_hook(lambda module, args, output: dtypes.append(output.logits.dtype))
        ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
        args = _benchmark_args(max_new_tokens=12, repeats=2, dtype="bfloat16", reference_fp32=True)

        workload = FixedWorkload({None: half, "float32": full}, [("p", "humaneval", ids, ids.shape[1])])
        result = run_benchmark(args, workload)
        reference = [run for run in result["runs"] if run["method"] == REFERENCE]
        self.assertEqual(len(reference), 2)
        self.assertTrue(all(run["forward_passes"] == 12 for run in reference), "plain greedy: one pass per token")
        self.assertEqual(set(dtypes), {torch.float32})
        rows = {(row["method"], row["category"]): row for row in summarize(result)}
        lookahead, reference = rows[("lookahead_auto", "humaneval")], rows[(REFERENCE, "humaneval")]
        self.assertAlmostEqual(lookahead["speedup_vs_fp32"], lookahead["tokens_per_s"] / reference["tokens_per_s"])

    def test_native_half_precision(self):
        cpu = torch.device("cpu")
        self.assertEqual(native_half_precision(cpu, "flags\t\t: fpu avx512f avx512_bf16 amx_tile"), "bfloat16")
        self.assertEqual(native_half_precision(cpu, "flags\t\t: fpu sse2 avx2 amx_bf16"), "bfloat16")
        self.assertIsNone(native_half_precision(cpu, "flags\t\t: fpu sse2 avx2 avx512f"))

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
        self.assertEqual(
            own_memory({"lookahead_window": "auto", "lookahead_memory": True}, "r"),
            {"lookahead_memory_namespace": "r"},
        )
        self.assertEqual(own_memory({"lookahead_window": "auto"}, "r"), {}, "the memory is off by default")
        self.assertEqual(own_memory({"lookahead_window": "auto", "lookahead_memory": False}, "r"), {})
        self.assertEqual(own_memory({"lookahead_window": 7}, "r"), {})
        self.assertEqual(own_memory({}, "r"), {})

    def test_a_method_is_not_answered_from_the_memory_of_another(self):
        model = enable_lookahead(tiny_model("llama"), LookaheadState(cost_dir=None))
        ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
        # Two methods that keep a memory and decode alike (the cache differs, not the steps), one repeat.
        methods = {"greedy": {}, "first": {"lookahead_window": "auto"}, "second": {"lookahead_window": "auto"}}
        args = _benchmark_args(max_new_tokens=24, repeats=1, dtype="float32")
        args.methods = list(methods)
        result = run_benchmark(args, FixedWorkload({None: model}, [("p", "c", ids, ids.shape[1])]), methods)
        passes = {run["method"]: run["forward_passes"] for run in result["runs"]}
        self.assertGreater(passes["second"], 0.75 * passes["first"], f"answered from the first's memory: {passes}")


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
        table = "\n".join(
            result_table("sampling.json", {"summary": list(rows.values()), "distribution_checks": checks})
        )
        self.assertIn("lowest per-position p-value 0.200", table)

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
        table = "\n".join(result_table("memory.json", {"summary": list(rows.values())}))
        self.assertIn("| humaneval_sequence | `auto_memory` | 2.00x | 2.50 | 1/1 |", table)

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

    def test_each_batch_of_two_serves_both_its_prompts(self):
        self.assertEqual([_batch_pair(index, 5) for index in range(5)], [(0, 1), (0, 1), (2, 3), (2, 3), (0, 4)])
        self.assertEqual([_batch_pair(index, 4) for index in range(4)], [(0, 1), (0, 1), (2, 3), (2, 3)])
        self.assertEqual(_batch_pair(0, 1), (0, 0), "a prompt alone is batched with itself")

    @parameterized.expand(
        [
            # (prompts only the method departed on, only the baseline, both, neither, p-value)
            ("no_discordant_prompt", 0, 0, 5, 3, 1.0),
            ("five_to_none", 5, 0, 2, 1, 1 / 32),
            ("six_to_one", 6, 1, 0, 0, 8 / 128),
            ("even", 3, 3, 1, 1, 42 / 64),
            ("fewer", 0, 4, 0, 0, 1.0),
        ]
    )
    def test_paired_departure_test(self, _, only_method, only_baseline, both, neither, p_value):
        kinds = [(3, None)] * only_method + [(None, 3)] * only_baseline + [(3, 4)] * both + [(None, None)] * neither
        result = {"prompts": [{"departures": {"lookahead_auto": m, "batched_greedy": b}} for m, b in kinds]}
        test = paired_departure_test(result, "lookahead_auto")
        self.assertEqual((test["only_method"], test["only_baseline"]), (only_method, only_baseline))
        self.assertAlmostEqual(test["p_value"], p_value)

    def test_departing_far_more_often_than_batched_greedy_is_significant(self):
        # 9 of 16 against 7 (the count the old assertion compared) is noise; 9 against 1 on the same prompts is not.
        noise = [(3, 3)] * 6 + [(3, None)] * 3 + [(None, 3)] * 1 + [(None, None)] * 6
        shift = [(3, None)] * 8 + [(3, 3)] * 1 + [(None, None)] * 7
        for kinds, significant in ((noise, False), (shift, True)):
            result = {"prompts": [{"departures": {"lookahead_auto": m, "batched_greedy": b}} for m, b in kinds]}
            rows = summarize_departures({**result, "methods": ["batched_greedy", "lookahead_auto"]})
            self.assertNotIn("versus_batched", rows[0], "the baseline is not tested against itself")
            self.assertEqual(rows[1]["versus_batched"]["p_value"] < DEPARTURE_SIGNIFICANCE, significant, rows[1])

    def test_where_a_token_sits_in_its_step(self):
        steps = (1, 3, 2)  # after the prefill's token 0: [1], [2, 3, 4], [5, 6]
        self.assertEqual([_step_offset(steps, position) for position in range(7)], [None, 0, 0, 1, 2, 0, 1])

    def test_nothing_departs_in_fp32_and_a_changed_method_does(self):
        model = enable_lookahead(tiny_model("llama"), flat_state())
        tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=None)
        rows = [random_prompt(length, seed=seed) for seed, length in enumerate((9, 14, 6))]
        prompts = [(f"p{index}", "test", row, row.shape[1]) for index, row in enumerate(rows)]
        args = SimpleNamespace(max_new_tokens=20, dtype="float32")
        result = run_departures(args, model, tokenizer, prompts)
        self.assertEqual(
            [row["departed"] for row in summarize_departures(result)], [0] * len(DEPARTURE_METHODS), result["prompts"]
        )
        self.assertEqual(
            [row["off_greedy_tokens"] for row in summarize_departures(result)], [0] * len(DEPARTURE_METHODS)
        )
        # Tokens per forward pass: counted for the lookahead methods only, which report their steps; 20 tokens each.
        per_forward = {row["method"]: row["tokens_per_forward"] for row in summarize_departures(result)}
        self.assertIsNone(per_forward["batched_greedy"])
        self.assertIsNone(per_forward["prompt_lookup"])
        for entry in result["prompts"]:
            for method in ("lookahead_auto", "lookahead_7_5_7"):
                tokens, passes = entry["forwards"][method]
                self.assertEqual(tokens, 20)
                self.assertLessEqual(passes, 20)
        self.assertGreater(per_forward["lookahead_7_5_7"], 1.0, "these prompts repeat themselves: steps accept more")
        # A method that changes the text is seen departing where it does.
        changed = {**DEPARTURE_METHODS, "lookahead_auto": {"lookahead_window": 4, "repetition_penalty": 5.0}}
        result = run_departures(args, model, tokenizer, prompts, changed)
        changed_row = summarize_departures(result)[2]
        self.assertGreater(changed_row["departed"], 0)
        self.assertGreater(changed_row["off_greedy_tokens"], 0, "a penalised text is no near-tie of plain greedy")
        self.assertIsInstance(changed_row["median_margin_at_departure"], float, "plain greedy's margin there")
        self.assertRegex(
            changed_row["first_of_step"], r"^\d+ / \d+$", "where in its step the departing token was chosen"
        )

    def test_a_static_cache_runs_every_method_and_plain_greedy_with_it(self):
        model = enable_lookahead(tiny_model("llama"), flat_state())
        tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=None)
        rows = [random_prompt(length, seed=seed) for seed, length in enumerate((9, 14))]
        prompts = [(f"p{index}", "test", row, row.shape[1]) for index, row in enumerate(rows)]
        args = SimpleNamespace(max_new_tokens=12, dtype="float32", cache_implementation="static")
        generate = model.generate
        caches, batch_sizes = [], []

        def recording_generate(*args, **kwargs):
            inputs = args[0] if args else kwargs["input_ids"]
            caches.append((kwargs.get("cache_implementation"), kwargs.get("max_cache_len", 0) - inputs.shape[1]))
            batch_sizes.append(inputs.shape[0])
            return generate(*args, **kwargs)

        with mock.patch.object(model, "generate", recording_generate):
            result = run_departures(args, model, tokenizer, prompts)
        # Plain greedy, the batch, every method: one cache size past each input, with room for prompt lookup's
        # candidates.
        self.assertEqual(set(caches), {("static", 12 + STATIC_CACHE_ROOM)}, caches)
        self.assertEqual(batch_sizes.count(2), 1, "one batch of two serves both prompts")
        self.assertEqual([row["departed"] for row in summarize_departures(result)], [0] * len(DEPARTURE_METHODS))


class NearGreedyCheckTest(unittest.TestCase):
    def test_plain_greedy_is_its_own_choice_and_a_changed_token_is_not(self):
        for dtype in (torch.float32, torch.bfloat16):
            with self.subTest(dtype=dtype):
                model = tiny_model("llama").to(dtype)
                batch = left_padded([random_prompt(12, seed=2), random_prompt(20, seed=3)])
                plain = model.generate(**batch, max_new_tokens=16, do_sample=False)[:, batch["input_ids"].shape[1] :]
                margins, scales = greedy_margins(model, batch, plain)
                self.assertEqual(margins.shape, (2, 16))
                self.assertTrue(torch.equal(margins, torch.zeros_like(margins)), "plain greedy along its own text")
                self.assertTrue((scales > 0).all())
                changed = plain.clone()
                changed[1, 5] = (changed[1, 5] + 1) % model.config.vocab_size
                margins, scales = greedy_margins(model, batch, changed)
                self.assertIn((1, 5), off_greedy_positions(margins, scales, dtype))
                self.assertNotIn((0, 5), off_greedy_positions(margins, scales, dtype))

    def test_tolerance_is_zero_in_float32_and_grows_with_the_logits(self):
        scales = torch.tensor([1.0, 8.0])
        self.assertTrue(torch.equal(near_tie_tolerance(torch.float32, scales), torch.zeros(2)))
        tolerance = near_tie_tolerance(torch.bfloat16, scales)
        self.assertAlmostEqual(float(tolerance[0]), 4 * 2**-7)
        self.assertAlmostEqual(float(tolerance[1]), 8 * float(tolerance[0]))


# A HumanEval-shaped problem (the dataset's own fields), so that the harness is tested without the dataset.
PROBLEM = {
    "task_id": "Test/0",
    "prompt": 'from typing import List\n\n\ndef total(values: List[int]) -> int:\n    """Sum of values."""\n',
    "entry_point": "total",
    "test": "def check(candidate):\n    assert candidate([1, 2, 3]) == 6\n    assert candidate([]) == 0\n",
}


class QualityHarnessTest(unittest.TestCase):
    def test_a_fenced_definition_passes_and_a_wrong_one_fails(self):
        right = "Here it is:\n```python\ndef total(values):\n    return sum(values)\n```\nIt sums the values."
        self.assertTrue(program_passes(completion_program(PROBLEM, right)))
        wrong = "```python\ndef total(values):\n    return len(values)\n```"
        self.assertFalse(program_passes(completion_program(PROBLEM, wrong)))

    def test_a_body_continues_the_prompt_and_the_prompt_imports_stay(self):
        self.assertTrue(program_passes(completion_program(PROBLEM, "```python\n    return sum(values)\n```")))
        annotated = "```python\ndef total(values: List[int]) -> int:\n    return sum(values)\n```"
        self.assertTrue(program_passes(completion_program(PROBLEM, annotated)), "List comes from the prompt's import")

    def test_the_block_that_defines_the_entry_point_is_taken(self):
        answer = "```python\nprint(total([1]))\n```\n\n```python\ndef total(values):\n    return sum(values)\n```"
        self.assertTrue(program_passes(completion_program(PROBLEM, answer)))

    def test_a_completion_that_never_ends_or_is_cut_off_fails(self):
        endless = "```python\ndef total(values):\n    while True:\n        pass\n```"
        self.assertFalse(program_passes(completion_program(PROBLEM, endless), timeout=2.0))
        cut = "```python\ndef total(values):\n    return sum("
        self.assertFalse(program_passes(completion_program(PROBLEM, cut)))

    def test_the_program_runs_in_a_directory_of_its_own(self):
        program = "import os, sys\nsys.exit(0 if os.listdir('.') == ['program.py'] else 1)\n"
        self.assertTrue(program_passes(program))

    def test_summary(self):
        problems = [
            {"passed": {m: i == 0 or m == "greedy" for m in QUALITY_METHODS}, "same_text_as_greedy": {}}
            for i in range(2)
        ]
        for entry in problems:
            entry["same_text_as_greedy"] = {m: m == "greedy" for m in QUALITY_METHODS}
        result = {"problems": problems, "dtype": "bfloat16", "max_new_tokens": 8}
        rows = {row["method"]: row for row in summarize_quality(result)}
        self.assertEqual((rows["greedy"]["passed"], rows["greedy"]["pass_at_1"]), (2, 1.0))
        self.assertEqual((rows["lookahead_auto"]["passed"], rows["lookahead_auto"]["pass_at_1"]), (1, 0.5))

    def test_runs_over_different_problems_merge_into_one(self):
        def run(task_ids, dtype="bfloat16", max_new_tokens=320):
            problems = [
                {"task_id": task_id, "passed": {m: task_id.endswith("0") for m in QUALITY_METHODS}}
                for task_id in task_ids
            ]
            return {"problems": problems, "dtype": dtype, "max_new_tokens": max_new_tokens}

        merged = merge_quality([run(["HumanEval/0", "HumanEval/1"]), run(["HumanEval/2", "HumanEval/10"])])
        self.assertEqual([e["task_id"] for e in merged["problems"]], [f"HumanEval/{i}" for i in (0, 1, 2, 10)])
        self.assertEqual((merged["dtype"], merged["max_new_tokens"]), ("bfloat16", 320))
        with self.assertRaisesRegex(ValueError, "overlap"):
            merge_quality([run(["HumanEval/0", "HumanEval/1"]), run(["HumanEval/1"])])
        with self.assertRaisesRegex(ValueError, "one dtype and --max-new-tokens"):
            merge_quality([run(["HumanEval/0"]), run(["HumanEval/1"], dtype="float32")])
        with self.assertRaisesRegex(ValueError, "one dtype and --max-new-tokens"):
            merge_quality([run(["HumanEval/0"]), run(["HumanEval/1"], max_new_tokens=64)])

    def test_the_merge_command_writes_one_result_and_its_table(self):
        def run(task_id, passed):
            entry = {"task_id": task_id, "passed": dict.fromkeys(QUALITY_METHODS, passed)}
            entry["same_text_as_greedy"] = dict.fromkeys(QUALITY_METHODS, True)
            environment = {"cpu": f"machine of {task_id}"}
            return {"problems": [entry], "dtype": "bfloat16", "max_new_tokens": 320, "environment": environment}

        with tempfile.TemporaryDirectory() as directory:
            first, second = Path(directory, "a.json"), Path(directory, "b.json")
            first.write_text(json.dumps(run("HumanEval/0", True)))
            second.write_text(json.dumps(run("HumanEval/1", False)))
            with mock.patch("sys.stdout", new_callable=io.StringIO):
                quality_main([str(Path(directory, "all.json")), str(first), str(second)])
            merged = json.loads(Path(directory, "all.json").read_text())
            table = "\n".join(result_table("all.json", merged))
        self.assertEqual([entry["task_id"] for entry in merged["problems"]], ["HumanEval/0", "HumanEval/1"])
        self.assertIn("| greedy | 1/2 | 0.500 | 2/2 |", table)
        # Where each part ran stays with the merged result.
        self.assertEqual(
            merged["runs"],
            [
                {"task_ids": ["HumanEval/0"], "environment": {"cpu": "machine of HumanEval/0"}, "file": "a.json"},
                {"task_ids": ["HumanEval/1"], "environment": {"cpu": "machine of HumanEval/1"}, "file": "b.json"},
            ],
        )
        # A merged result merged again keeps the runs it was made of.
        again = merge_quality([merged, run("HumanEval/2", True)], ["all.json", "c.json"])
        self.assertEqual([part["file"] for part in again["runs"]], ["a.json", "b.json", "c.json"])

    def test_first_problem_outside_the_tuning_problems_is_refused_before_loading(self):
        for value in ("-1", "82"):
            _assert_refused_before_loading(
                self, ["quality", "--first-problem", value], f"--first-problem: invalid choice: {value} (choose from"
            )


class ContinuousBatchingBenchmarkTest(unittest.TestCase):
    def test_closed_loop_on_a_tiny_model_and_its_summary(self):
        model = enable_lookahead(tiny_model("llama", "sdpa"), flat_state())
        tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=None)
        prompts = [(f"p{i}", "x", random_prompt(6 + i, seed=i), 6 + i) for i in range(3)]
        args = SimpleNamespace(concurrency=[1, 2], repeats=1, max_new_tokens=12)
        serve, engines_alive = cb_benchmark._serve_closed_loop, []

        def counted_serve(*arguments, **kwargs):
            engines_alive.append(sum("_run_generation_loop" in thread.name for thread in threading.enumerate()))
            return serve(*arguments, **kwargs)

        on_main_thread = []
        hook = model.register_forward_pre_hook(
            lambda *_: on_main_thread.append(threading.current_thread() is threading.main_thread())
        )
        self.addCleanup(hook.remove)
        with mock.patch.object(cb_benchmark, "_serve_closed_loop", counted_serve):
            result = run_continuous_batching(args, model, tokenizer, prompts)
        self.assertEqual(len(result["runs"]), 2 * len(CB_ENGINES))
        for run in result["runs"]:
            # A time for every token of every answer, within the run (times are kept to 0.1 ms, the run's length is
            # not); the load drops when the first client is done.
            end = run["seconds"] + 1e-4
            self.assertEqual([len(times) for times in run["token_times"]], [len(a) for a in run["answers"]])
            self.assertTrue(all(0 < t <= end for times in run["token_times"] for t in times))
            self.assertTrue(all(times == sorted(times) for times in run["token_times"]))
            # Full load lasts until an answer ends that no prompt is left to replace: all but `concurrency - 1` ended.
            ended = sum(times[-1] <= run["full_until"] for times in run["token_times"])
            self.assertGreaterEqual(ended, len(run["answers"]) - run["concurrency"] + 1)
            self.assertLessEqual(run["full_until"], end)
        # Only the engine measured runs (an idle one beside it slowed it by a third), and none is left running.
        self.assertEqual(engines_alive, [1] * (2 + 2 * 2))
        self.assertFalse(any("_run_generation_loop" in thread.name for thread in threading.enumerate()))
        # Nor does the main thread run forward passes, whose thread pool would stay beside the engines'.
        self.assertGreater(len(on_main_thread), 0)
        self.assertNotIn(True, on_main_thread)
        rows = summarize_continuous_batching(result)
        self.assertEqual(
            [(row["concurrency"], row["engine"]) for row in rows], [(c, e) for c in (1, 2) for e in CB_ENGINES]
        )
        for row in rows:
            # fp32, greedy: every engine's answers are plain continuous batching's.
            self.assertEqual(row["identical"], 3, row["engine"])
            self.assertEqual(row["tokens"], 3 * 12)
            self.assertLessEqual(row["first_token_p50"], row["latency_p50"])
            self.assertLess(0, row["forward_ms"])
            self.assertLess(row["forward_ms"], row["pass_ms"])
        self.assertEqual({row["speedup_vs_plain_cb"] for row in rows if row["engine"] == "plain_cb"}, {1.0})
        per_forward = {(row["concurrency"], row["engine"]): row["tokens_per_forward"] for row in rows}
        for concurrency in (1, 2):
            self.assertEqual(per_forward[concurrency, "plain_cb"], 1.0)
            # Flat costs: both lookahead engines verify several tokens per pass on these repetitive random prompts.
            self.assertGreater(per_forward[concurrency, "lookahead_cb"], 1.0)
            self.assertGreater(per_forward[concurrency, "generate_one_at_a_time"], 1.0)
        # Levels and repeats replay the same prompts: a suffix memory would answer them from the run before.
        self.assertFalse(engine_config(tokenizer, 12, lookahead=True).lookahead_memory)
        self.assertEqual(engine_config(tokenizer, 12, lookahead=False).lookahead_window, "off")

    def test_open_loop_sends_each_request_at_its_arrival(self):
        model = enable_lookahead(tiny_model("llama", "sdpa"), flat_state())
        tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=None)
        prompts = [(f"p{i}", "x", random_prompt(6 + i, seed=i), 6 + i) for i in range(3)]
        args = SimpleNamespace(concurrency=[1], arrival_rate=[2.0], repeats=1, max_new_tokens=12)
        # The first two arrive together, the third later than either can take to finish (tens of ms here).
        arrivals = [0.0, 0.0, 0.5]
        with mock.patch.object(cb_benchmark, "arrival_times", return_value=arrivals) as drawn:
            result = run_continuous_batching(args, model, tokenizer, prompts)
        drawn.assert_called_once_with(3, 2.0)
        self.assertEqual(len(result["runs"]), len(CB_ENGINES))
        for run in result["runs"]:
            self.assertEqual((run["concurrency"], run["arrival_rate"], run["full_until"]), (None, 2.0, None))
            first, second, third = run["token_times"]
            # Nothing is sent before it arrives, and latency counts from the arrival.
            self.assertGreaterEqual(third[0], 0.5)
            self.assertLess(run["latency"][2], third[-1] - 0.25)
            self.assertTrue(all(0 <= f <= t for f, t in zip(run["first_token"], run["latency"])))
            if run["engine"] != "generate_one_at_a_time":
                # The engines take both of the first two at once: the second's first token comes before the
                # first's last (a closed loop of one client would send it only then).
                self.assertLess(second[0], first[-1])
            else:
                # One `generate` call at a time: the second waits for the first, and its latency says so.
                self.assertGreater(second[0], first[-1])
                self.assertGreater(run["latency"][1], run["latency"][0])
        rows = summarize_continuous_batching(result)
        self.assertEqual([(row["arrival_rate"], row["engine"]) for row in rows], [(2.0, e) for e in CB_ENGINES])
        for row in rows:
            self.assertEqual(row["identical"], 3, row["engine"])
            self.assertIsNone(row["full_load_tokens_per_s"])
            self.assertIsNone(row["full_load_speedup_vs_plain_cb"])
        by_engine = {row["engine"]: row for row in rows}
        self.assertEqual(by_engine["plain_cb"]["latency_p50_speedup_vs_plain_cb"], 1.0)
        self.assertGreater(by_engine["lookahead_cb"]["tokens_per_forward"], 1.0)
        table = "\n".join(result_table("open.json", {"summary": rows}))
        self.assertIn("| 2.0 req/s | lookahead |", table)

    def test_arrival_times_are_a_seeded_poisson_process(self):
        times = arrival_times(4001, rate=4.0)
        self.assertEqual(times, arrival_times(4001, rate=4.0))
        self.assertNotEqual(times, arrival_times(4001, rate=4.0, seed=1))
        self.assertEqual(times[0], 0.0)
        gaps = [later - earlier for earlier, later in zip(times, times[1:])]
        self.assertTrue(all(gap >= 0 for gap in gaps))
        # Exponential gaps of mean 1/4 s: their mean, and their spread (an exponential's deviation equals its mean).
        self.assertAlmostEqual(sum(gaps) / len(gaps), 0.25, delta=0.02)
        self.assertAlmostEqual(statistics.pstdev(gaps), 0.25, delta=0.03)
        with self.assertRaisesRegex(ValueError, "arrival rate must be positive, got 0"):
            arrival_times(3, rate=0)

    def test_arrival_rate_is_refused_before_loading(self):
        for argv, message in (
            (["continuous-batching", "--arrival-rate", "1", "0"], "--arrival-rate: takes a value above 0, got 0"),
            (["generate", "--arrival-rate", "1"], "unrecognized arguments: --arrival-rate 1"),
            (["memory", "--padded-engines"], "unrecognized arguments: --padded-engines"),
        ):
            _assert_refused_before_loading(self, argv, message)

    def test_padded_engines_run_beside_the_others(self):
        model = enable_lookahead(tiny_model("llama", "sdpa"), flat_state())
        tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=None)
        prompts = [(f"p{i}", "x", random_prompt(6 + i, seed=i), 6 + i) for i in range(3)]
        args = SimpleNamespace(
            concurrency=[2], repeats=1, max_new_tokens=12, padded_engines=True, padded_backend="eager"
        )
        queries = []
        # Run as it is, so that recording a pass adds no guard to the compiled step.
        record = torch.compiler.disable(lambda module, args, kwargs: queries.append(kwargs["input_ids"].shape[-1]))
        hook = model.register_forward_pre_hook(record, with_kwargs=True)
        self.addCleanup(hook.remove)
        result = run_continuous_batching(args, model, tokenizer, prompts)
        rows = summarize_continuous_batching(result)
        self.assertEqual([row["engine"] for row in rows], [*CB_ENGINES, *PADDED_ENGINES])
        for row in rows:
            self.assertEqual(row["identical"], 3, row["engine"])
        by_engine = {row["engine"]: row for row in rows}
        self.assertGreater(by_engine["lookahead_cb_padded"]["tokens_per_forward"], 1.0)
        # The eager engines' passes hold these few short prompts' tokens; the padded engines', whole intervals.
        self.assertIn(64, queries)

    def test_full_load_rate_leaves_out_the_drain(self):
        # Three clients, four requests: once the second answer ends no prompt is left, and the last two drain slowly.
        run = {"token_times": [[1.0, 2.0], [1.0, 2.0, 3.0], [2.0, 4.0, 8.0], [3.5, 9.0, 10.0]], "full_until": 3.0}
        self.assertEqual(full_load_rate(run), 6 / 3.0)

    def test_summary_ratios_and_percentiles(self):
        def run(engine, seconds, latency, answers=((1, 2), (3, 4))):
            return {
                "engine": engine,
                "concurrency": 4,
                "repeat": 0,
                "seconds": seconds,
                "answers": [list(answer) for answer in answers],
                # One request ends at a quarter of the run, the other at its end: half the tokens came by then.
                "token_times": [[seconds / 8, seconds / 4], [seconds / 2, seconds]],
                "full_until": seconds / 4,
                "latency": latency,
                "first_token": [value / 2 for value in latency],
                "forwards": [2, 1],
                "forward_passes": 4,
                "forward_seconds": seconds / 2,
            }

        result = {
            "runs": [
                run("plain_cb", 2.0, [1.0, 3.0]),
                run("lookahead_cb", 1.0, [0.5, 1.5]),
                run("generate_one_at_a_time", 4.0, [2.0, 4.0], answers=((1, 2), (3, 5))),
            ]
        }
        rows = {row["engine"]: row for row in summarize_continuous_batching(result)}
        self.assertEqual(rows["plain_cb"]["tokens_per_s"], 2.0)
        self.assertEqual(rows["lookahead_cb"]["speedup_vs_plain_cb"], 2.0)
        self.assertEqual(rows["generate_one_at_a_time"]["speedup_vs_plain_cb"], 0.5)
        self.assertEqual(rows["plain_cb"]["full_load_tokens_per_s"], 4.0)
        self.assertEqual(rows["lookahead_cb"]["full_load_speedup_vs_plain_cb"], 2.0)
        self.assertEqual(rows["generate_one_at_a_time"]["identical"], 1)
        self.assertEqual(rows["plain_cb"]["tokens_per_forward"], 4 / 3)
        self.assertEqual((rows["plain_cb"]["pass_ms"], rows["plain_cb"]["forward_ms"]), (500.0, 250.0))
        self.assertEqual((rows["lookahead_cb"]["latency_p50"], rows["lookahead_cb"]["latency_p95"]), (1.0, 1.5))


class ForwardTimerTest(unittest.TestCase):
    def test_each_pass_is_recorded_with_its_query_tokens(self):
        model = tiny_model("llama")
        timer = ForwardTimer(model)
        out, seconds = timer.generate(random_prompt(12, seed=1), max_new_tokens=4, do_sample=False)
        self.assertEqual(out.shape[1], 16)
        self.assertEqual([tokens for tokens, _ in timer.passes], [12, 1, 1, 1])
        self.assertEqual(timer.calls, 4)
        self.assertAlmostEqual(timer.seconds, sum(elapsed for _, elapsed in timer.passes))
        self.assertLessEqual(timer.seconds, seconds)
        timer.reset()
        self.assertEqual((timer.calls, timer.passes), (0, []))


class PricedStepsTest(unittest.TestCase):
    """`priced`: steps decided and counted here, priced by another device's cost table."""

    def test_tables_by_name_file_and_gpu_check_report(self):
        from utils.priced_steps import load_table

        self.assertEqual(load_table("flat")[1](64), 1.0)
        with tempfile.TemporaryDirectory() as folder:
            curve = Path(folder, "curve.json")
            curve.write_text(json.dumps({"relative_cost": {"1": 1.0, "8": 2.0}}))
            name, table = load_table(str(curve))
            self.assertEqual((name, table(8)), ("curve", 2.0))
            report = Path(folder, "h200.json")
            report.write_text(json.dumps({"checks": [{"check": "cost curve", "relative_cost": {"1": 1, "2": 1.07}}]}))
            self.assertAlmostEqual(load_table(str(report))[1](2), 1.07)
            empty = Path(folder, "empty.json")
            empty.write_text(json.dumps({"checks": []}))
            with self.assertRaisesRegex(ValueError, "holds no `relative_cost`"):
                load_table(str(empty))
        with self.assertRaisesRegex(ValueError, "priced takes `flat` or a JSON file"):
            load_table("steep")

    def test_priced_speedup_counts_each_pass_at_the_table_cost(self):
        from utils.priced_steps import summarize_priced

        def run(method, passes, seconds, forward):
            return {
                "prompt_id": "HumanEval/0",
                "category": "humaneval",
                "method": method,
                "new_tokens": 9,
                "pass_lengths": passes,
                "seconds": seconds,
                "forward_seconds": forward,
                "identical_to_greedy": True,
            }

        # Greedy: 8 decoding passes of one token (the prompt's pass made the first). Lookahead: 4 passes of 8 tokens.
        result = {
            "tables": {"steep": {1: 1.0, 8: 1.5}},
            "runs": [run("greedy", [1] * 8, 1.0, 0.9), run("lookahead_auto@steep", [8] * 4, 0.7, 0.6)],
        }
        rows = {row["method"]: row for row in summarize_priced(result, pass_ms=10.0)}
        self.assertAlmostEqual(rows["lookahead_auto"]["priced_speedup"], 8 / (4 * 1.5))
        self.assertAlmostEqual(rows["lookahead_auto"]["tokens_per_pass"], 9 / 5)
        # Host time per pass measured here: 0.1 s over 5 passes.
        self.assertAlmostEqual(rows["lookahead_auto"]["host_ms_per_pass"], 20.0)
        greedy_time = 8 * (10.0 + 100 / 9)
        self.assertAlmostEqual(rows["lookahead_auto"]["priced_speedup_with_host"], greedy_time / (6 * 10 + 4 * 20))

    def test_price_with_is_refused_before_loading(self):
        for argv, message in (
            (["priced", "flat", "--dtype", "bfloat16"], "priced decodes in float32"),
            (["priced", "--pass-ms", "5"], "the following arguments are required: TABLE"),
            (["priced", "flat", "--pass-ms", "0"], "--pass-ms: takes a value above 0, got 0"),
            (["generate", "--context-tokens", "0"], "--context-tokens: takes a value above 0, got 0"),
        ):
            _assert_refused_before_loading(self, argv, message)

    def test_auto_steps_follow_the_table_alone(self):
        from utils.priced_steps import run_priced

        model = enable_lookahead(tiny_model("llama"))
        prompts = [("HumanEval/0", "humaneval", random_prompt(24, seed=3), 24)]
        args = SimpleNamespace(price_with=["flat"], max_new_tokens=24, dtype="float32")
        first, second = (run_priced(args, model, prompts)["runs"] for _ in range(2))
        by_method = {run["method"]: run for run in first}
        self.assertEqual(
            set(by_method), {"greedy", "prompt_lookup", "lookahead_7_5_7", "lookahead_15_5_15", "lookahead_auto@flat"}
        )
        self.assertTrue(all(run["identical_to_greedy"] for run in first))
        # A flat table: "auto" verifies long steps, the same ones in both runs whatever this machine's timings.
        self.assertGreater(max(by_method["lookahead_auto@flat"]["pass_lengths"]), 8)
        self.assertEqual(
            [run["pass_lengths"] for run in first if "@" in run["method"]],
            [run["pass_lengths"] for run in second if "@" in run["method"]],
        )


class BenchmarkChoiceTest(unittest.TestCase):
    def test_each_benchmark_is_a_subcommand_taking_only_its_own_arguments(self):
        output = io.StringIO()
        with mock.patch("sys.stdout", output), self.assertRaises(SystemExit):
            benchmark.main(["-h"])
        for name, entry in benchmark.BENCHMARKS.items():
            with self.subTest(benchmark=name):
                self.assertIn(name, output.getvalue())
                self.assertEqual(entry.run.__module__, "utils.benchmark")

    def test_a_second_benchmark_or_another_model_is_refused_before_loading(self):
        for argv, message in (
            (["sampling", "batched"], "unrecognized arguments: batched"),
            (["whisper", "--model", "smollm2"], "whisper runs on its own model; drop --model"),
            (["sample"], "invalid choice: 'sample'"),
        ):
            _assert_refused_before_loading(self, argv, message)


class MainWritesResultFilesTest(unittest.TestCase):
    """`utils/benchmark.py` end to end on a tiny model: the files it writes, and that the results page renders them."""

    @parameterized.expand(
        [
            ("generate", ["generate"], "benchmark.json"),
            ("priced", ["priced", "flat", "--pass-ms", "5"], "priced.json"),
        ]
    )
    def test_result_file_renders(self, _, argv, written):
        from utils.render_results import kind_of, render_page

        model = enable_lookahead(tiny_model("llama"), LookaheadState(cost_dir=None))
        ids = random_prompt(16, seed=2)
        workload = FixedWorkload({None: model}, [("HumanEval/0", "humaneval", ids, ids.shape[1])])
        with tempfile.TemporaryDirectory() as folder:
            common = ["--dtype", "float32", "--num-prompts", "1", "--repeats", "1", "--max-new-tokens", "8"]
            benchmark.main([*argv, *common, "--output-dir", folder], workload=workload)
            result = json.loads(Path(folder, written).read_text())
        self.assertEqual(result["environment"]["cores"], os.cpu_count())
        self.assertIn("revision", result["environment"])
        kind_of(written, result)
        self.assertIn("HumanEval", render_page([(written, result)]))


class ServeBenchmarkRequestTest(unittest.TestCase):
    """`utils/serve_benchmark._request` against a client that streams as `transformers serve` does."""

    class StreamingClient:
        """Streams two text chunks, then the usage chunk only where the request asked for it (the OpenAI API's rule)."""

        def __init__(self):
            self.requests = []
            self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

        def create(self, **request):
            self.requests.append(request)
            chunks = [
                SimpleNamespace(choices=[SimpleNamespace(delta=SimpleNamespace(content=text))], usage=None)
                for text in ("Hello", " world")
            ]
            if (request.get("stream_options") or {}).get("include_usage"):
                chunks.append(SimpleNamespace(choices=[], usage=SimpleNamespace(completion_tokens=2)))
            return iter(chunks)

    def test_asks_for_the_usage_chunk_and_counts_its_tokens(self):
        from utils.serve_benchmark import _request

        client = self.StreamingClient()
        result = _request(client, "model", [{"role": "user", "content": "Hi"}], 8, namespace="tenant")
        self.assertEqual((result["tokens"], result["text"]), (2, "Hello world"))
        self.assertLessEqual(result["ttft"], result["latency"])
        body = json.loads(client.requests[0]["extra_body"]["generation_config"])
        self.assertEqual(body, {"lookahead_memory_namespace": "tenant"})
