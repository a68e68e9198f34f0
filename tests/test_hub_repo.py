"""
The self-contained `custom_generate/` folder (`write_custom_generate`), the Hub repository built around it
(`utils/build_hub_repo.py`), and both run where a Hub user is: a venv with stock torch and Transformers only.
"""

import ast
import importlib.metadata
import json
import sys
import tempfile
import unittest
from pathlib import Path

import torch
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.dynamic_module_utils import check_python_requirements, get_relative_import_files
from transformers.testing_utils import slow

import transformers_lookahead
from transformers_lookahead.configuration_lookahead import LOOKAHEAD_FIELDS
from transformers_lookahead.lookahead_state import MEMORY_DIR_VARIABLE
from transformers_lookahead.model_folder import FOLDER_ENTRY, HUB_ENTRY, PACKAGE_DIR, custom_generate_files
from utils.build_hub_repo import build_hub_repo
from utils.serving import ServeProcess, lookahead_folder
from utils.stock_venv import run_in_stock_venv, stock_python

from .utils import stream_chat, stream_chats_at_once, stream_writes

# Runs in the stock venv as a Hub user would.
STOCK_USER = Path(__file__).with_name("stock_user.py")
# What the folder's code may import besides itself: the standard library, and what its requirements name (with
# safetensors and numpy, Transformers dependencies, and starlette, imported only where it is installed).
ALLOWED_IMPORTS = set(sys.stdlib_module_names) | {"torch", "transformers", "safetensors", "numpy", "starlette"}
README_SECTIONS = [
    "## Description",
    "## Base model",
    "## Model compatibility",
    "## Additional Arguments",
    "## Output Type changes",
    "## Example usage",
]


class CustomGenerateFolderTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)
        self.folder = transformers_lookahead.write_custom_generate(self.tmp.name)

    def test_files_are_the_package_modules_unchanged(self):
        written = {path.name: path.read_text() for path in self.folder.iterdir()}
        self.assertEqual(written, custom_generate_files())
        for name, text in written.items():
            if name == "requirements.txt":
                continue
            module = HUB_ENTRY if name == "generate.py" else name.removesuffix(".py")
            self.assertEqual(text, (PACKAGE_DIR / f"{module}.py").read_text(), f"{name} differs from {module}.py")

    def test_transformers_collects_exactly_these_modules(self):
        collected = {Path(path).name for path in get_relative_import_files(str(self.folder / "generate.py"))}
        modules = {path.name for path in self.folder.glob("*.py")} - {"generate.py"}
        self.assertEqual(collected, modules)
        self.assertNotIn("model_folder.py", modules, "the tooling that writes folders is not shipped in them")

    def test_the_repository_is_the_core(self):
        from .test_packaging import CORE_MODULES

        modules = {path.stem for path in self.folder.glob("*.py")} - {"generate"}
        self.assertEqual(modules | {HUB_ENTRY}, CORE_MODULES)
        lines = sum(text.count("\n") for text in custom_generate_files().values())
        folder_lines = sum(text.count("\n") for text in custom_generate_files(FOLDER_ENTRY).values())
        self.assertLess(lines, folder_lines, "a model folder carries what the package adds")

    def test_unknown_entry_is_refused(self):
        with self.assertRaisesRegex(ValueError, "`entry` must be one of"):
            custom_generate_files("lookahead_decoding")

    def test_imports_only_what_a_stock_environment_has(self):
        for path in self.folder.glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.level:
                    self.assertEqual(node.level, 1, f"{path.name}: only `from .module import name` is followed")
                    self.assertTrue((self.folder / f"{node.module}.py").is_file(), f"{path.name}: .{node.module}")
                elif isinstance(node, ast.ImportFrom | ast.Import):
                    names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                    for name in names:
                        self.assertIn(name.split(".")[0], ALLOWED_IMPORTS, f"{path.name} imports {name}")

    def test_requirements_are_the_packages_own_bounds(self):
        requirements = [Requirement(line) for line in (self.folder / "requirements.txt").read_text().splitlines()]
        self.assertEqual({requirement.name for requirement in requirements}, {"torch", "transformers"})
        installed = {
            Requirement(r).name: Requirement(r).specifier
            for r in importlib.metadata.requires("transformers-lookahead")
            if ";" not in r
        }
        for name in ("torch", "transformers"):
            folder_bounds = SpecifierSet(",".join(str(r.specifier) for r in requirements if r.name == name))
            self.assertEqual(folder_bounds, installed[name], f"{name}: the folder and setup.py disagree")
        check_python_requirements(self.tmp.name, requirements_file="custom_generate/requirements.txt")

    def test_writing_again_replaces_a_stale_folder(self):
        (self.folder / "old_module.py").write_text("raise ImportError")
        transformers_lookahead.write_custom_generate(self.tmp.name)
        self.assertEqual(sorted(path.name for path in self.folder.iterdir()), sorted(custom_generate_files()))


class HubRepoTest(unittest.TestCase):
    def test_readme_has_what_a_custom_generate_repo_needs(self):
        with tempfile.TemporaryDirectory() as tmp:
            folder = build_hub_repo(Path(tmp) / "repo", repo_id="owner/lookahead")
            readme = (folder / "README.md").read_text()
            self.assertEqual(sorted(path.name for path in folder.iterdir()), ["README.md", "custom_generate"])
        front_matter = readme.split("---")[1]
        self.assertIn("library_name: transformers", front_matter)
        self.assertIn("- custom_generate", front_matter)
        positions = [readme.index(section) for section in README_SECTIONS]
        self.assertEqual(positions, sorted(positions))
        arguments = readme[readme.index("## Additional Arguments") : readme.index("## Output Type changes")]
        for field in LOOKAHEAD_FIELDS:
            self.assertIn(f"`{field}`", arguments)
        self.assertIn('custom_generate="owner/lookahead"', readme)
        self.assertNotIn("{", readme.split("```python")[0], "every placeholder is filled")


