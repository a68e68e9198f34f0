"""
The private Transformers APIs lookahead decoding relies on, in one place: upstream, `generate` and the
continuous-batching engine would call them directly. A release that changes one breaks here, and
`tests/test_compatibility.py` says which one moved.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from transformers import (
    CompileConfig,
    EncoderNoRepeatNGramLogitsProcessor,
    EncoderRepetitionPenaltyLogitsProcessor,
    GenerationConfig,
    LogitsProcessorList,
    PrefixConstrainedLogitsProcessor,
    PretrainedConfig,
    PreTrainedModel,
    RepetitionPenaltyLogitsProcessor,
    SynthIDTextWatermarkLogitsProcessor,
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
from transformers.generation.continuous_batching.continuous_api import (
    ContinuousBatchingManager,
    ContinuousBatchProcessor,
)
from transformers.generation.continuous_batching.model_runner import ModelRunner
from transformers.generation.continuous_batching.requests import RequestState

if TYPE_CHECKING:
    from transformers.modeling_outputs import ModelOutput

# The Transformers and torch releases the package is tested with, one bound each: `setup.py` reads them, and so does
# the `requirements.txt` of every `custom_generate/` folder (Transformers checks that file before running the code).
# 5.24: static cache layers can be cropped, which rolling a static cache back after a step needs.
# <6: tested on 5.24 and 5.25 (whose rebuilt `transformers serve` still calls the model's `generate`); a major release
# may move the private APIs below.
TRANSFORMERS_REQUIREMENT = (">=5.24", "<6")
TORCH_REQUIREMENT = (">=2.4",)

# Transformers' per-request warpers (`per_request_processors=True`, as `transformers serve --continuous-batching`
# sets), and the request setting each reads.
PER_REQUEST_WARPERS = {
    "ContinuousBatchingTemperatureLogitsWarper": "temperature",
    "ContinuousBatchingTopKLogitsWarper": "top_k",
    "ContinuousBatchingTopPLogitsWarper": "top_p",
}

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


# The name `grouped_attention` registers its sdpa under: Transformers' sdpa, computed without copies of grouped
# key/value heads, which the package reads as "sdpa".
GROUPED_SDPA = "lookahead_grouped_sdpa"


def attention_implementation(model: PreTrainedModel | PretrainedConfig) -> str | None:
    """The attention backend a model (its config) or a (sub-)config names (`PretrainedConfig._attn_implementation`)."""
    config = model if isinstance(model, PretrainedConfig) else model.config
    name = config._attn_implementation
    return "sdpa" if name == GROUPED_SDPA else name


@contextmanager
def grouped_sdpa_for(config: PretrainedConfig) -> Iterator[None]:
    """
    Runs the block with `config` naming `GROUPED_SDPA` instead of `"sdpa"`, only `config` itself (the setter of
    `_attn_implementation` would also overwrite every sub-config's own). `"sdpa"` is put back whatever the config
    named when the block began: a pass of another thread on the same model may have named `GROUPED_SDPA` already,
    and the model must not keep it. Passes of such a thread run either function, whose outputs are identical.
    """
    config._attn_implementation_internal = GROUPED_SDPA
    try:
        yield
    finally:
        config._attn_implementation_internal = "sdpa"


def set_attention_implementation_unchecked(model: PreTrainedModel, name: str) -> None:
    """
    Sets the backend the model reports (`PretrainedConfig._attn_implementation`) without loading its kernels, as a
    test does to see that a backend lookahead cannot use (flash attention) is refused.
    """
    model.config._attn_implementation = name


def model_from_config(cls: type[PreTrainedModel], config: PretrainedConfig, attn_implementation: str | None) -> Any:
    """A randomly initialised model of `cls` (`PreTrainedModel._from_config`), as the tests and checks build them."""
    return cls._from_config(config, attn_implementation=attn_implementation)


def compile_config(**kwargs: Any) -> CompileConfig:
    """
    A `CompileConfig` that also compiles on a CPU (`CompileConfig._compile_all_devices`): plain `generate` compiles
    its forward pass only on accelerators unless this is set.
    """
    config = CompileConfig(**kwargs)
    config._compile_all_devices = True
    return config


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


def processors_for_row(logits_processor: LogitsProcessorList, row: int, rows: int) -> LogitsProcessorList:
    """
    The processors `generate` built for the whole batch, as they apply to one row called alone (a step verifies
    every row on its own). Those holding per-row data or state get a copy for the row: the prefix function gets the
    row's index, a per-row `prompt_ignore_length` and the encoder processors' inputs are cut to the row's (rows of
    one input consecutive, as with `num_return_sequences`), and the SynthID watermark starts its own state.

    Args:
        logits_processor (`LogitsProcessorList`): the processors of the call.
        row (`int`): the row.
        rows (`int`): the rows of the batch (inputs x `num_return_sequences`).
    """
    adapted = LogitsProcessorList()
    for processor in logits_processor:
        if isinstance(processor, PrefixConstrainedLogitsProcessor):
            allowed = processor._prefix_allowed_tokens_fn
            processor = copy.copy(processor)
            processor._prefix_allowed_tokens_fn = lambda _, ids, allowed=allowed: allowed(row, ids)
        elif isinstance(processor, RepetitionPenaltyLogitsProcessor) and isinstance(
            processor.prompt_ignore_length, torch.Tensor
        ):
            processor = copy.copy(processor)
            processor.prompt_ignore_length = processor.prompt_ignore_length[row : row + 1]
        elif isinstance(processor, EncoderRepetitionPenaltyLogitsProcessor):
            source = row // max(rows // processor.encoder_input_ids.shape[0], 1)
            processor = copy.copy(processor)
            processor.encoder_input_ids = processor.encoder_input_ids[source : source + 1]
        elif isinstance(processor, EncoderNoRepeatNGramLogitsProcessor):
            source = row // max(rows // processor.batch_size, 1)
            processor = copy.copy(processor)
            processor.generated_ngrams = processor.generated_ngrams[source : source + 1]
            processor.batch_size = 1
        elif isinstance(processor, SynthIDTextWatermarkLogitsProcessor):
            processor = copy.copy(processor)
            processor.state = None
        adapted.append(processor)
    return adapted


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


# Transformers' continuous-batching engine (`transformers.generation.continuous_batching`): the lookahead engine
# subclasses its processor and manager, and reaches into its paged cache.


class BatchProcessorHooks(ContinuousBatchProcessor):
    """
    Transformers' `ContinuousBatchProcessor`, whose forward step (`_generation_step`) a subclass replaces by
    overriding `forward_step`.
    """

    def _generation_step(self, model: torch.nn.Module) -> None:
        self.forward_step(model)

    def forward_step(self, model: torch.nn.Module) -> None:
        """Runs the batch through `model` (Transformers' own step unless overridden)."""
        super()._generation_step(model)


class ModelRunnerHooks(ModelRunner):
    """
    Transformers' continuous-batching `ModelRunner`, whose step function (`_forward_process_and_sample`: what the
    engine compiles with its `varlen_compile_config` and captures as a CUDA graph with `use_cuda_graph`) a subclass
    replaces by overriding `step_function`; `compute_batch` then runs it compiled, captured or plain as the engine
    was configured.
    """

    def _forward_process_and_sample(
        self,
        model: torch.nn.Module,
        batch_data: dict,
        carry_over_ids: torch.Tensor,
        prev_output_ids: torch.Tensor,
        output_ids: torch.Tensor,
    ) -> None:
        self.step_function(model, batch_data)

    def step_function(self, model: torch.nn.Module, batch_data: dict) -> None:
        """One forward pass over `batch_data` (Transformers' forward, processing and sampling unless overridden)."""
        super()._forward_process_and_sample(model, batch_data, *self.inputs_and_outputs.get_cb_kwargs())

    def compile_step_function(self) -> None:
        """Compiles `step_function` as Transformers compiled its own in `__init__` (bound before the subclass)."""
        if self.cb_config.varlen_compile_config is not None:
            self._compiled_varlen = torch.compile(
                self._forward_process_and_sample, **self.cb_config.varlen_compile_config.to_dict()
            )
        if self.cb_config.decode_compile_config is not None:
            self._compiled_decode = torch.compile(
                self._forward_process_and_sample, **self.cb_config.decode_compile_config.to_dict()
            )


class ManagerHooks(ContinuousBatchingManager):
    """
    Transformers' `ContinuousBatchingManager`, whose batch processor (`_create_batch_processor`) a subclass takes
    over by overriding `adopt_processor`.
    """

    def _create_batch_processor(self) -> ContinuousBatchProcessor:
        return self.adopt_processor(super()._create_batch_processor())

    def adopt_processor(self, processor: ContinuousBatchProcessor) -> ContinuousBatchProcessor:
        """The processor the engine runs, given the one Transformers built (that one unless overridden)."""
        return processor


def become(instance: Any, cls: type) -> Any:
    """
    Makes `instance`, built by Transformers, an instance of its subclass `cls`, which adds no state of its own to
    what `__init__` set. Transformers builds the engine's manager and processor each in one method, with a dozen
    collaborators; taking those objects over keeps every one of them as Transformers made it.
    """
    base = next(klass for klass in cls.__mro__ if klass.__module__.startswith("transformers."))
    if not isinstance(instance, base):
        raise TypeError(f"{cls.__name__} extends {base.__name__}, not {type(instance).__name__}.")
    instance.__class__ = cls
    return instance


def kept_continuous_batching_manager(model: PreTrainedModel) -> Any | None:
    """The manager a `persistent_manager=True` session left on the model (`_cached_continuous_batching_manager`)."""
    return getattr(model, "_cached_continuous_batching_manager", None)


def move_accepted_entries(cache: Any, moves: list[tuple[str, int, int, int, list[int]]]) -> None:
    """
    Copies each request's accepted tree entries to the positions right after its pending token, in every layer.

    Args:
        cache (`PagedAttentionCache`): the engine's cache.
        moves (`list[tuple]`): per request: its id, its pending token's position, its step length, the index in its
            step of the first tree node, and the accepted nodes (top down).
    """
    for allocator in cache.cache_allocators.values():
        source, target = [], []
        for request_id, past, length, tree_start, nodes in moves:
            slots = allocator.get_write_indices(request_id, past, length)
            for depth, node in enumerate(nodes, start=1):
                if tree_start + node != depth:
                    source.append(slots[tree_start + node])
                    target.append(slots[depth])
        if not source:
            continue
        device = allocator.cache_tensor.device
        source_index = torch.tensor(source, dtype=torch.long, device=device)
        target_index = torch.tensor(target, dtype=torch.long, device=device)
        for layer_idx in allocator.layer_indices:
            for view in allocator._kv_token_views[layer_idx]:
                view.index_copy_(0, target_index, view.index_select(0, source_index))


def release_pages_past(cache: Any, request_id: str, length: int) -> None:
    """Gives back a request's pages past its first `length` positions (a step allocated pages for all its tokens)."""
    for allocator in cache.cache_allocators.values():
        table = allocator.block_table.get(request_id)
        keep = -(-length // allocator.tokens_per_page)
        if table is None or len(table) <= keep:
            continue
        spare = table[keep:]
        del table[keep:]
        cache.pool.free_blocks(allocator.index, [block for block in spare if allocator.ledger.release(block, True)])


def mark_kept_blocks(cache: Any, state: RequestState, past: int) -> None:
    """Registers for prefix sharing the pages a step completed with accepted entries only (not the whole step's)."""
    kept_length = state.position_offset
    complete = {}
    for name, allocator in cache.cache_allocators.items():
        page = allocator.tokens_per_page
        count = kept_length // page - past // page
        if count > 0:
            complete[name] = count
    if complete:
        cache.mark_complete_blocks(state, complete)
