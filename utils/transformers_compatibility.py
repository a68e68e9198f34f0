"""
The private Transformers APIs the tools and tests use (the package's own are in `compatibility.py`): building random
models, compiling on a CPU, and reporting an attention backend without loading it.
"""

from __future__ import annotations

from typing import Any

from transformers import CompileConfig, PretrainedConfig, PreTrainedModel


def set_attention_implementation_unchecked(model: PreTrainedModel, name: str) -> None:
    """
    Sets the backend the model reports (`PretrainedConfig._attn_implementation`) without loading its kernels, as a
    test does to see that a backend lookahead cannot use (flash attention) is refused.
    """
    model.config._attn_implementation = name


def model_from_config(cls: type[PreTrainedModel], config: PretrainedConfig, attn_implementation: str | None) -> Any:
    """A randomly initialised model of `cls` (`PreTrainedModel._from_config`), as the tests and checks build them."""
    return cls._from_config(config, attn_implementation=attn_implementation)


def compile_config(**kwargs: Any) -> CompileConfig:
    """
    A `CompileConfig` that also compiles on a CPU (`CompileConfig._compile_all_devices`): plain `generate` compiles
    its forward pass only on accelerators unless this is set.
    """
    config = CompileConfig(**kwargs)
    config._compile_all_devices = True
    return config
