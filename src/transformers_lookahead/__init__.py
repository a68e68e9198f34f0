"""Lookahead decoding as a native Hugging Face Transformers generation strategy."""

from pathlib import Path

from .cache_commit import CacheCommitter
from .configuration_lookahead import LOOKAHEAD_FIELDS, LookaheadConfig
from .cost_model import StepCostModel
from .generation_mixin import LookaheadGenerationMixin, enable_lookahead, generate_with_lookahead
from .lookahead_decoding import LookaheadDecoderOnlyOutput, LookaheadEncoderDecoderOutput, generate
from .lookahead_window import LookaheadWindow
from .ngram_pool import ContextIndex, NGramPool, TokenTree
from .step_forward import StepForward
from .step_layout import StepLayout
from .step_policy import AdaptiveStepPolicy, StaticStepPolicy
from .verification import GreedyVerifier, SamplingVerifier

__version__ = "0.1.0"

# A Hub-layout folder (`custom_generate/generate.py` + README) for `generate(custom_generate=HUB_FOLDER,
# trust_remote_code=True)` or for uploading as a Hub repository.
HUB_FOLDER = str(Path(__file__).parent / "hub")

__all__ = [
    "HUB_FOLDER",
    "LOOKAHEAD_FIELDS",
    "AdaptiveStepPolicy",
    "CacheCommitter",
    "ContextIndex",
    "GreedyVerifier",
    "LookaheadConfig",
    "LookaheadDecoderOnlyOutput",
    "LookaheadEncoderDecoderOutput",
    "LookaheadGenerationMixin",
    "LookaheadWindow",
    "NGramPool",
    "SamplingVerifier",
    "StaticStepPolicy",
    "StepCostModel",
    "StepForward",
    "StepLayout",
    "TokenTree",
    "enable_lookahead",
    "generate",
    "generate_with_lookahead",
]
