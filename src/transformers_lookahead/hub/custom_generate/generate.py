"""
Hub entry point: `model.generate(..., custom_generate=<this folder>, trust_remote_code=True)`, or the `generate` of a
model loaded with `from_pretrained(folder, trust_remote_code=True)` from a folder written by `save_lookahead_model`
(what `transformers serve FOLDER --trust-remote-code` does).
"""

from transformers_lookahead import LookaheadState, generate_with_lookahead
from transformers_lookahead.lookahead_decoding import DEFAULT_WINDOW

try:  # present where `transformers serve` runs
    from starlette.exceptions import HTTPException
except ImportError:  # pragma: no cover - plain Python use
    HTTPException = None


def generate(*args, model, **kwargs):
    """
    Runs `generate` with lookahead decoding; `lookahead_*` arguments and generation config fields apply. `model` is
    keyword-only: `from_pretrained` binds it with `functools.partial(generate, model=...)`, so the inputs of
    `model.generate(input_ids, ...)` arrive positionally.

    The model keeps one `LookaheadState` for its life, as `model.lookahead_state` (what `enable_lookahead` gives):
    created by its first call here, since a folder's `generate` is the only code of ours a server runs. Requests
    then share the cost table, the carried estimates and the suffix memory.
    """
    if "lookahead_state" not in vars(model):
        # `setdefault` on the instance dict is atomic: two first requests at once agree on one state.
        vars(model).setdefault("lookahead_state", LookaheadState())
    try:
        return generate_with_lookahead(model, *args, default_window=DEFAULT_WINDOW, **kwargs)
    except ValueError as error:
        if HTTPException is None:
            raise
        # A refused setting is the request's fault: a server answers 422 with the message instead of a bare 500.
        raise RequestSettingsError(str(error)) from error


if HTTPException is not None:

    class RequestSettingsError(ValueError, HTTPException):
        """A `ValueError` that web frameworks built on Starlette (`transformers serve`) answer with a 422."""

        def __init__(self, message: str):
            ValueError.__init__(self, message)
            HTTPException.__init__(self, status_code=422, detail=message)

        def __str__(self) -> str:
            return self.detail
