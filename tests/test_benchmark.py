import unittest

from transformers_lookahead.benchmark import format_table, summarize


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