@slow
class StockTransformersTest(unittest.TestCase):
    """SmolLM2-135M-Instruct in fp32, decoded in a venv where `transformers_lookahead` cannot be imported."""

    MAX_NEW_TOKENS = 48
    CALLS = [{"lookahead_window": 4, "lookahead_ngram": 3}, {"lookahead_window": "auto"}, {"lookahead_window": "off"}]

    @classmethod
    def setUpClass(cls):
        cls.python = stock_python()
        cls.folder = lookahead_folder("auto")
        cls.tokenizer = AutoTokenizer.from_pretrained(cls.folder)
        # Text that continues what it read, where any speculative decoder takes multi-token steps.
        texts = [
            'def is_palindrome(text):\n    """Return True if text reads the same backwards."""\n    return text == '
            'text[::-1]\n\n\ndef is_anagram(first, second):\n    """Return True if',
            "Counting in words: one, two, three, four, five, six, seven,",
        ]
        cls.prompts = [cls.tokenizer(text)["input_ids"] for text in texts]
        cls.tmp = tempfile.TemporaryDirectory()
        cls.repo = build_hub_repo(Path(cls.tmp.name) / "lookahead-repo")

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    @classmethod
    def routes(cls) -> dict:
        """What the stock user saw through both routes, from one process in the stock venv (run on first use)."""
        if not hasattr(cls, "_routes"):
            job = {
                "model": str(cls.folder),
                "routes": ["custom_generate", "model_folder"],
                "repo": str(cls.repo),
                "prompts": cls.prompts,
                "max_new_tokens": cls.MAX_NEW_TOKENS,
                "calls": cls.CALLS,
            }
            cls._routes = run_in_stock_venv(STOCK_USER, job)
        return cls._routes

    def _check(self, route: str) -> None:
        result = self.routes()
        self.assertFalse(result["lookahead_importable"], "the stock venv must not hold transformers_lookahead")
        self.assertIn("lookahead_decoding", result["loaded"][route], "the folder's own modules ran")
        lookahead, auto, off = result["calls"][route]
        for index, plain in enumerate(result["plain"]):
            new_tokens = len(plain) - len(self.prompts[index])
            self.assertEqual(new_tokens, self.MAX_NEW_TOKENS)
            if route == "custom_generate":
                # The repository is the core: fixed windows, and `"auto"` refused by name before any pass.
                self.assertIn("transformers-lookahead", auto[index]["error"])
                calls = (("window 4", lookahead), ("off", off))
            else:
                self.assertLess(auto[index]["passes"], new_tokens, 'multi-token steps with "auto"')
                calls = (("window 4", lookahead), ("auto", auto), ("off", off))
            for name, call in calls:
                self.assertEqual(call[index]["tokens"], plain, f"{name}, prompt {index}")
            self.assertLess(lookahead[index]["passes"], new_tokens, "multi-token steps with lookahead_window=4")
            self.assertEqual(off[index]["passes"], new_tokens, "one pass per token with lookahead off")

    def test_custom_generate_repo_with_call_settings(self):
        self._check("custom_generate")

    def test_model_folder_route(self):
        self._check("model_folder")

    def test_served_model_folder_with_two_clients(self):
        import openai

        model = AutoModelForCausalLM.from_pretrained(self.folder, dtype=torch.float32)
        # One client takes the folder's "auto", whose choices depend on this machine's measured costs; the other asks
        # for a fixed window, which takes multi-token steps on its question on any machine (28 passes for 40 tokens).
        settings = {
            "List three facts about the Moon.": {"lookahead_window": 4, "lookahead_ngram": 3},
            "Write a Python function that adds two numbers.": {},
        }
        expected = {}
        for question in settings:
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt"
            )["input_ids"]
            plain = model.generate(ids, max_new_tokens=40, do_sample=False)
            expected[question] = self.tokenizer.decode(plain[0, ids.shape[1] :], skip_special_tokens=True)
        with tempfile.TemporaryDirectory() as memory_dir:
            environment = {MEMORY_DIR_VARIABLE: memory_dir}
            with ServeProcess(self.folder, python=self.python, environment=environment) as server:
                client = openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=600, max_retries=0)
                bodies = {
                    question: {"generation_config": json.dumps(setting)} if setting else None
                    for question, setting in settings.items()
                }
                results, errors = stream_chats_at_once(client, str(self.folder), bodies, 40)
                self.assertEqual(errors, [])
                moon = "List three facts about the Moon."
                off = {"generation_config": json.dumps({"lookahead_window": "off"})}
                plain_answer, plain_arrivals = stream_chat(client, str(self.folder), moon, 40, off)
            written = list(Path(memory_dir).iterdir())
        self.assertEqual({question: text for question, (text, _) in results.items()}, expected)
        self.assertEqual(plain_answer, expected[moon])
        # A step's accepted tokens leave the server in one write, so the fixed window's stream takes clearly fewer
        # writes than plain decoding's one per forward pass.
        writes, plain_writes = stream_writes(results[moon][1]), stream_writes(plain_arrivals)
        self.assertLessEqual(writes, 0.9 * plain_writes, f"{writes} writes against plain decoding's {plain_writes}")
        self.assertEqual(written, [], "served models keep no suffix memory unless the operator turns it on")
