"""`python -m utils.bench`: every tool behind one command, and one registry of methods."""

import ast
import io
import subprocess
import sys
import unittest
from contextlib import redirect_stdout
from pathlib import Path

from utils.bench import TOOLS, main
from utils.methods import METHODS, methods

ROOT = Path(__file__).resolve().parents[1]


class BenchTest(unittest.TestCase):
    def test_every_tool_with_a_main_is_a_subcommand(self):
        with_main = {
            f"utils.{path.stem}"
            for path in (ROOT / "utils").glob("*.py")
            if path.stem != "bench"
            and any(
                isinstance(node, ast.FunctionDef) and node.name == "main" for node in ast.parse(path.read_text()).body
            )
        }
        self.assertEqual({module for module, _ in TOOLS.values()} | {"utils.benchmark"}, with_main)

    def test_a_subcommand_runs_its_tool_with_its_arguments(self):
        # The results page renders from the committed result files; `--check` says whether it is up to date.
        self.assertEqual(main(["results", "--check"]), 0)
        output = io.StringIO()
        with redirect_stdout(output), self.assertRaises(SystemExit):
            main(["hub-repo", "-h"])
        self.assertIn("--repo-id", output.getvalue())

    def test_an_unknown_name_is_refused_naming_the_tools(self):
        result = subprocess.run(
            [sys.executable, "-m", "utils.bench", "benchmarks"], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        self.assertEqual(result.returncode, 2)
        self.assertIn("invalid choice: 'benchmarks'", result.stderr)
        self.assertIn("'gpu-check'", result.stderr)


class MethodsTest(unittest.TestCase):
    def test_the_tools_take_their_methods_from_the_registry(self):
        # No tool defines a method's arguments itself: the registry's literal keyword arguments appear nowhere else.
        for path in (ROOT / "utils").glob("*.py"):
            text = path.read_text()
            if path.name != "methods.py":
                self.assertFalse('"prompt_lookup_num_tokens": 10' in text or '"lookahead_ngram": 5' in text, path.name)

    def test_methods_by_name_without_memory_for_auto_only(self):
        chosen = methods("lookahead_auto", "lookahead_7_5_7", without_memory=True)
        self.assertEqual(list(chosen), ["lookahead_auto", "lookahead_7_5_7"])
        self.assertEqual(chosen["lookahead_auto"], {"lookahead_window": "auto", "lookahead_memory": False})
        self.assertEqual(chosen["lookahead_7_5_7"], METHODS["lookahead_7_5_7"])
        self.assertNotIn("lookahead_memory", METHODS["lookahead_auto"], "the registry itself is not changed")
        with self.assertRaisesRegex(ValueError, "Unknown methods \\['lookahead_9'\\]; the methods are"):
            methods("lookahead_9")


class PercentileTest(unittest.TestCase):
    def test_nearest_rank_for_every_tool(self):
        from utils.timing import percentile

        values = list(range(10, 0, -1))
        self.assertEqual((percentile(values, 0.5), percentile(values, 0.95), percentile(values, 1.0)), (5, 10, 10))
        self.assertEqual((percentile([0.5, 1.5], 0.5), percentile([0.5, 1.5], 0.95)), (0.5, 1.5))
        self.assertEqual(percentile([3.0], 0.05), 3.0)


if __name__ == "__main__":
    unittest.main()
