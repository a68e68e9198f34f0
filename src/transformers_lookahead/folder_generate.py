"""
The entry point of a model folder, written as `custom_generate/generate.py` of every folder `save_lookahead_model`
writes, with everything the package adds: stock Transformers runs it as the `generate` of the model loaded with
`trust_remote_code=True` (servers too). The Hub strategy repository's entry is the core's (`hub_generate.py`).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from .configuration_lookahead import AUTO
from .generation_mixin import lookahead_decoder
from .lookahead_generation import generate_with_lookahead
from .lookahead_state import LookaheadState

if TYPE_CHECKING:
    from transformers import PreTrainedModel

try:  # present where `transformers serve` runs
    from starlette.exceptions import HTTPException
except ImportError:  # pragma: no cover - plain Python use
    HTTPException = None

# What a call through this entry point gets when neither the call nor a generation config says otherwise.
FOLDER_DEFAULTS = MappingProxyType({"lookahead_window": AUTO})


def generate(*args: Any, model: PreTrainedModel, **kwargs: Any):
    """
    `generate` with lookahead decoding; `lookahead_*` arguments and generation config fields apply, and
    `lookahead_window="off"` decodes without lookahead. `model` is keyword-only: `from_pretrained` binds it with
    `functools.partial(generate, model=...)`, so the inputs of `model.generate(input_ids, ...)` arrive positionally.

    The model keeps one `LookaheadState` for its life, as `model.lookahead_state`, created by its first call here
    when it has none (a folder's `generate` is the only code of ours a server runs): requests then share the cost
    table and the carried estimates (and the suffix memory, where it is turned on).

    Raises:
        `ValueError` for a refused setting; under a Starlette server one that the server answers with HTTP 422 and
        the message (`transformers serve` 5.24; 5.25 runs the model in a process of its own and answers every
        `ValueError` with a 400 and the message).
    """
    _keep_state(model)
    try:
        return generate_with_lookahead(model, *args, defaults=FOLDER_DEFAULTS, build=lookahead_decoder, **kwargs)
    except ValueError as error:
        if HTTPException is None:
            raise
        # A refused setting is the request's fault: a server answers 422 with the message instead of a bare 500.
        raise RequestSettingsError(str(error)) from error


def init_continuous_batching(*args: Any, model: PreTrainedModel, **kwargs: Any):
    """
    `init_continuous_batching` with lookahead steps (see `continuous_batching.py`), for the upstream hook the guide
    proposes: stock Transformers binds only a folder's `generate` today, so `transformers serve --continuous-batching`
    does not reach this yet. Bound like `generate` (`functools.partial(init_continuous_batching, model=...)`), it
    would also serve `generate_batch` and the served engine.
    """
    from .continuous_batching import init_continuous_batching_with_lookahead

    _keep_state(model)
    return init_continuous_batching_with_lookahead(model, *args, **kwargs)


def _keep_state(model: PreTrainedModel) -> None:
    """Gives the model its one `LookaheadState` on its first call through this entry point."""
    if "lookahead_state" not in vars(model):
        # `setdefault` on the instance dict is atomic: two first requests at once agree on one state.
        vars(model).setdefault("lookahead_state", LookaheadState())


if HTTPException is not None:

    class RequestSettingsError(ValueError, HTTPException):
        """A `ValueError` that web frameworks built on Starlette (`transformers serve` 5.24) answer with a 422."""

        def __init__(self, message: str):
            ValueError.__init__(self, message)
            HTTPException.__init__(self, status_code=422, detail=message)

        def __str__(self) -> str:
            return self.detail
