"""
The Hub strategy repository's entry point, written as its `custom_generate/generate.py`: stock Transformers runs it
through `model.generate(..., custom_generate=<repo>, trust_remote_code=True)`. It imports the core only, so the
repository holds the core's modules and nothing else: fixed windows; `"auto"`, chain steps for recurrent layers and
the model check come with the `transformers-lookahead` package.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from .lookahead_generation import generate_with_lookahead

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Where neither the call nor a generation config sets them: the reference implementation's W = 7, N = 5, G = 7.
HUB_DEFAULTS = MappingProxyType({"lookahead_window": 7, "lookahead_ngram": 5})


def generate(*args: Any, model: PreTrainedModel, **kwargs: Any):
    """
    `generate` with lookahead decoding; `lookahead_*` arguments and generation config fields apply, and
    `lookahead_window="off"` decodes without lookahead. `model` is keyword-only, as Transformers passes it.
    """
    return generate_with_lookahead(model, *args, defaults=HUB_DEFAULTS, **kwargs)
