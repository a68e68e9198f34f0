"""
The results page and the README's table are what the result files render (`utils/render_results.py`), every file
and command the README names exists, and result files record where and when they were measured.
"""

import json
import re
import subprocess
import tempfile
import unittest
from pathlib import Path

import torch
from parameterized import parameterized

from utils.render_results import (
    PAGE,
    README,
    command,
    load_results,
    readme_with_table,
    render_page,
    render_readme_table,
    title,
)
from utils.serving import serving_dtype
from utils.timing import native_half_precision, provenance

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "source" / "en" / "lookahead_decoding.md"


def _generate_result(methods=("greedy", "prompt_lookup", "lookahead_auto"), **environment) -> dict:
    """A `generate` result file's content with made-up figures."""
    rows = [
        {
            "method": method,
            "category": split,
            "prompts": 2,
            "tokens_per_s": 10.0 * (index + 1),
            "speedup": float(index + 1),
            "min_prompt_speedup": 1.0,
            "tokens_per_forward": 1.0 + index,
            "host_ms_per_forward": 1.0,
            "identical": 2,
        }
        for index, method in enumerate(methods)
        for split in ("humaneval", "mt_bench (all)")
    ]
    base = {"dtype": "float32", "command": "python utils/benchmark.py --output-dir /somewhere", "date": "2026-01-02"}
    return {"environment": {**base, "recorded_in": "abc1234", **environment}, "summary": rows}


class DocumentsAreCurrentTest(unittest.TestCase):
    def test_results_page_is_what_the_files_render(self):
        self.assertEqual(
            PAGE.read_text(), render_page(load_results()), "run `python utils/render_results.py` to regenerate it"
        )

    def test_readme_table_is_what_the_files_render(self):
        readme = README.read_text()
        self.assertEqual(readme, readme_with_table(readme, render_readme_table(load_results())))
        # The table is not empty: at least one run is a headline.
        self.assertGreater(render_readme_table(load_results()).count("\n| "), 1)

    def test_every_result_file_says_when_where_and_on_which_revision(self):
        for name, result in load_results():
            environment = result["environment"]
            with self.subTest(name):
                self.assertRegex(environment["date"], r"^\d{4}-\d{2}-\d{2}$")
                self.assertTrue(environment.get("revision") or environment.get("recorded_in"))
                self.assertTrue(environment.get("gpu") or environment.get("cpu") or environment.get("device"))

    def test_results_page_links_to_existing_files(self):
        for target in re.findall(r"\]\((benchmarks/[^)]+)\)", PAGE.read_text()):
            with self.subTest(target):
                self.assertTrue((PAGE.parent / target).is_file())


class RendererTest(unittest.TestCase):
    def _write(self, directory: Path, files: dict[str, dict]) -> list:
        for name, content in files.items():
            (directory / name).write_text(json.dumps(content))
        return load_results(directory)

    def test_a_result_of_no_known_kind_is_refused_by_name(self):
        with tempfile.TemporaryDirectory() as folder:
            results = self._write(Path(folder), {"odd.json": {"environment": {"date": "2026-01-01"}, "rows": []}})
            with self.assertRaisesRegex(ValueError, "odd.json: no kind"):
                render_page(results)

    def test_a_changed_figure_changes_the_page(self):
        with tempfile.TemporaryDirectory() as folder:
            result = _generate_result()
            before = render_page(self._write(Path(folder), {"run.json": result}))
            result["summary"][-1]["speedup"] = 9.5
            after = render_page(self._write(Path(folder), {"run.json": result}))
        self.assertNotEqual(before, after)
        self.assertIn("9.50x", after)

    def test_runs_are_newest_first(self):
        with tempfile.TemporaryDirectory() as folder:
            older = _generate_result(date="2026-01-01", command="python utils/benchmark.py --model qwen-coder")
            newer = _generate_result(date="2026-02-01")
            page = render_page(self._write(Path(folder), {"a.json": older, "b.json": newer}))
        self.assertLess(page.index("2026-02-01"), page.index("2026-01-01"))

    def test_headline_rows_compare_lookahead_with_prompt_lookup(self):
        with tempfile.TemporaryDirectory() as folder:
            result = {**_generate_result(cpu="Some CPU", cores=2, native_half_precision=None), "headline": True}
            table = render_readme_table(self._write(Path(folder), {"run.json": result}))
        # "auto" runs at 3x greedy, prompt lookup at 2x: 1.5x prompt lookup on both splits; every text identical.
        self.assertIn("| Some CPU, 2 cores, no native bf16 | SmolLM2-135M-Instruct | fp32 | 3.00x | 3.00x |", table)
        self.assertIn("| 1.50x / 1.50x | all |", table)

    def test_a_headline_without_prompt_lookup_is_refused(self):
        with tempfile.TemporaryDirectory() as folder:
            result = {**_generate_result(methods=("greedy", "lookahead_auto")), "headline": True}
            with self.assertRaisesRegex(ValueError, "run.json: a headline run compares"):
                render_readme_table(self._write(Path(folder), {"run.json": result}))

    def test_readme_without_markers_is_refused(self):
        with self.assertRaisesRegex(ValueError, "markers"):
            readme_with_table("# no table here\n", "| table |")

    @parameterized.expand(
        [
            ("python utils/benchmark.py --threads 2 --output-dir /tmp/x", "python utils/benchmark.py --threads 2"),
            ("python utils/gpu_check.py --output report.json --real-model", "python utils/gpu_check.py --real-model"),
            (None, "not recorded"),
        ]
    )
    def test_command_leaves_out_where_files_went(self, recorded, shown):
        self.assertEqual(command({"command": recorded}), shown)

    @parameterized.expand(
        [
            (
                "python utils/benchmark.py --model qwen-coder --max-new-tokens 1024",
                "Qwen2.5-Coder-0.5B-Instruct, bf16, 1024 new tokens",
            ),
            (
                "python utils/benchmark.py --split held_out --max-new-tokens 128",
                "SmolLM2-135M-Instruct, bf16, held-out prompts",
            ),
            (
                "python utils/benchmark.py --continuous-batching --concurrency 1 4",
                "SmolLM2-135M-Instruct, bf16, clients 1/4",
            ),
        ]
    )
    def test_title_names_what_sets_a_run_apart(self, recorded, expected):
        self.assertEqual(title({"environment": {"command": recorded, "dtype": "bfloat16"}}), expected)


