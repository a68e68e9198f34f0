"""
Every causal LM and every image-text-to-text model (on text alone) of the installed Transformers, built tiny and
random from its own config class (`tests/model_zoo.py`): lookahead decodes token-identically to plain greedy in fp32,
one prompt at a time and in a left-padded batch, with a fixed window and with `"auto"`, or is refused before the
call's prefill with an error naming the model's class. `utils/render_zoo.py` renders the verdicts into
`docs/source/en/model_zoo.md`; with the Transformers release that page was rendered with, every verdict must be the
page's.
"""

import re
import unittest
from pathlib import Path

import transformers
from parameterized import parameterized

from .model_zoo import zoo, zoo_verdict
from .utils import flat_state

PAGE = Path(__file__).parents[1] / "docs" / "source" / "en" / "model_zoo.md"
SETTINGS = (
    {"lookahead_window": 4, "lookahead_ngram": 3, "lookahead_guess": 4},
    {"lookahead_window": "auto"},
)
STATUSES = ("exact", "refused", "not built")


def page_verdicts() -> tuple[str | None, dict[tuple[str, str], tuple[str, str]]]:
    """The Transformers version the page was rendered with and its verdicts: (mapping, model type) -> (status, why)."""
    if not PAGE.exists():
        return None, {}
    text = PAGE.read_text()
    version = re.search(r"Transformers (\S+?)\*\*", text)
    rows = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[3] in STATUSES and cells[0] != "mapping":
            rows[(cells[0], cells[1].strip("`"))] = (cells[3], cells[4].replace("\\|", "|"))
    return (version.group(1) if version else None), rows


def cell(text: str) -> str:
    """A verdict's detail as a table cell: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def checked(mapping: str) -> list[tuple[str, object]]:
    return [(architecture.model_type, architecture) for architecture in zoo() if architecture.mapping == mapping]


class ModelZooMixin:
    def check(self, architecture) -> None:
        result = zoo_verdict(architecture, SETTINGS, flat_state)
        if result.status == "not built":
            self.skipTest(
                f"Transformers {transformers.__version__} cannot build or decode a tiny {architecture.class_name} "
                f"from its config class ({result.detail[:300]})"
            )
        self.assertIn(result.status, ("exact", "refused"), f"{architecture.class_name}: {result.detail}")
        version, rows = page_verdicts()
        if version == transformers.__version__:
            self.assertEqual(
                rows.get((architecture.mapping, architecture.model_type)),
                (result.status, cell(result.detail)),
                "run `python utils/render_zoo.py` to regenerate docs/source/en/model_zoo.md",
            )


class CausalLMZooTest(ModelZooMixin, unittest.TestCase):
    @parameterized.expand(checked("causal_lm"))
    def test_exact_or_refused_by_name(self, _, architecture):
        self.check(architecture)


class ImageTextToTextZooTest(ModelZooMixin, unittest.TestCase):
    """The image-text-to-text mapping's models on text alone: their language model's path, through their own class."""

    @parameterized.expand(checked("image_text_to_text"))
    def test_exact_or_refused_by_name(self, _, architecture):
        self.check(architecture)


class ZooPageTest(unittest.TestCase):
    def test_the_page_lists_every_architecture(self):
        version, rows = page_verdicts()
        if version != transformers.__version__:
            self.skipTest(f"the page lists Transformers {version}'s models; this is {transformers.__version__}")
        self.assertEqual(set(rows), {(a.mapping, a.model_type) for a in zoo()})
