"""
The private Transformers APIs lookahead decoding relies on, in one place.

Upstream, `generate` would call these internals directly. As a separate package it reaches them only through this
module, so that a Transformers release that renames or changes one of them breaks here, in one place, and
`tests/test_compatibility.py` says which one moved (CI runs it against the oldest and the newest Transformers
`setup.py` allows).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import inspect
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from transformers import GenerationConfig, GenerationMixin, PrefixConstrainedLogitsProcessor
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, StaticLayer, StaticSlidingWindowLayer

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.modeling_outputs import ModelOutput

# Cache layer classes whose `crop` puts them back as they were before a step (see `CacheCommitter`).
ROLLBACK_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer, StaticLayer, StaticSlidingWindowLayer)

# Extra static-cache room the current `generate` call needs for its lookahead steps. A context variable, not an
# attribute of the model: each thread (each server worker) and each call sees its own value.
_STEP_ROOM: contextvars.ContextVar[int] = contextvars.ContextVar("lookahead_step_room", default=0)


def prefill(
    model: PreTrainedModel, input_ids: torch.LongTensor, generation_config: GenerationConfig, model_kwargs: dict
) -> ModelOutput:
    """
    Runs the prompt through the model as `generate`'s own decoding loops do (`GenerationMixin._prefill`): the cache,
    the position ids, the cache position and the model's own input preparation (e.g. Whisper's) included.
    """
    return model._prefill(input_ids, generation_config, model_kwargs)


def can_auto_compile(model: PreTrainedModel, model_kwargs: dict, generation_config: GenerationConfig) -> bool:
    """Whether plain `generate` would compile its forward pass for this call
    (`GenerationMixin._valid_auto_compile_criteria`)."""
    return bool(model._valid_auto_compile_criteria(model_kwargs, generation_config))


def pad_token_id(generation_config: GenerationConfig) -> int | None:
    """The padding id `generate` resolved for the call (`GenerationConfig._pad_token_tensor`)."""
    pad = generation_config._pad_token_tensor
    return None if pad is None else int(pad)


def attention_implementation(model: PreTrainedModel) -> str | None:
    """The attention backend the model runs (`PretrainedConfig._attn_implementation`)."""
    return model.config._attn_implementation


def model_name_or_path(model: PreTrainedModel) -> str:
    """Where the model was loaded from (`PretrainedConfig._name_or_path`), empty when built from a config."""
    return str(getattr(model.config, "_name_or_path", ""))


def bind_batch_index(processor: PrefixConstrainedLogitsProcessor, row: int) -> PrefixConstrainedLogitsProcessor:
    """
    A copy of a `PrefixConstrainedLogitsProcessor` that applies to one row of the batch, called on that row alone:
    the user's `prefix_allowed_tokens_fn` (`_prefix_allowed_tokens_fn`) gets the row's index in the original batch.
    """
    bound = copy.copy(processor)
    allowed = processor._prefix_allowed_tokens_fn
    bound._prefix_allowed_tokens_fn = lambda _, ids: allowed(row, ids)
    return bound


def mark_as_user_config(generation_config: GenerationConfig) -> None:
    """
    Flags a generation config as the user's (`GenerationConfig._from_model_config = False`): configs flagged as
    derived from the model config lose their custom fields, the `lookahead_*` ones among them, when loaded again.
    """
    generation_config._from_model_config = False


def is_from_model_config(generation_config: GenerationConfig) -> bool:
    """Whether the generation config is flagged as derived from the model config (see `mark_as_user_config`)."""
    return bool(getattr(generation_config, "_from_model_config", False))


@contextlib.contextmanager
def step_room(tokens: int) -> Iterator[None]:
    """
    Within this block, static caches that `generate` builds get `tokens` more entries than plain decoding needs
    (see `prepare_cache_with_step_room`). Scoped to the current thread and call.
    """
    token = _STEP_ROOM.set(tokens)
    try:
        yield
    finally:
        _STEP_ROOM.reset(token)


def prepare_cache_with_step_room(
    self: PreTrainedModel,
    generation_config: GenerationConfig,
    model_kwargs: dict,
    generation_mode: Any,
    batch_size: int,
    max_cache_length: int,
) -> Any:
    """
    `GenerationMixin._prepare_cache_for_generation` for `LookaheadGenerationMixin`: a lookahead step writes a whole
    step past the accepted tokens before rolling back, so a static cache built for the call gets that much room
    beyond what plain decoding needs (`step_room`).
    """
    parent = super(_lookahead_mixin(), self)._prepare_cache_for_generation
    return parent(generation_config, model_kwargs, generation_mode, batch_size, max_cache_length + _STEP_ROOM.get())


def _lookahead_mixin() -> type:
    from .generation_mixin import LookaheadGenerationMixin

    return LookaheadGenerationMixin


def check_private_apis() -> list[str]:
    """
    What of the above no longer matches the installed Transformers: one sentence per API that moved, empty when all
    are in place.
    """
    problems = []

    def expect(condition: bool, message: str) -> None:
        if not condition:
            problems.append(message)

    def parameters(function: Callable | None) -> list[str]:
        return list(inspect.signature(function).parameters) if function is not None else []

    expect(
        parameters(getattr(GenerationMixin, "_prefill", None))[:4]
        == ["self", "input_ids", "generation_config", "model_kwargs"],
        "`GenerationMixin._prefill(self, input_ids, generation_config, model_kwargs)` (used by `prefill`)",
    )
    expect(
        parameters(getattr(GenerationMixin, "_prepare_cache_for_generation", None))
        == ["self", "generation_config", "model_kwargs", "generation_mode", "batch_size", "max_cache_length"],
        "`GenerationMixin._prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, "
        "batch_size, max_cache_length)` (overridden by `prepare_cache_with_step_room`)",
    )
    expect(
        parameters(getattr(GenerationMixin, "_valid_auto_compile_criteria", None))
        == ["self", "model_kwargs", "generation_config"],
        "`GenerationMixin._valid_auto_compile_criteria(self, model_kwargs, generation_config)` "
        "(used by `can_auto_compile`)",
    )
    prepare_special_tokens = getattr(GenerationMixin, "_prepare_special_tokens", None)
    expect(
        prepare_special_tokens is not None and "_pad_token_tensor" in inspect.getsource(prepare_special_tokens),
        "`GenerationConfig._pad_token_tensor`, set by `GenerationMixin._prepare_special_tokens` (used by "
        "`pad_token_id`)",
    )
    expect(
        hasattr(GenerationConfig(), "_from_model_config"),
        "`GenerationConfig._from_model_config` (used by `mark_as_user_config`)",
    )
    processor = PrefixConstrainedLogitsProcessor(lambda batch_id, ids: [0], num_beams=1)
    expect(
        callable(getattr(processor, "_prefix_allowed_tokens_fn", None)),
        "`PrefixConstrainedLogitsProcessor._prefix_allowed_tokens_fn` (used by `bind_batch_index`)",
    )
    from transformers import LlamaConfig

    expect(
        hasattr(LlamaConfig(), "_attn_implementation"),
        "`PretrainedConfig._attn_implementation` (used by `attention_implementation`)",
    )
    for layer in ROLLBACK_LAYERS:
        expect(
            callable(getattr(layer, "crop", None)) and "is_sliding" in dir(layer),
            f"`transformers.cache_utils.{layer.__name__}` with `crop` and `is_sliding` (see `ROLLBACK_LAYERS`)",
        )
    return problems


def tensor_parallel_group(model: PreTrainedModel) -> Any | None:
    """
    The process group a tensor-parallel model's collectives run in (from `tp_plan="auto"` or a `DistributedConfig`),
    or `None` for a model that was not sharded: the model's device mesh (`PreTrainedModel._device_mesh`), its `"tp"`
    dimension when it has several.
    """
    size = getattr(model, "tp_size", None)
    if not size or size <= 1:
        return None
    import torch.distributed as dist

    mesh = getattr(model, "_device_mesh", None)
    if mesh is None:
        return dist.group.WORLD
    return mesh.get_group("tp") if mesh.ndim > 1 else mesh.get_group()
