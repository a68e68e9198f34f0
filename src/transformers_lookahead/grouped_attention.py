"""
The masked attention of a lookahead pass without copies of the key/value heads.

Transformers' sdpa integration repeats grouped key/value heads whenever a mask is passed, and a lookahead pass always
has one, so every layer copied its whole cache twice per pass. PyTorch's CPU sdpa takes `enable_gqa=True` with a mask
and computes bit-identical outputs. Registered through Transformers' public `AttentionInterface` under `"sdpa"`, in
front of the function registered there before, it changes only passes marked with `GROUPED_KV_FLAG` on devices in
`GROUPED_KV_DEVICES`; every other pass, of any model in the process, runs the wrapped function as it was.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .compatibility import attention_implementation

# The keyword a lookahead pass carries to its attention calls.
GROUPED_KV_FLAG = "lookahead_grouped_kv"
# Devices whose sdpa takes grouped key/value heads together with a mask, with outputs identical to repeated heads.
# CUDA's kernels fall back to the math path with a mask and grouped heads: whether that beats the copies is for a
# measurement on a GPU (`make gpu-check`) to say, so CUDA keeps the stock path.
GROUPED_KV_DEVICES = ("cpu",)
# Marks the wrapper, so that registering twice wraps once.
_WRAPPED = "_lookahead_wrapped"


def grouped_sdpa(wrapped: Callable[..., Any]) -> Callable[..., Any]:
    """
    An sdpa attention function that runs a marked, masked pass over grouped key/value heads with `enable_gqa=True`,
    and every other call through `wrapped` (Transformers' `sdpa_attention_forward`).
    """

    def attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        is_causal: bool | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        grouped = kwargs.pop(GROUPED_KV_FLAG, False)
        # One-token passes keep the stock path (it packs their heads without copies), so that a lookahead step of one
        # token computes exactly what plain decoding computes.
        if not (
            grouped
            and query.shape[2] > 1
            and attention_mask is not None
            and getattr(module, "num_key_value_groups", 1) > 1
            and query.device.type in GROUPED_KV_DEVICES
            and key.shape[-1] == value.shape[-1]
            and kwargs.get("position_bias") is None
            and kwargs.get("softcap") is None
        ):
            return wrapped(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        output = sdpa(query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True)
        return output.transpose(1, 2).contiguous(), None

    setattr(attention, _WRAPPED, wrapped)
    return attention


def register_grouped_attention() -> None:
    """Puts `grouped_sdpa` in front of the registered `"sdpa"` attention, once per process."""
    current = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if not hasattr(current, _WRAPPED):
        AttentionInterface.register("sdpa", grouped_sdpa(current))


def takes_grouped_kv(model: torch.nn.Module) -> bool:
    """
    Whether `model`'s lookahead passes should be marked for `grouped_sdpa`: sdpa attention over grouped key/value
    heads, on a device in `GROUPED_KV_DEVICES`, with a forward that passes extra keywords on to its attention.
    """
    config = model.config.get_text_config(decoder=True)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return (
        attention_implementation(model) == "sdpa"
        and heads is not None
        and kv_heads < heads
        and model.device.type in GROUPED_KV_DEVICES
        and any(
            parameter.kind is inspect.Parameter.VAR_KEYWORD
            for parameter in inspect.signature(model.forward).parameters.values()
        )
    )
