"""Lookahead decoding as a native Hugging Face Transformers generation strategy."""

from .configuration_lookahead import LookaheadConfig
from .generation_mixin import LookaheadGenerationMixin, enable_lookahead, generate_with_lookahead
from .lookahead_decoding import LookaheadDecoderOnlyOutput, LookaheadEncoderDecoderOutput, generate
from .lookahead_state import LookaheadState
from .model_folder import HUB_FOLDER as _HUB_PATH
from .model_folder import save_lookahead_model

__version__ = "0.1.0"

# A Hub-layout folder (`custom_generate/generate.py` + README) for `generate(custom_generate=HUB_FOLDER,
# trust_remote_code=True)` or for uploading as a Hub repository.
HUB_FOLDER = str(_HUB_PATH)

__all__ = [
    "HUB_FOLDER",
    "LookaheadConfig",
    "LookaheadDecoderOnlyOutput",
    "LookaheadEncoderDecoderOutput",
    "LookaheadGenerationMixin",
    "LookaheadState",
    "enable_lookahead",
    "generate",
    "generate_with_lookahead",
    "save_lookahead_model",
]
