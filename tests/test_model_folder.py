"""`save_lookahead_model`: a folder that stock Transformers loads with lookahead on (`trust_remote_code=True`)."""

import json
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from transformers_lookahead import save_lookahead_model

from .utils import random_prompt, tiny_model

# Run in a fresh interpreter that never imports transformers_lookahead itself: only the folder's
# `custom_generate/generate.py` does.
LOADER = """
import json, sys, torch
from transformers import AutoModelForCausalLM
folder, calls = sys.argv[1], json.loads(sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
passes = []
model.register_forward_hook(lambda *_: passes.append(1))
results = []
for call in calls:
    passes.clear()
    try:
        out = model.generate(torch.tensor(call.pop("prompt")), **call)
        results.append({"tokens": out.tolist(), "passes": len(passes)})
    except ValueError as error:
        results.append({"error": str(error)})
assert "transformers_lookahead" not in sys.modules, "the folder is self-contained"
assert any(".custom_generate.lookahead_decoding" in name for name in sys.modules), "the folder's modules ran"
print(json.dumps(results))
"""


def _run_in_fresh_process(folder: Path, calls: list[dict]) -> list[dict]:
    result = subprocess.run(
        [sys.executable, "-c", LOADER, str(folder), json.dumps(calls)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if result.returncode != 0:
        raise AssertionError(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


class ModelFolderTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.model = tiny_model("llama")
        cls.prompt = random_prompt(24, seed=2)
        cls.expected = cls.model.generate(cls.prompt, max_new_tokens=40, do_sample=False)
        cls.tmp = tempfile.TemporaryDirectory()
        cls.folder = save_lookahead_model(cls.model, Path(cls.tmp.name) / "model", lookahead_window=4)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_folder_layout_and_saved_fields(self):
        self.assertTrue((self.folder / "custom_generate" / "generate.py").is_file())
        saved = GenerationConfig.from_pretrained(self.folder)
        self.assertEqual(saved.lookahead_window, 4)
        self.assertIsNone(getattr(self.model.generation_config, "lookahead_window", None), "the model is unchanged")

    def test_loaded_in_a_fresh_process_with_lookahead_on(self):
        prompt = self.prompt.tolist()
        common = {"max_new_tokens": 40, "do_sample": False}
        results = _run_in_fresh_process(
            self.folder,
            [
                # The first lookahead call in a process also checks the model (`StepCheck`): its passes count there.
                {"prompt": prompt, **common},
                {"prompt": prompt, **common},  # the saved fields
                {
                    "prompt": prompt,
                    **common,
                    "lookahead_window": "auto",
                    "lookahead_memory": True,
                },  # a call's settings
                {"prompt": prompt, **common, "lookahead_window": "auto", "lookahead_memory": True},  # from the memory
                {"prompt": prompt, **common, "lookahead_window": "off"},  # plain decoding
                {"prompt": prompt, **common, "num_beams": 2},  # another strategy: refused
                {"prompt": prompt, **common, "lookahead_window": -1},  # a bad value: refused
            ],
        )
        first, saved, auto, again, off, beams, bad = results
        self.assertGreater(first["passes"], saved["passes"], "the check ran once, in the first call")
        for result in (first, saved, auto, again, off):
            self.assertTrue(torch.equal(torch.tensor(result["tokens"]), self.expected))
        self.assertLess(saved["passes"], 40, "the saved lookahead fields were used")
        self.assertLess(again["passes"], auto["passes"], "the model keeps its state, memory included, across calls")
        self.assertEqual(off["passes"], 40, "one pass per token without lookahead")
        self.assertIn("cannot be combined with `num_beams`", beams["error"])
        self.assertIn("`lookahead_window` must be an integer >= 1", bad["error"])

    def test_stock_loading_without_remote_code_is_plain(self):
        model = AutoModelForCausalLM.from_pretrained(self.folder)
        self.assertTrue(torch.equal(model.generate(self.prompt, max_new_tokens=40, do_sample=False), self.expected))

    def test_bad_settings_are_refused_before_writing(self):
        with tempfile.TemporaryDirectory() as tmp:
            with self.assertRaisesRegex(ValueError, "`lookahead_ngram` must be an integer >= 2"):
                save_lookahead_model(self.model, Path(tmp) / "model", lookahead_ngram=1)
            with self.assertRaisesRegex(ValueError, "Unknown lookahead settings"):
                save_lookahead_model(self.model, Path(tmp) / "model", lookahead_windows=4)
            self.assertEqual(list(Path(tmp).iterdir()), [])
