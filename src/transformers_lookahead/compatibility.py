"""
The private Transformers APIs lookahead decoding relies on, in one place: upstream, `generate` and the
continuous-batching engine would call them directly. A release that changes one breaks here, and
`tests/test_compatibility.py` says which one moved.
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

# The Transformers and torch releases the package is tested with, one bound each: `setup.py` reads them, and so does
# the `requirements.txt` of every `custom_generate/` folder (Transformers checks that file before running the code).
# 5.24: static cache layers can be cropped, which rolling a static cache back after a step needs.
# <6: tested on 5.24 and 5.25 (whose rebuilt `transformers serve` still calls the model's `generate`); a major release
# may move the private APIs below.
TRANSFORMERS_REQUIREMENT = (">=5.24", "<6")
TORCH_REQUIREMENT = (">=2.4",)

# Cache layer classes whose `crop` puts them back as they were before a step (see `CacheCommitter`).
ROLLBACK_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer, StaticLayer, StaticSlidingWindowLayer)
# Layers that a chain step's commit, which keeps the step's entries in place, rolls back through their own `crop` (an
# indexed layer crops its indexer's keys with its own), though a full step's entry moves could not move them.
CHAIN_ROLLBACK_LAYERS = (DynamicIndexedLayer,)
# Layers holding running (linear-attention, state-space, convolution) states, which `RecurrentStates` keeps before a
# step and puts back; the hybrid ones also hold keys and values in a dynamic attention part.
RECURRENT_LAYERS = (
    LinearAttentionLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
)


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


def attention_implementation(model: PreTrainedModel | PretrainedConfig) -> str | None:
    """The attention backend a model (its config) or a (sub-)config names (`PretrainedConfig._attn_implementation`)."""
    config = model if isinstance(model, PretrainedConfig) else model.config
    return config._attn_implementation


def layer_step_start(layer: CacheLayerMixin, step_length: int) -> int:
    """
    Where a step of `step_length` tokens begins in the layer's tensors (`keys`, `values`) after its forward. Not for
    layers whose length is a device tensor (`length_on_device`): their caller knows it on the host.
    """
    if isinstance(layer, StaticLayer):
        # Static buffers: the step was written right after the tokens already held.
        return layer.get_seq_length() - step_length
    return layer.keys.shape[-2] - step_length


def is_shared_layer(layer: Any) -> bool:
    """Whether the layer holds nothing of its own: it reads another layer's keys and values (`DummyLayer`)."""
    return isinstance(layer, DummyLayer)


def recurrent_state_tensors(layer: LinearAttentionCacheLayerMixin) -> dict[str, Any]:
    """
    What a recurrent layer's running state is made of: its convolution and recurrent states, whether it has seen a
    token, and the count of tokens it has seen (5.25; 5.24 keeps none).
    """
    state = {
        "conv_states": dict(layer.conv_states),
        "recurrent_states": dict(layer.recurrent_states),
        "has_previous_state": dict(layer.has_previous_state),
    }
    if hasattr(layer, "cumulative_length_linear"):
        state["cumulative_length_linear"] = layer.cumulative_length_linear
    return state


def forget_recorded_past(layer: LinearAttentionCacheLayerMixin) -> None:
    """
    A recurrent layer recording its past (a hybrid sliding layer records for its window's sake) keeps growing
    convolution states and a history of recurrent states until a `crop`: back to what one step needs.
    """
    if not layer.record_past:
        return
    for index, conv in layer.conv_states.items():
        if conv is not None and layer.conv_kernel_size[index] is not None:
            layer.conv_states[index] = conv[..., -layer.conv_kernel_size[index] :]
    if hasattr(layer, "recurrent_states_history"):
        layer.recurrent_states_history = {index: [] for index in range(layer.number_of_states)}


def crop_attention_part(layer: CacheLayerMixin, tokens_to_remove: int) -> None:
    """`crop` of a recurrent hybrid layer's attention part alone (`RecurrentStates` puts its recurrent part back)."""
    part = DynamicSlidingWindowLayer if isinstance(layer, DynamicSlidingWindowLayer) else DynamicLayer
    part.crop(layer, tokens_to_remove)


def length_on_device(layer: CacheLayerMixin) -> bool:
    """
    Whether the layer's `get_seq_length()` is a tensor on its device (full-attention static layers keep their length
    there for compiled steps): reading it waits for the device, so a decoding loop tracks it on the host instead.
    """
    return type(layer) is StaticLayer


def can_roll_back(layer: CacheLayerMixin) -> bool:
    """
    Whether `crop` puts the layer back as it was before a step: its class is one of `ROLLBACK_LAYERS` exactly
    (quantized layers, for one, subclass `DynamicLayer` but re-quantize), and a static sliding layer has not yet
    outgrown its window (`StaticSlidingWindowLayer.is_croppable`).
    """
    if type(layer) not in ROLLBACK_LAYERS:
        return False
    return not isinstance(layer, StaticSlidingWindowLayer) or bool(layer.is_croppable)


def prefix_function(processor: PrefixConstrainedLogitsProcessor) -> Callable[[int, torch.Tensor], list[int]]:
    """The function a prefix-constrained processor asks for a row's allowed tokens (`_prefix_allowed_tokens_fn`)."""
    return processor._prefix_allowed_tokens_fn


def with_prefix_function(
    processor: PrefixConstrainedLogitsProcessor, function: Callable[[int, torch.Tensor], list[int]]
) -> PrefixConstrainedLogitsProcessor:
    """A copy of `processor` that asks `function` instead (see `prefix_function`)."""
    processor = copy.copy(processor)
    processor._prefix_allowed_tokens_fn = function
    return processor


def mark_as_user_config(generation_config: GenerationConfig) -> None:
    """
    Flags a generation config as the user's (`GenerationConfig._from_model_config = False`): configs flagged as
    derived from the model config lose their custom fields, the `lookahead_*` ones among them, when loaded again.
    """
    generation_config._from_model_config = False


def is_from_model_config(generation_config: GenerationConfig) -> bool:
    """Whether the generation config is flagged as derived from the model config (see `mark_as_user_config`)."""
    return bool(getattr(generation_config, "_from_model_config", False))


def tensor_parallel_group(model: PreTrainedModel) -> Any | None:
    """
    The process group a tensor-parallel model's collectives run in (from `tp_plan="auto"` or a `DistributedConfig`),
    or `None` for a model that was not sharded: the model's device mesh (`PreTrainedModel._device_mesh`), its `"tp"`
    dimension when it has several.
    """
    size = model.tp_size
    if not size or size <= 1:
        return None
    import torch.distributed as dist

    mesh = model._device_mesh
    if mesh is None:
        return dist.group.WORLD
    return mesh.get_group("tp") if mesh.ndim > 1 else mesh.get_group()
