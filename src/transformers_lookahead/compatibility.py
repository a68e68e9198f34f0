"""
The private Transformers APIs lookahead decoding relies on, in one place.

Upstream, `generate` would call these internals directly. As a separate package it reaches them only through this
module, so that a Transformers release that renames or changes one of them breaks here, in one place, and
`tests/test_compatibility.py` says which one moved (CI runs it against the oldest and the newest Transformers
`setup.py` allows).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from transformers import (
    CompileConfig,
    EncoderNoRepeatNGramLogitsProcessor,
    EncoderRepetitionPenaltyLogitsProcessor,
    GenerationConfig,
    GenerationMixin,
    LogitsProcessorList,
    PrefixConstrainedLogitsProcessor,
    PretrainedConfig,
    PreTrainedModel,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteriaList,
    SynthIDTextWatermarkLogitsProcessor,
)
from transformers.cache_utils import (
    CacheLayerMixin,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    StaticLayer,
    StaticSlidingWindowLayer,
)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

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


def length_on_device(layer: CacheLayerMixin) -> bool:
    """
    Whether the layer's `get_seq_length()` is a tensor on its device (full-attention static layers keep their length
    there for compiled steps): reading it waits for the device, so a decoding loop tracks it on the host instead.
    """
    return type(layer) is StaticLayer


class EntryMoves:
    """
    The copies a cache commit makes in every layer: in row b, the entry `start + index[b][j]` goes to `start + j`.
    Built once per step and applied to each layer (`apply`), so that the index tensors are built once per step
    rather than once per layer (0.6 -> 0.3 ms per step over SmolLM2's 30 layers, bf16, measured).

    One row moves by `index_select` and `index_copy_` (about a third of a gather's time, CPU, measured), several
    rows by one `gather` per tensor.

    Args:
        index (`list[list[int]]`): per row, the offsets from `start` of its entries, in their new order.
    """

    def __init__(self, index: list[list[int]]):
        self.index = index
        self.width = len(index[0])
        # Per layer start and device (one row) or per layer shape (several rows): the index tensors placed there.
        self._placed: dict[tuple, tuple[torch.LongTensor, ...]] = {}

    def apply(self, layer: CacheLayerMixin, start: int) -> None:
        """Makes the moves in the layer's `keys` and `values` (batch, heads, positions, head_dim), in place."""
        device = layer.keys.device
        if len(self.index) == 1:
            key = (start, device)
            if key not in self._placed:
                source = torch.tensor(self.index[0], device=device) + start
                self._placed[key] = (source, torch.arange(start, start + self.width, device=device))
            source, target = self._placed[key]
            layer.keys.index_copy_(2, target, layer.keys.index_select(2, source))
            layer.values.index_copy_(2, target, layer.values.index_select(2, source))
            return
        shape = (*layer.keys.shape[:2], self.width, layer.keys.shape[-1])
        if shape not in self._placed:
            self._placed[shape] = (torch.tensor(self.index, device=device)[:, None, :, None].expand(shape),)
        (source,) = self._placed[shape]
        keys = torch.gather(layer.keys[:, :, start:], 2, source)
        values = torch.gather(layer.values[:, :, start:], 2, source)
        layer.keys[:, :, start : start + self.width] = keys
        layer.values[:, :, start : start + self.width] = values


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
    The processors `generate` built for the whole batch, as they apply to one row called on that row alone (a
    lookahead step verifies every row on its own, one accepted token at a time).

    Most processors treat the rows of a batch alike (`tests/test_logits_processors.py` checks every one a
    `GenerationConfig` builds). These hold per-row data or state and get a copy for the row:
    - `PrefixConstrainedLogitsProcessor`: the user's `prefix_allowed_tokens_fn` gets the row's index in the batch
      (`_prefix_allowed_tokens_fn`);
    - `RepetitionPenaltyLogitsProcessor` with one `prompt_ignore_length` per row;
    - `EncoderRepetitionPenaltyLogitsProcessor` and `EncoderNoRepeatNGramLogitsProcessor`: the row's encoder inputs
      (`encoder_input_ids`; `generated_ngrams` and `batch_size`), rows of one input being consecutive, as with
      `num_return_sequences`;
    - `SynthIDTextWatermarkLogitsProcessor`: a state of its own (`state`), which the processor creates for the batch
      it first sees and extends at every call.

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


class TokenStoppingCriteria:
    """
    `generate`'s default stopping criteria (`MaxLengthCriteria`, `EosTokenCriteria`), decided on the host from a
    sequence's length and its last token. Lookahead checks the criteria after every accepted token; calling the
    criteria list builds tensors each time (about 70 us per token here, against about 3 us for these comparisons,
    SmolLM2 bf16, measured), which a step accepting many tokens pays many times.

    Args:
        max_length (`int` or `None`): `MaxLengthCriteria.max_length`.
        eos_token_ids (`set[int]`): `EosTokenCriteria.eos_token_id`'s tokens.
        max_position_embeddings (`int` or `None`): past this length `MaxLengthCriteria` logs a warning, so the
            criteria themselves decide there.
    """

    def __init__(self, max_length: int | None, eos_token_ids: set[int], max_position_embeddings: int | None):
        self.max_length = max_length
        self.eos_token_ids = eos_token_ids
        self.max_position_embeddings = max_position_embeddings

    @classmethod
    def of(cls, criteria: StoppingCriteriaList) -> TokenStoppingCriteria | None:
        """The host form of `criteria`, or `None` unless each criterion is exactly one of the two default classes."""
        if any(type(criterion) not in (MaxLengthCriteria, EosTokenCriteria) for criterion in criteria):
            return None
        max_length = max_position_embeddings = None
        eos_token_ids: set[int] = set()
        for criterion in criteria:
            if isinstance(criterion, MaxLengthCriteria):
                max_length = criterion.max_length if max_length is None else min(max_length, criterion.max_length)
                if criterion.max_position_embeddings is not None:
                    max_position_embeddings = criterion.max_position_embeddings
            else:
                eos_token_ids.update(torch.as_tensor(criterion.eos_token_id).reshape(-1).tolist())
        return cls(max_length, eos_token_ids, max_position_embeddings)

    def __call__(self, length: int, token: int) -> bool | None:
        """
        Whether the criteria fire on a sequence of `length` tokens (padding included) that ends with `token`, or
        `None` where the criteria list must be asked instead.
        """
        if self.max_position_embeddings is not None and length > self.max_position_embeddings:
            return None
        return token in self.eos_token_ids or (self.max_length is not None and length >= self.max_length)


def mark_as_user_config(generation_config: GenerationConfig) -> None:
    """
    Flags a generation config as the user's (`GenerationConfig._from_model_config = False`): configs flagged as
    derived from the model config lose their custom fields, the `lookahead_*` ones among them, when loaded again.
    """
    generation_config._from_model_config = False


def is_from_model_config(generation_config: GenerationConfig) -> bool:
    """Whether the generation config is flagged as derived from the model config (see `mark_as_user_config`)."""
    return bool(getattr(generation_config, "_from_model_config", False))


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
        "`PrefixConstrainedLogitsProcessor._prefix_allowed_tokens_fn` (used by `processors_for_row`)",
    )
    encoder_ids = torch.tensor([[3, 4, 5], [6, 7, 8]])
    expect(
        hasattr(RepetitionPenaltyLogitsProcessor(1.5), "prompt_ignore_length")
        and torch.equal(
            getattr(EncoderRepetitionPenaltyLogitsProcessor(1.5, encoder_ids), "encoder_input_ids", None), encoder_ids
        ),
        "`RepetitionPenaltyLogitsProcessor.prompt_ignore_length`, `EncoderRepetitionPenaltyLogitsProcessor."
        "encoder_input_ids` (used by `processors_for_row`)",
    )
    ngrams = EncoderNoRepeatNGramLogitsProcessor(2, encoder_ids)
    expect(
        getattr(ngrams, "batch_size", None) == 2 and len(getattr(ngrams, "generated_ngrams", ())) == 2,
        "`EncoderNoRepeatNGramLogitsProcessor.batch_size` and `generated_ngrams`, one per input row (used by "
        "`processors_for_row`)",
    )
    length_criterion, eos_criterion = MaxLengthCriteria(5, max_position_embeddings=7), EosTokenCriteria([2, 3])
    expect(
        (length_criterion.max_length, length_criterion.max_position_embeddings) == (5, 7)
        and torch.as_tensor(eos_criterion.eos_token_id).tolist() == [2, 3],
        "`MaxLengthCriteria.max_length` / `.max_position_embeddings` and `EosTokenCriteria.eos_token_id` (used by "
        "`TokenStoppingCriteria`)",
    )
    watermark = SynthIDTextWatermarkLogitsProcessor(
        ngram_len=2, keys=[1, 2], sampling_table_size=16, sampling_table_seed=0, context_history_size=4, device="cpu"
    )
    expect(
        "state" in vars(watermark) and watermark.state is None,
        "`SynthIDTextWatermarkLogitsProcessor.state`, created at the first call (used by `processors_for_row`)",
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
    expect(
        hasattr(StaticSlidingWindowLayer, "is_croppable"),
        "`StaticSlidingWindowLayer.is_croppable` (used by `can_roll_back`)",
    )
    layer = DynamicLayer()
    layer.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    expect(
        getattr(getattr(layer, "keys", None), "shape", None) == (1, 2, 3, 4)
        and getattr(getattr(layer, "values", None), "shape", None) == (1, 2, 3, 4),
        "cache layers' `keys` / `values` tensors of shape (batch, heads, positions, head_dim) (written in place by "
        "`EntryMoves`)",
    )
    expect(
        hasattr(CompileConfig(), "_compile_all_devices"),
        "`CompileConfig._compile_all_devices` (used by `compile_config`)",
    )
    expect(
        callable(getattr(PreTrainedModel, "_from_config", None)),
        "`PreTrainedModel._from_config` (used by `model_from_config`)",
    )
    expect(
        "_device_mesh" in dir(PreTrainedModel) and "tp_size" in dir(PreTrainedModel),
        "`PreTrainedModel._device_mesh` and `tp_size` (used by `tensor_parallel_group`)",
    )
    return problems


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