class ReadmeNamesWhatExistsTest(unittest.TestCase):
    """Every `make` target, script, file and relative link the README and the guide name exists."""

    def test_make_targets_exist(self):
        targets = set(re.findall(r"^([a-z][a-z0-9-]*):", (ROOT / "Makefile").read_text(), re.MULTILINE))
        named = set(re.findall(r"\bmake ([a-z][a-z0-9-]*)", README.read_text()))
        self.assertTrue(named)
        self.assertLessEqual(named, targets)

    @parameterized.expand([("README", README), ("guide", GUIDE)])
    def test_named_files_exist(self, _, document):
        text = document.read_text()
        paths = set(re.findall(r"`((?:utils|tests|docs|src)/[\w./-]+\.(?:py|md|json|wav))`", text))
        paths |= {f"utils/{name}" for name in re.findall(r"python utils/([\w]+\.py)", text)}
        self.assertTrue(paths)
        for path in paths:
            with self.subTest(path):
                self.assertTrue((ROOT / path).exists())

    @parameterized.expand([("README", README), ("guide", GUIDE)])
    def test_relative_links_exist(self, _, document):
        links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", document.read_text())
        self.assertTrue(links)
        for link in links:
            with self.subTest(link):
                self.assertTrue((document.parent / link).exists())

    def test_guide_anchors_exist(self):
        text = GUIDE.read_text()
        headings = re.findall(r"^#+ (.+)$", text, re.MULTILINE)
        anchors = {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}
        linked = set(re.findall(r"\]\(#([^)]+)\)", text))
        linked |= set(re.findall(r"\]\(docs/source/en/lookahead_decoding\.md#([^)]+)\)", README.read_text()))
        self.assertTrue(linked)
        for anchor in linked:
            with self.subTest(anchor):
                self.assertIn(anchor, anchors)


class ProvenanceTest(unittest.TestCase):
    def test_revision_of_a_checkout_and_of_a_changed_one(self):
        with tempfile.TemporaryDirectory() as folder:
            root = Path(folder)

            def git(*args):
                return subprocess.run(
                    ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                    cwd=root,
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout.strip()

            self.assertIsNone(provenance(root)["revision"])
            git("init", "-q")
            (root / "file.txt").write_text("one")
            git("add", "file.txt")
            git("commit", "-q", "-m", "one")
            head = git("rev-parse", "--short=7", "HEAD")
            recorded = provenance(root)
            self.assertEqual(recorded["revision"], head)
            self.assertRegex(recorded["date"], r"^\d{4}-\d{2}-\d{2}$")
            self.assertGreaterEqual(recorded["cores"], 1)
            (root / "file.txt").write_text("two")
            self.assertEqual(provenance(root)["revision"], head + "+dirty")


class ServingDtypeTest(unittest.TestCase):
    def test_make_serve_serves_in_the_dtype_make_bench_measures(self):
        # `make bench` runs `--dtype auto`: the native half precision of the device, else float32.
        expected = native_half_precision(torch.device("cpu")) or "float32"
        self.assertEqual(serving_dtype("auto"), expected)
        self.assertNotIn("--dtype", re.search(r"^serve:.*\n\t(.*)$", (ROOT / "Makefile").read_text(), re.M).group(1))

    def test_an_explicit_dtype_is_kept(self):
        self.assertEqual(serving_dtype("float32"), "float32")
        self.assertEqual(serving_dtype("bfloat16"), "bfloat16")


if __name__ == "__main__":
    unittest.main()
