"""Packaging for transformers-lookahead."""

from setuptools import find_packages, setup

setup(
    name="transformers-lookahead",
    version="0.1.0",
    description="Lookahead decoding as a native Hugging Face Transformers generation strategy",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    package_dir={"": "src"},
    packages=find_packages("src"),
    package_data={"transformers_lookahead": ["hub/README.md", "hub/custom_generate/*"]},
    include_package_data=True,
    python_requires=">=3.11",
    # 5.24: static cache layers can be cropped, which rolling a static cache back after a step needs.
    install_requires=["torch>=2.4", "transformers>=5.24,<6", "safetensors"],
    extras_require={
        # `transformers[serving]` brings `transformers serve` and the `openai` client the serving tests use.
        "testing": ["pytest", "parameterized", "hypothesis", "gguf", "accelerate", "tqdm", "transformers[serving]"],
        "serving": ["transformers[serving]"],
        "quality": ["ruff==0.17.6"],
        "benchmark": ["gguf", "accelerate", "tqdm", "matplotlib"],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
