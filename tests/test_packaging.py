"""What the package ships: the generation strategy, and nothing from the tooling around it."""

import ast
import dataclasses
import shutil
import subprocess
import sys
import tempfile
import unittest
import zipfile
from pathlib import Path

import transformers
from transformers.generation.continuous_batching.requests import RequestState

import transformers_lookahead

ROOT = Path(__file__).resolve().parents[1]
# The Transformers modules the package reaches into, and the only files where their private names may appear: the
# compatibility module and the test that checks it.
TRANSFORMERS_REACHED = (
    "generation/**/*.py",
    "cache_utils.py",
    "configuration_utils.py",
    "masking_utils.py",
    "modeling_utils.py",
    "integrations/sdpa_attention.py",
)
PRIVATE_API_FILES = {
    "compatibility.py",
    "engine_compatibility.py",
    "transformers_compatibility.py",
    "test_compatibility.py",
}
# Everything `generate` needs, and only that.
STRATEGY_MODULES = {
    "__init__",
    "adaptive_planner",
    "adaptive_policy",
    "auto_tuning",
    "cache_commit",
    "chain_steps",
    "compatibility",
    "configuration_lookahead",
    "continuous_batching",
    "cost_measurement",
    "cost_model",
    "engine_compatibility",
    "folder_generate",
    "generation_mixin",
    "hub_generate",
    "lookahead_decoding",
    "lookahead_generation",
    "lookahead_state",
    "lookahead_window",
    "model_folder",
    "ngram_pool",
    "rank_sync",
    "sequence_lookahead",
    "step_check",
    "step_forward",
    "step_layout",
    "step_policy",
    "token_tree",
    "suffix_memory",
    "verification",
}


# The strategy's core (see `ImportGraphTest.test_the_core_imports_no_extension`).
CORE_MODULES = {
    "cache_commit",
    "compatibility",
    "configuration_lookahead",
    "hub_generate",
    "lookahead_decoding",
    "lookahead_generation",
    "lookahead_window",
    "ngram_pool",
    "sequence_lookahead",
    "step_forward",
    "step_layout",
    "step_policy",
    "token_tree",
    "verification",
}


class WheelContentsTest(unittest.TestCase):
    def test_wheel_holds_the_strategy_only(self):
        with tempfile.TemporaryDirectory() as tmp:
            # Built from a copy: building writes `build/` and `*.egg-info` next to the sources.
            source = Path(tmp) / "source"
            shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
            for name in ("setup.py", "pyproject.toml", "README.md"):
                shutil.copy(ROOT / name, source / name)
            subprocess.run(
                [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp, source],
                check=True,
                capture_output=True,
                timeout=300,
            )
            (wheel,) = Path(tmp).glob("transformers_lookahead-*.whl")
            names = zipfile.ZipFile(wheel).namelist()
        package = sorted(n.removeprefix("transformers_lookahead/") for n in names if "dist-info" not in n)
        modules = {name.removesuffix(".py") for name in package if "/" not in name}
        self.assertEqual(modules, STRATEGY_MODULES)
        self.assertEqual(set(package), {f"{module}.py" for module in modules}, "modules only, no data files")
        self.assertEqual({n.split("/")[0] for n in names if "dist-info" not in n}, {"transformers_lookahead"})


class PublicApiTest(unittest.TestCase):
    def test_all_lists_what_users_call(self):
        self.assertEqual(
            set(transformers_lookahead.__all__),
            {
                "LookaheadConfig",
                "LookaheadDecoderOnlyOutput",
                "LookaheadEncoderDecoderOutput",
                "LookaheadGenerationMixin",
                "LookaheadState",
                "enable_lookahead",
                "generate",
                "save_lookahead_model",
                "write_custom_generate",
            },
        )
        for name in transformers_lookahead.__all__:
            self.assertTrue(hasattr(transformers_lookahead, name), name)

    def test_the_package_imports_no_tooling(self):
        # A fresh interpreter: what importing the package pulls in, nothing the tests loaded before.
        code = "import sys, transformers_lookahead; print(' '.join(m for m in ('matplotlib', 'gguf') if m in sys.modules))"
        loaded = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120)
        self.assertEqual(loaded.stdout.strip(), "")
        for module in STRATEGY_MODULES:
            source = (Path(transformers_lookahead.__file__).parent / f"{module}.py").read_text()
            for tooling in ("import argparse", "import subprocess", "import matplotlib", "pip download"):
                self.assertNotIn(tooling, source, f"{module}.py")


