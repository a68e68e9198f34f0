"""Packaging for transformers-lookahead."""

import ast
import re
from pathlib import Path

from setuptools import find_packages, setup


def _requirement(name: str) -> str:
    """A requirement of the package, from the one place that states it (`compatibility.py`)."""
    source = Path(__file__).parent.joinpath("src", "transformers_lookahead", "compatibility.py").read_text()
    bounds = ast.literal_eval(re.search(rf"^{name.upper()}_REQUIREMENT = (.*)$", source, re.MULTILINE).group(1))
    return name + ",".join(bounds)


setup(
    name="transformers-lookahead",
    version="0.1.0",
    description="Lookahead decoding as a native Hugging Face Transformers generation strategy",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    package_dir={"": "src"},
    packages=find_packages("src"),
    python_requires=">=3.11",
    install_requires=[_requirement("torch"), _requirement("transformers"), "safetensors", "numpy"],
    extras_require={
        # `transformers[serving]` brings `transformers serve` and the `openai` client the serving tests use.
        "testing": [
            "pytest",
            "pytest-xdist",
            "parameterized",
            "hypothesis",
            "gguf",
            "accelerate",
            "tqdm",
            "transformers[serving]",
        ],
        "serving": ["transformers[serving]"],
        "quality": ["ruff==0.17.6"],
        "benchmark": ["gguf", "accelerate", "tqdm"],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
