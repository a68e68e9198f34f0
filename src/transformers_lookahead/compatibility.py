"""
The private Transformers APIs lookahead decoding relies on, in one place (upstream would call them directly); a
release that moves one breaks here, and `tests/test_compatibility.py` says which.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from transformers import (
    GenerationConfig,
    PrefixConstrainedLogitsProcessor,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.cache_utils import (
    CacheLayerMixin,
    DummyLayer,
    DynamicIndexedLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
    StaticLayer,
    StaticSlidingWindowLayer,
)

if TYPE_CHECKING:
    from transformers.modeling_outputs import ModelOutput

# The releases tested, read by `setup.py` and every `custom_generate/requirements.txt`: 5.24 crops static layers;
# a major release may move the private APIs below.
TRANSFORMERS_REQUIREMENT = (">=5.24", "<6")
TORCH_REQUIREMENT = (">=2.4",)

# Layers whose `crop` puts them back as they were before a step.
ROLLBACK_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer, StaticLayer, StaticSlidingWindowLayer)
# Layers a chain step (entries kept in place) rolls back by their own `crop`, though entry moves could not move them.
CHAIN_ROLLBACK_LAYERS = (DynamicIndexedLayer,)
# Layers holding running states (`RecurrentStates` keeps them); the hybrids also hold a dynamic attention part.
RECURRENT_LAYERS = (
    LinearAttentionLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
)


def prefill(
    model: PreTrainedModel, input_ids: torch.LongTensor, generation_config: GenerationConfig, model_kwargs: dict
) -> ModelOutput:
    """Runs the prompt through the model as `generate`'s own loops do (`GenerationMixin._prefill`)."""
    return model._prefill(input_ids, generation_config, model_kwargs)


def can_auto_compile(model: PreTrainedModel, model_kwargs: dict, generation_config: GenerationConfig) -> bool:
    """Whether plain `generate` would compile its forward (`_valid_auto_compile_criteria`)."""
    return bool(model._valid_auto_compile_criteria(model_kwargs, generation_config))


def pad_token_id(generation_config: GenerationConfig) -> int | None:
    """The padding id `generate` resolved (`_pad_token_tensor`)."""
    pad = generation_config._pad_token_tensor
    return None if pad is None else int(pad)


def attention_implementation(model: PreTrainedModel | PretrainedConfig) -> str | None:
    """The attention backend a model or a config names (`_attn_implementation`)."""
    config = model if isinstance(model, PretrainedConfig) else model.config
    return config._attn_implementation


def layer_step_start(layer: CacheLayerMixin, step_length: int) -> int:
    """Where a step of `step_length` tokens begins in the layer's tensors (not for `length_on_device` layers)."""
    if isinstance(layer, StaticLayer):
        # Static buffers: the step was written right after the tokens already held.
        return layer.get_seq_length() - step_length
    return layer.keys.shape[-2] - step_length


def is_shared_layer(layer: Any) -> bool:
    """Whether the layer reads another layer's keys and values (`DummyLayer`)."""
    return isinstance(layer, DummyLayer)


def recurrent_state_tensors(layer: LinearAttentionCacheLayerMixin) -> dict[str, Any]:
    """A recurrent layer's running state: convolution and recurrent states, and what it has seen (5.25 counts)."""
    state = {
        "conv_states": dict(layer.conv_states),
        "recurrent_states": dict(layer.recurrent_states),
        "has_previous_state": dict(layer.has_previous_state),
    }
    if hasattr(layer, "cumulative_length_linear"):
        state["cumulative_length_linear"] = layer.cumulative_length_linear
    return state


def forget_recorded_past(layer: LinearAttentionCacheLayerMixin) -> None:
    """Trims a recording recurrent layer's growing convolution states and state history back to one step's."""
    if not layer.record_past:
        return
    for index, conv in layer.conv_states.items():
        if conv is not None and layer.conv_kernel_size[index] is not None:
            layer.conv_states[index] = conv[..., -layer.conv_kernel_size[index] :]
    if hasattr(layer, "recurrent_states_history"):
        layer.recurrent_states_history = {index: [] for index in range(layer.number_of_states)}


def crop_attention_part(layer: CacheLayerMixin, tokens_to_remove: int) -> None:
    """`crop` of a recurrent hybrid layer's attention part alone."""
    part = DynamicSlidingWindowLayer if isinstance(layer, DynamicSlidingWindowLayer) else DynamicLayer
    part.crop(layer, tokens_to_remove)


def length_on_device(layer: CacheLayerMixin) -> bool:
    """Whether `get_seq_length()` is a device tensor (full static layers): reading it waits for the device."""
    return type(layer) is StaticLayer


def can_roll_back(layer: CacheLayerMixin) -> bool:
    """
    Whether `crop` puts the layer back as it was: its class is one of `ROLLBACK_LAYERS` exactly (quantized layers
    subclass one), and a static sliding layer has not outgrown its window (`is_croppable`).
    """
    if type(layer) not in ROLLBACK_LAYERS:
        return False
    return not isinstance(layer, StaticSlidingWindowLayer) or bool(layer.is_croppable)


def prefix_function(processor: PrefixConstrainedLogitsProcessor) -> Callable[[int, torch.Tensor], list[int]]:
    """A prefix-constrained processor's `_prefix_allowed_tokens_fn`."""
    return processor._prefix_allowed_tokens_fn


def with_prefix_function(
    processor: PrefixConstrainedLogitsProcessor, function: Callable[[int, torch.Tensor], list[int]]
) -> PrefixConstrainedLogitsProcessor:
    """A copy of `processor` asking `function` instead."""
    processor = copy.copy(processor)
    processor._prefix_allowed_tokens_fn = function
    return processor


def mark_as_user_config(generation_config: GenerationConfig) -> None:
    """Flags a generation config as the user's (`_from_model_config`): else its custom fields are lost on loading."""
    generation_config._from_model_config = False


def is_from_model_config(generation_config: GenerationConfig) -> bool:
    """Whether the generation config is flagged as derived from the model config."""
    return bool(getattr(generation_config, "_from_model_config", False))


def tensor_parallel_group(model: PreTrainedModel) -> Any | None:
    """The process group of a tensor-parallel model's collectives (`_device_mesh`), `None` if it was not sharded."""
    size = model.tp_size
    if not size or size <= 1:
        return None
    import torch.distributed as dist

    mesh = model._device_mesh
    if mesh is None:
        return dist.group.WORLD
    return mesh.get_group("tp") if mesh.ndim > 1 else mesh.get_group()
