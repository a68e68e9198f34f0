"""
Lookahead decoding as a native Hugging Face Transformers generation strategy.

One way for each use:
- in this process: `enable_lookahead(model)`, then `model.generate(..., lookahead_window="auto")` (or a class that
  puts `LookaheadGenerationMixin` in front of its model class);
- a model folder that stock Transformers loads with lookahead on: `save_lookahead_model(model, folder, tokenizer)`;
- a Hub strategy repository (`custom_generate=<repo>`), the core alone: `write_custom_generate(folder)`, which
  `utils/build_hub_repo.py` completes with the repository's README.

`generate` is the decoding loop itself, for `model.generate(..., custom_generate=transformers_lookahead.generate)`.
"""

from .configuration_lookahead import LookaheadConfig
from .generation_mixin import LookaheadGenerationMixin, enable_lookahead, generate
from .lookahead_decoding import LookaheadDecoderOnlyOutput, LookaheadEncoderDecoderOutput
from .lookahead_state import LookaheadState
from .model_folder import save_lookahead_model, write_custom_generate

__version__ = "0.1.0"

__all__ = [
    "LookaheadConfig",
    "LookaheadDecoderOnlyOutput",
    "LookaheadEncoderDecoderOutput",
    "LookaheadGenerationMixin",
    "LookaheadState",
    "enable_lookahead",
    "generate",
    "save_lookahead_model",
    "write_custom_generate",
]
