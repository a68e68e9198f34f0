"""
Lookahead decoding under Transformers tensor parallelism: real `torchrun` ranks (gloo, CPU) on tiny random models whose
heads split over 2 ranks, each rank writing what it decoded for this test to compare (`tests/tp_worker.py`).
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

import torch
from transformers.testing_utils import slow

from utils.assets import smollm2_path
from utils.distribution_check import homogeneity_p_value, token_counts
from utils.serving import free_port

from .utils import SMALL_VOCABULARY, small_vocabulary_model, tiny_model

ROOT = Path(__file__).resolve().parents[1]
# Families with full attention, QK norms, and sliding layers; their 4 heads and 2 KV heads split over 2 ranks.
FAMILIES = ("llama", "qwen3", "gemma3")
LOOKAHEAD_CASES = {
    "window_4": "plain",
    "auto": "plain",
    "window_4_static": "plain_static",
    "auto_batch": "plain_batch",
    "window_4_eos": "plain_eos",
}


def run_ranks(ranks: int, out: Path, args: list[str], timeout: float = 900) -> list[dict]:
    """Runs `tests/tp_worker.py` under `torchrun` on loopback; returns each rank's report. Kills it all on timeout."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", "--master-addr=127.0.0.1"]
    command += [f"--master-port={free_port()}", str(ROOT / "tests" / "tp_worker.py"), str(out), *args]
    # One thread per rank: the ranks share the machine's cores.
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        command, cwd=ROOT, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise AssertionError(f"torchrun did not finish within {timeout} s:\n{output.decode()[-4000:]}") from None
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    if process.returncode != 0:
        raise AssertionError(f"torchrun failed ({process.returncode}):\n{output.decode()[-6000:]}")
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(ranks)]


def _counts(entry) -> list[int]:
    """An entry of `accepted_per_step` as JSON holds it: a count (one sequence) or a row's counts (a batch)."""
    return entry if isinstance(entry, list) else [entry]


class TensorParallelTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        root = Path(cls.tmp.name)
        folders = []
        for name in FAMILIES:
            folder = root / name
            tiny_model(name).save_pretrained(folder)
            folders.append(str(folder))
        small_vocabulary_model(key_value_heads=2).save_pretrained(root / "small")
        out = root / "out"
        out.mkdir()
        cls.reports = run_ranks(2, out, [*folders, "--sampling", str(root / "small"), "--bfloat16", folders[0]])

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_static_cache_was_checked(self):
        self.assertIn("window_4_static", self.reports[0]["llama"])

    def test_model_was_sharded(self):
        for report in self.reports:
            self.assertEqual((report["world_size"], report["tp_size"]), (2, 2))

    def test_every_rank_returns_the_same(self):
        first, second = self.reports
        for name in FAMILIES:
            for case in set(first[name]) - {"diverged"}:  # the error message names its rank
                with self.subTest(family=name, case=case):
                    self.assertEqual(first[name][case], second[name][case])
        self.assertEqual(first["sampling"], second["sampling"], "same seed, same samples on every rank")

    def test_identical_to_plain_tensor_parallel_greedy(self):
        report = self.reports[0]
        for name in FAMILIES:
            speculated = 0
            for case, reference in LOOKAHEAD_CASES.items():
                if case not in report[name]:
                    continue  # static caches: full-attention models only
                with self.subTest(family=name, case=case):
                    self.assertTrue(
                        torch.equal(
                            torch.tensor(report[name][case]["tokens"]), torch.tensor(report[name][reference]["tokens"])
                        )
                    )
                accepted = report[name][case]["accepted"]
                steps = [count for row in accepted for count in _counts(row)]
                speculated += max(steps, default=1) > 1
            self.assertGreater(speculated, 0, f"{name}: no step accepted several tokens")

    def test_bfloat16_is_near_greedy_on_every_rank(self):
        first, second = (report["bfloat16"] for report in self.reports)
        self.assertEqual(first, second, "same tokens on every rank")
        for case, result in first.items():
            with self.subTest(case=case):
                self.assertEqual(result["off_greedy"], [], f"largest margin {result['largest_margin']}")
        steps = [kept for result in first.values() for row in result["accepted"] for kept in _counts(row)]
        self.assertGreater(max(steps), 1, "no step accepted several tokens")

    def test_eos_inside_the_generation(self):
        report = self.reports[0]
        for name in FAMILIES:
            plain = report[name]["plain_eos"]["tokens"][0]
            self.assertLess(len(plain), len(report[name]["plain"]["tokens"][0]), f"{name}: EOS stopped plain decoding")

    def test_a_rank_that_diverges_fails_every_rank_without_hanging(self):
        for rank, report in enumerate(self.reports):
            for name in FAMILIES:
                error = report[name]["diverged"]["error"]
                self.assertIsNotNone(error, f"rank {rank}, {name}: the divergence went unnoticed")
                self.assertIn("diverged between tensor-parallel ranks", error)

    def test_sampling_keeps_the_distribution(self):
        samples = self.reports[0]["sampling"]
        plain = token_counts(torch.tensor(samples["plain"]), SMALL_VOCABULARY)
        looked = token_counts(torch.tensor(samples["lookahead"]), SMALL_VOCABULARY)
        for position in range(plain.shape[0]):
            with self.subTest(position=position):
                # False alarm 1e-5 per position, as the other sampling tests.
                self.assertGreater(homogeneity_p_value(plain[position], looked[position]), 1e-5)
        # Without a single accepted candidate, lookahead sampling would draw exactly what plain sampling draws.
        self.assertNotEqual(samples["plain"], samples["lookahead"], "lookahead sampling never speculated")


@slow
class SmolLM2TensorParallelTest(unittest.TestCase):
    """The real SmolLM2-135M (9 heads, 3 KV heads) over 3 ranks, on an MT-Bench and a HumanEval prompt."""

    def test_identical_to_plain_tensor_parallel_greedy(self):
        with tempfile.TemporaryDirectory() as tmp:
            reports = run_ranks(3, Path(tmp), [str(smollm2_path()), "--real-prompts", "--new-tokens", "32"])
        name = smollm2_path().name
        for report in reports[1:]:
            self.assertEqual(report[name], reports[0][name], "every rank returns the same")
        results = reports[0][name]
        accepted = []
        for index in range(2):
            for case in ("window_4", "auto"):
                with self.subTest(prompt=index, case=case):
                    self.assertEqual(results[f"{case}_{index}"]["tokens"], results[f"plain_{index}"]["tokens"])
                accepted += results[f"{case}_{index}"]["accepted"]
        self.assertGreater(max(accepted), 1, "no step accepted several tokens")
