import io
import json
import tempfile
import unittest
from pathlib import Path
from unittest import mock

from utils import benchmark, gpu_check


def _refused(test: unittest.TestCase, argv: list[str], message: str) -> None:
    """`utils/gpu_check.py argv` exits with `message` before any check runs."""
    checks = {name: mock.Mock(side_effect=AssertionError("ran")) for name in gpu_check.CHECKS}
    with (
        mock.patch.dict(gpu_check.CHECKS, checks),
        mock.patch.object(gpu_check, "check_real_model", side_effect=AssertionError("ran")),
        mock.patch("sys.stderr", new_callable=io.StringIO) as stderr,
        test.assertRaises(SystemExit),
    ):
        gpu_check.main(argv)
    test.assertIn(message, stderr.getvalue())


def _fake_benchmark(argv: list[str]) -> None:
    """Writes what `python -m utils.bench argv` writes, with made-up figures."""
    folder = Path(argv[argv.index("--output-dir") + 1])
    folder.mkdir(parents=True, exist_ok=True)
    if argv[0] == "departures":
        cache = argv[argv.index("--cache-implementation") + 1]
        departed = {"dynamic": 3, "static": 1}[cache]
        summary = [{"method": "batched_greedy", "departed": 2, "prompts": 8}]
        summary.append({"method": "lookahead_auto", "departed": departed, "prompts": 8})
        (folder / "departures-bfloat16.json").write_text(json.dumps({"summary": summary}))
        return
    row = {"prompts": 4, "tokens_per_s": 30.0, "tokens_per_forward": 2.0, "host_ms_per_forward": 3.0, "identical": 2}
    summary = [
        {**row, "method": "lookahead_auto", "category": "humaneval", "speedup": 1.25},
        {**row, "method": "lookahead_auto", "category": "writing", "speedup": 0.5},
    ]
    (folder / "benchmark.json").write_text(json.dumps({"summary": summary}))


class GpuCheckArgumentsTest(unittest.TestCase):
    def test_real_model_settings_without_real_model_are_refused(self):
        for argv in (["--cache-dir", "assets"], ["--real-prompts", "2"], ["--real-repeats", "1"]):
            with self.subTest(argv=argv):
                _refused(self, argv, "set up --real-model; add it, or drop them")

    def test_real_model_check_without_real_model_is_refused(self):
        _refused(self, ["--checks", "real_model"], "--checks real_model runs with --real-model only")

    def test_non_positive_counts_are_refused(self):
        for argv in (["--real-model", "--real-prompts", "0"], ["--real-model", "--real-repeats", "-1"]):
            with self.subTest(argv=argv):
                _refused(self, argv, "--real-prompts and --real-repeats take 1 or more")

    def test_only_the_chosen_checks_run(self):
        checks = {name: mock.Mock() for name in gpu_check.CHECKS}
        with mock.patch.dict(gpu_check.CHECKS, checks), mock.patch("sys.stdout", new_callable=io.StringIO):
            self.assertEqual(gpu_check.main(["--checks", "batch", "flex"]), 0)
        self.assertEqual([name for name, check in checks.items() if check.called], ["flex", "batch"])


class RealModelCheckTest(unittest.TestCase):
    def test_speed_and_departures_are_reported_and_kept_beside_the_report(self):
        with tempfile.TemporaryDirectory() as folder:
            output = Path(folder, "report.json")
            argv = ["--real-model", "--checks", "real_model", "--real-prompts", "3", "--cache-dir", "staged"]
            with (
                mock.patch.object(benchmark, "main", side_effect=_fake_benchmark) as runs,
                mock.patch("sys.stdout", new_callable=io.StringIO),
            ):
                self.assertEqual(gpu_check.main([*argv, "--output", str(output)]), 0)
            calls = [call.args[0] for call in runs.call_args_list]
            self.assertEqual([call[0] for call in calls], ["generate", "departures", "departures"])
            for call in calls:
                self.assertEqual(call[call.index("--dtype") + 1], "bfloat16")
                self.assertEqual(call[call.index("--num-prompts") + 1], "3")
                self.assertEqual(call[call.index("--cache-dir") + 1], "staged")
            self.assertEqual(
                [call[call.index("--cache-implementation") + 1] for call in calls[1:]], ["dynamic", "static"]
            )
            records = {record["check"]: record for record in json.loads(output.read_text())["checks"]}
            speed = records["bf16 SmolLM2 speed humaneval lookahead_auto"]
            self.assertEqual((speed["speedup"], speed["identical_to_greedy"]), (1.25, "2/4"))
            # Categories inside a split stay in the benchmark's files, not in the report.
            self.assertNotIn("bf16 SmolLM2 speed writing lookahead_auto", records)
            static = records["bf16 SmolLM2 departures from plain greedy, 64 tokens, static cache"]
            self.assertEqual((static["batched_greedy"], static["lookahead_auto"]), ("2/8", "1/8"))
            kept = sorted(path.name for path in Path(folder, "report_real_model").iterdir())
            self.assertIn("departures-bfloat16-dynamic.json", kept)
            self.assertIn("departures-bfloat16-static.json", kept)
            self.assertIn("benchmark.json", kept)
