"""
How `generate` reaches the lookahead loop: `generate_with_lookahead` hands `GenerationMixin.generate` the loop as a
`custom_generate` callable (`generate`), built by `fixed_shape_decoder` unless the caller passes another builder.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.stopping_criteria import StopStringCriteria

from .cache_commit import CacheCommitter, has_static_layers
from .compatibility import is_from_model_config
from .configuration_lookahead import (
    LOOKAHEAD_FIELDS,
    LookaheadConfig,
    check_cache_implementation,
    first_set,
    validate_lookahead_setup,
)
from .lookahead_decoding import LookaheadDecoder, LookaheadDecoderOnlyOutput, LookaheadEncoderDecoderOutput
from .sequence_lookahead import StepPlanner
from .step_forward import StepForward, self_attention_cache
from .verification import check_processors

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.generation.streamers import BaseStreamer

# Builds a call's loop: (model, config, logits_processor, stopping_criteria, generation_config, model_kwargs,
# batch_size) -> LookaheadDecoder.
DecoderBuilder = Callable[..., LookaheadDecoder]


def fixed_shape_decoder(
    model: PreTrainedModel,
    config: LookaheadConfig,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    model_kwargs: dict[str, Any],
    batch_size: int,
) -> LookaheadDecoder:
    """
    The paper's loop (every step holds the whole window and every pooled candidate), from what `generate` prepared
    (`model_kwargs`) for `batch_size` rows; `generation_mixin.lookahead_decoder` adds the rest.
    """
    if config.adaptive:
        raise ValueError(
            'lookahead_window="auto" prices each step with the model\'s measured costs, which the '
            "`transformers-lookahead` package adds (`pip install transformers-lookahead`, then "
            "`enable_lookahead(model)`); this entry point runs fixed shapes: set `lookahead_window` to an int >= 1."
        )
    forward = step_forward(model, model_kwargs)
    committer = CacheCommitter(forward.decoder_cache, config.cache_commit, type(model).__name__)
    planner = StepPlanner(model, config, bool(generation_config.do_sample), refeed=committer.strategy == "refeed")
    return LookaheadDecoder(
        model, config, planner, forward, committer, logits_processor, stopping_criteria, generation_config
    )


def step_forward(model: PreTrainedModel, model_kwargs: dict[str, Any]) -> StepForward:
    """How the model takes a step over the cache (and an encoder's outputs) `generate` prepared."""
    encoder = model_kwargs.get("encoder_outputs")
    encoder_mask = model_kwargs.get("attention_mask") if encoder is not None else None
    return StepForward(model, model_kwargs.get("cache"), encoder, encoder_mask)


def generate_with_lookahead(
    model: PreTrainedModel,
    inputs: torch.Tensor | None = None,
    generation_config: GenerationConfig | None = None,
    defaults: Mapping[str, Any] | None = None,
    build: DecoderBuilder | None = None,
    plain_generate: Callable[..., Any] | None = None,
    **kwargs: Any,
):
    """
    The model's `generate`, decoding with lookahead when a `lookahead_window` is set (`"off"` never does).

    Args:
        model (`PreTrainedModel`), inputs (`torch.Tensor`, *optional*), generation_config (`GenerationConfig`,
            *optional*), kwargs: as for `generate`, `lookahead_*` settings included.
        defaults (`Mapping`, *optional*): `lookahead_*` values for the fields nothing else sets.
        build (`DecoderBuilder`, *optional*): builds the loop; `fixed_shape_decoder` by default.
        plain_generate (`Callable`, *optional*): the `generate` preparing the inputs; the model class's by default.
    """
    # Read from the class, not the object: a model folder's `custom_generate/` replaces the object's `generate`.
    plain_generate = plain_generate or type(model).generate.__get__(model, type(model))
    overrides = {field: kwargs.pop(field) for field in LOOKAHEAD_FIELDS if field in kwargs}
    model_config = getattr(model, "generation_config", None)
    config = LookaheadConfig.from_sources(overrides, generation_config or {}, model_config or {}, defaults or {})
    # Inputs travel positionally only when given: pipelines pass them by the model's own name (`input_features`).
    inputs_argument = () if inputs is None else (inputs,)
    if config is None:
        return plain_generate(*inputs_argument, generation_config=generation_config, **kwargs)
    if kwargs.get("custom_generate") is not None:
        raise ValueError(
            "Lookahead decoding cannot be combined with `custom_generate`: both replace the decoding loop. "
            "Remove `custom_generate`, or the `lookahead_*` settings."
        )
    sources = (kwargs, generation_config, model_config)
    # `generate` builds the cache before handing over, and some caches fail there for reasons of their own.
    check_cache_implementation(first_set("cache_implementation", *sources))
    # A `use_cache=False` from the model's own config (MPT's), not the user's, is turned on as `generate` would.
    if first_set("use_cache", kwargs, generation_config) is None and is_from_model_config(model_config):
        if model_config.use_cache is False:
            kwargs["use_cache"] = True
    _reserve_static_cache_room(model, inputs, sources, kwargs, config.max_step_length())
    _bind_stop_strings(first_set("stop_strings", *sources), kwargs)
    # `generate` passes a `custom_generate` callable only what its own loops do not take: these travel bound.
    decoding = functools.partial(
        generate,
        lookahead_config=config,
        lookahead_build=build,
        lookahead_streamer=kwargs.pop("streamer", None),
        lookahead_assistant_model=kwargs.pop("assistant_model", None),
    )
    return plain_generate(*inputs_argument, generation_config=generation_config, custom_generate=decoding, **kwargs)


def _reserve_static_cache_room(
    model: PreTrainedModel, inputs: torch.Tensor | None, sources: tuple, kwargs: dict, room: int
) -> None:
    """Asks a static cache for `room` entries past `max_length - 1`: a step is written before it is rolled back."""
    if first_set("cache_implementation", *sources) != "static" or model.config.is_encoder_decoder:
        return
    max_new_tokens = first_set("max_new_tokens", *sources)
    if max_new_tokens is not None:
        input_ids = inputs if inputs is not None else kwargs.get("input_ids")
        if input_ids is None or input_ids.dim() != 2:
            return
        max_length = input_ids.shape[-1] + max_new_tokens
    else:
        max_length = first_set("max_length", *sources) or GenerationConfig().max_length
    kwargs["max_cache_len"] = max(first_set("max_cache_len", *sources) or 0, max_length - 1 + room)


def _bind_stop_strings(stop_strings: str | list[str] | None, kwargs: dict) -> None:
    """Builds the stop strings' criterion: `generate` drops a `custom_generate` callable's tokenizer, then refuses them."""
    tokenizer = kwargs.pop("tokenizer", None)
    if not stop_strings or tokenizer is None:
        if tokenizer is not None:
            kwargs["tokenizer"] = tokenizer
        return
    criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
    criteria.append(StopStringCriteria(stop_strings=stop_strings, tokenizer=tokenizer))
    kwargs["stopping_criteria"] = criteria
    kwargs["stop_strings"] = None


def generate(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    synced_gpus: bool = False,
    lookahead_window: int | str | None = None,
    lookahead_ngram: int | str | None = None,
    lookahead_guess: int | str | None = None,
    lookahead_pool_from_prompt: bool | None = None,
    lookahead_cache_commit: str | None = None,
    lookahead_memory: bool | None = None,
    lookahead_memory_size: int | None = None,
    lookahead_memory_namespace: str | None = None,
    lookahead_config: LookaheadConfig | None = None,
    lookahead_build: DecoderBuilder | None = None,
    lookahead_streamer: BaseStreamer | None = None,
    lookahead_assistant_model: PreTrainedModel | None = None,
    lookahead_default_window: int | str | None = None,
    **model_kwargs: Any,
) -> LookaheadDecoderOnlyOutput | LookaheadEncoderDecoderOutput | torch.LongTensor:
    r"""
    Generates with lookahead decoding, as a `custom_generate` callable `generate` calls after preparing the inputs:
    greedy output is plain greedy's, sampled output follows plain sampling's distribution.

    Args:
        model (`PreTrainedModel`): a model whose attention applies custom 4D masks.
        input_ids (`torch.LongTensor` of shape `(batch_size, prompt_length)`): the (decoder) prompts, left-padded.
        logits_processor (`LogitsProcessorList`), stopping_criteria (`StoppingCriteriaList`), generation_config
            (`GenerationConfig`), synced_gpus (`bool`): what `generate` prepared (`synced_gpus` must be False).
        lookahead_window, ..., lookahead_memory_namespace (*optional*): `LookaheadConfig`'s fields, named so that
            `generate` passes them; `lookahead_config`, already resolved, wins over them.
        lookahead_build (`DecoderBuilder`, *optional*): builds the loop; `fixed_shape_decoder` by default.
        lookahead_streamer (`BaseStreamer`, *optional*): receives the prompt, then every accepted chunk.
        lookahead_assistant_model (`PreTrainedModel`, *optional*): only checked, to refuse assisted decoding.
        lookahead_default_window (`int` or `"auto"`, *optional*): the window where nothing sets one.
        model_kwargs: what `generate` prepared for the model, the cache among them.

    Returns:
        `torch.LongTensor` (finished rows padded with `pad_token_id`), or `LookaheadDecoderOnlyOutput`
        (`LookaheadEncoderDecoderOutput`) with `return_dict_in_generate=True`.
    """
    config = lookahead_config
    if config is None:
        settings = (lookahead_window, lookahead_ngram, lookahead_guess, lookahead_pool_from_prompt)
        settings += (lookahead_cache_commit, lookahead_memory, lookahead_memory_size, lookahead_memory_namespace)
        arguments = dict(zip(LOOKAHEAD_FIELDS, settings, strict=True))
        config = LookaheadConfig.from_sources(arguments, generation_config, default_window=lookahead_default_window)
        if config is None:
            raise ValueError(
                "`custom_generate=transformers_lookahead.generate` is the lookahead decoding loop and needs a "
                '`lookahead_window` (an int >= 1 or "auto"); to decode without lookahead, remove `custom_generate`.'
            )
    validate_lookahead_setup(model, generation_config, model_kwargs, lookahead_assistant_model)
    if synced_gpus:
        raise ValueError("Lookahead decoding does not support `synced_gpus=True`.")
    check_processors(logits_processor, input_ids.shape[0])
    if input_ids.shape[0] > 1 and has_static_layers(self_attention_cache(model_kwargs["cache"])):
        raise ValueError(
            "Batched lookahead decoding leaves unused cache slots where rows accept fewer tokens, which a static "
            f"cache sized for plain decoding cannot hold; got a batch of {input_ids.shape[0]} rows (input rows x "
            "`num_return_sequences`) with a static cache. Use the default dynamic cache for batches, or one row "
            "per call."
        )
    if lookahead_streamer is not None and input_ids.shape[0] > 1:
        raise ValueError(
            f"Streaming supports one sequence; got a batch of {input_ids.shape[0]} rows (input rows x "
            "`num_return_sequences`). With lookahead the rows advance by different numbers of tokens per step, so "
            "there is no per-step token column to stream: generate the rows one at a time to stream them."
        )
    build = lookahead_build or fixed_shape_decoder
    decoder = build(
        model, config, logits_processor, stopping_criteria, generation_config, model_kwargs, len(input_ids)
    )
    return decoder.run(input_ids, model_kwargs, lookahead_streamer)