def package_imports(directory: Path) -> dict[str, set[str]]:
    """Each module of the package and the package modules it imports (`from .x import ...`, anywhere in it)."""
    graph = {}
    for path in sorted(directory.glob("*.py")):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                imported.update([node.module.split(".")[0]] if node.module else [alias.name for alias in node.names])
        graph[path.stem] = imported
    return graph


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of `graph` (its modules in order, the first repeated at the end), or `None` if it has none."""
    done, path = set(), []

    def visit(module: str) -> list[str] | None:
        if module in path:
            return path[path.index(module) :] + [module]
        if module in done:
            return None
        path.append(module)
        for imported in sorted(graph.get(module, ())):
            cycle = visit(imported)
            if cycle:
                return cycle
        path.pop()
        done.add(module)
        return None

    return next((cycle for cycle in map(visit, sorted(graph)) if cycle), None)


class ImportGraphTest(unittest.TestCase):
    def test_no_cycle_and_neither_loop_imports_the_other(self):
        graph = package_imports(Path(transformers_lookahead.__file__).parent)
        self.assertEqual(set(graph), STRATEGY_MODULES)
        self.assertIsNone(import_cycle(graph))
        # `generate`'s loop and continuous batching share the step core (`sequence_lookahead`), not each other.
        self.assertNotIn("continuous_batching", graph["lookahead_decoding"])
        self.assertNotIn("lookahead_decoding", graph["continuous_batching"])
        for loop in ("lookahead_decoding", "continuous_batching"):
            self.assertIn("sequence_lookahead", graph[loop])

    def test_the_core_imports_no_extension(self):
        # The loop and what one step is made of; everything else plugs in through the core's interfaces
        # (`DecoderBuilder`, `StepPlanner`, `CandidateSource`, `StepPolicy`, `StepSync`) and is never imported by it.
        graph = package_imports(Path(transformers_lookahead.__file__).parent)
        for module in CORE_MODULES:
            self.assertLessEqual(graph[module], CORE_MODULES, module)
        extensions = (
            "adaptive_planner",
            "auto_tuning",
            "chain_steps",
            "continuous_batching",
            "rank_sync",
            "step_check",
            "suffix_memory",
        )
        for extension in extensions:
            self.assertNotIn(extension, CORE_MODULES)

    def test_pricing_is_a_leaf_the_policy_asks(self):
        graph = package_imports(Path(transformers_lookahead.__file__).parent)
        # What steps cost runs nothing; measuring a table runs steps, and the policy does not depend on that.
        self.assertLessEqual(graph["cost_model"], {"auto_tuning"})
        reached, todo = set(), ["adaptive_policy"]
        while todo:
            for module in graph[todo.pop()] - reached:
                reached.add(module)
                todo.append(module)
        self.assertTrue(reached.isdisjoint({"cost_measurement", "step_forward", "step_layout"}), reached)

    def test_a_cycle_is_found(self):
        self.assertEqual(import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}), ["a", "b", "c", "a"])
        self.assertIsNone(import_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}))


def private_names(source: str) -> set[str]:
    """The names with one leading underscore a module defines: its functions, classes and assigned attributes."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = node.name
        elif isinstance(node, ast.Attribute | ast.Name) and isinstance(node.ctx, ast.Store):
            name = node.attr if isinstance(node, ast.Attribute) else node.id
        else:
            continue
        if name.startswith("_") and not name.startswith("__"):
            names.add(name)
    return names


def private_uses(source: str, theirs: set[str]) -> list[str]:
    """Where `source` reads a name of `theirs` it does not define itself (an attribute or an import), as `name:line`."""
    foreign = theirs - private_names(source)
    uses = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in foreign:
            uses.append(f"{node.attr}:{node.lineno}")
        elif isinstance(node, ast.ImportFrom):
            uses += [f"{alias.name}:{node.lineno}" for alias in node.names if alias.name in foreign]
    return uses


class EngineReachTest(unittest.TestCase):
    # What the continuous-batching engine holds that lookahead reads or writes: its request states' fields, the
    # batch it prepares, and its processor's, runner's and manager's parts (names other classes also use, such as
    # `request_id` or `input_ids`, left out).
    ENGINE_ATTRIBUTES = {
        *(field.name for field in dataclasses.fields(RequestState)),
        *("requests_in_batch", "cumulative_seqlens_q", "cumulative_seqlens_k", "num_q_tokens", "model_dtype"),
        *("model_runner", "logit_processor", "cb_config", "scheduler", "active_requests", "cache_allocators"),
        *("pad_inputs", "block_table", "has_new_token", "status", "generated_len", "update_and_check_completion"),
    } - {"request_id", "eos_token_id", "max_new_tokens", "streaming"}

    def test_continuous_batching_reaches_the_engine_through_its_compatibility_module(self):
        source = (ROOT / "src" / "transformers_lookahead" / "continuous_batching.py").read_text()
        self.assertEqual(
            sorted(engine_reach(source) & self.ENGINE_ATTRIBUTES), [], "move it to engine_compatibility.py"
        )

    def test_a_reach_into_a_request_state_is_found(self):
        reaching = "def plan(state):\n    state.tokens_to_process = [1]\n    return state.position_offset\n"
        self.assertEqual(engine_reach(reaching) & self.ENGINE_ATTRIBUTES, {"tokens_to_process", "position_offset"})


def engine_reach(source: str) -> set[str]:
    """Every attribute name `source` reads or writes."""
    return {node.attr for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Attribute)}


class PrivateNamesTest(unittest.TestCase):
    def test_private_transformers_names_only_in_the_compatibility_module(self):
        root = Path(transformers.__file__).parent
        theirs = set().union(
            *(private_names(path.read_text()) for pattern in TRANSFORMERS_REACHED for path in root.glob(pattern))
        )
        self.assertIn("_prefill", theirs)
        ours = [path for folder in ("src", "tests", "utils") for path in sorted((ROOT / folder).rglob("*.py"))]
        found = {
            str(path.relative_to(ROOT)): uses
            for path in ours
            if path.name not in PRIVATE_API_FILES and (uses := private_uses(path.read_text(), theirs))
        }
        self.assertEqual(found, {}, "private Transformers names belong in compatibility.py")

    def test_a_private_use_is_found(self):
        theirs = {"_hidden_setting", "_prefill"}
        reaching = "from transformers.x import _prefill\n\ndef f(model):\n    return model.config._hidden_setting\n"
        self.assertEqual(private_uses(reaching, theirs), ["_prefill:1", "_hidden_setting:4"])
        # A name the module defines itself is its own.
        self.assertEqual(private_uses("class A:\n    def _prefill(self):\n        return self._prefill\n", theirs), [])
