"""One forward pass of a step: how a decoder-only or an encoder-decoder model takes the step's inputs."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from transformers import Cache, EncoderDecoderCache

from .cache_commit import keep_cache_rows
from .step_layout import StepInputs

if TYPE_CHECKING:
    from transformers import CompileConfig, PreTrainedModel


def cache_argument(model: PreTrainedModel) -> str:
    """The name under which `model.forward` takes the KV cache (`cache` in recent 5.x, `past_key_values` before)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def max_positions(model: PreTrainedModel) -> int | None:
    """How many positions the decoder embeds (models with learned absolute positions fail past it), if it says."""
    config = model.config.get_text_config(decoder=True)
    return getattr(config, "max_position_embeddings", None) or getattr(config, "max_target_positions", None)


def self_attention_cache(cache: Cache) -> Cache:
    """The part of `cache` a step writes and rolls back: the decoder's self-attention cache."""
    return cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache


class StepForward:
    """
    Runs the model on a `StepInputs`: as `input_ids`, `position_ids`, `attention_mask`, or for encoder-decoder models
    (Whisper) as their `decoder_*` with the call's encoder outputs and padding mask, which follow the batch (`select`).

    Args:
        model (`PreTrainedModel`): the model.
        cache (`Cache`): the cache the model reads and writes (an `EncoderDecoderCache` for encoder-decoder models).
        encoder_outputs (`ModelOutput`, *optional*): the encoder's outputs, for encoder-decoder models.
        encoder_attention_mask (`torch.Tensor`, *optional*): the encoder's padding mask, if any.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        cache: Cache,
        encoder_outputs: Any = None,
        encoder_attention_mask: torch.Tensor | None = None,
    ):
        self.model = model
        self.cache = cache
        self.decoder_cache = self_attention_cache(cache)
        self.call = model.__call__
        self.is_encoder_decoder = model.config.is_encoder_decoder
        if self.is_encoder_decoder and encoder_outputs is None:
            raise ValueError(f"{type(model).__name__} is an encoder-decoder model: pass the `encoder_outputs`.")
        self.encoder_outputs = encoder_outputs
        self.encoder_attention_mask = encoder_attention_mask
        self.cache_argument = cache_argument(model)
        self.slices_logits = "logits_to_keep" in inspect.signature(model.forward).parameters

    def compile(self, compile_config: CompileConfig | None) -> None:
        """Runs the steps through the model's compiled forward (`PreTrainedModel.get_compiled_call`)."""
        self.call = self.model.get_compiled_call(compile_config)

    def select(self, indices: torch.Tensor) -> None:
        """Keeps the given batch rows of the cache and the encoder inputs, in that order."""
        if isinstance(self.cache, EncoderDecoderCache):
            self.cache.batch_select_indices(indices)
        else:
            keep_cache_rows(self.cache, indices)
        if self.is_encoder_decoder:
            self.encoder_outputs = select_rows(self.encoder_outputs, indices)
            if self.encoder_attention_mask is not None:
                self.encoder_attention_mask = self.encoder_attention_mask[indices]

    def __call__(self, step: StepInputs) -> torch.Tensor:
        """Runs the step's forward pass; returns the logits of `step.logits_rows`, shape `(batch, rows, vocab)`."""
        kwargs = {self.cache_argument: self.cache, "use_cache": True, "return_dict": True}
        if self.is_encoder_decoder:
            kwargs.update(
                decoder_input_ids=step.input_ids,
                decoder_position_ids=step.position_ids,
                decoder_attention_mask=step.attention_mask,
                encoder_outputs=self.encoder_outputs,
                attention_mask=self.encoder_attention_mask,
            )
        else:
            kwargs.update(input_ids=step.input_ids, attention_mask=step.attention_mask)
            if step.position_ids is not None:
                kwargs["position_ids"] = step.position_ids
        return logits_at(self.call, kwargs, step.logits_rows, self.slices_logits)


def logits_at(call: Callable[..., Any], inputs: dict[str, Any], rows: Any, slices: bool) -> torch.Tensor:
    """The logits at positions `rows`, `(batch, rows, vocab)`: computed only there where the model `slices`."""
    if slices:
        return call(**{**inputs, "logits_to_keep": rows}).logits
    return call(**inputs).logits[:, rows]


def select_rows(encoder_outputs: Any, indices: torch.Tensor) -> Any:
    """The batch rows `indices`, in that order, of encoder outputs (a `ModelOutput` or a tuple of tensors)."""

    def select(value: Any) -> Any:
        return value[indices] if isinstance(value, torch.Tensor) else value

    if isinstance(encoder_outputs, tuple):
        return tuple(select(value) for value in encoder_outputs)
    return encoder_outputs.__class__(**{key: select(value) for key, value in encoder_outputs.items()})
