"""Hub entry point: `model.generate(..., custom_generate=<this repository>, trust_remote_code=True)`."""

from transformers_lookahead import generate_with_lookahead
from transformers_lookahead.lookahead_decoding import DEFAULT_WINDOW


def generate(model, *args, **kwargs):
    """Runs `generate` with lookahead decoding; `lookahead_*` arguments and generation config fields apply."""
    return generate_with_lookahead(model, *args, default_window=DEFAULT_WINDOW, **kwargs)
