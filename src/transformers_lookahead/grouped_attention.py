"""
The masked attention of a lookahead pass without copies of the key/value heads.

Transformers' sdpa integration repeats grouped key/value heads whenever a mask is passed, and a lookahead pass always
has one, so every layer copied its whole cache twice per pass. PyTorch's CPU sdpa takes `enable_gqa=True` with a mask
and computes bit-identical outputs. `grouped_sdpa` is registered through Transformers' public `AttentionInterface`
under a name of its own (`GROUPED_SDPA`), and `StepForward` names it for the lookahead passes of the model it runs
(`grouped_sdpa_for`): `"sdpa"`, and every other model in the process, stay as they were.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .compatibility import GROUPED_SDPA, attention_implementation

# Devices whose sdpa takes grouped key/value heads together with a mask, with outputs identical to repeated heads.
# CUDA's kernels fall back to the math path with a mask and grouped heads: whether that beats the copies is for a
# measurement on a GPU (`make gpu-check`) to say, so CUDA keeps the stock path.
GROUPED_KV_DEVICES = ("cpu",)


def grouped_sdpa(
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
    """
    Transformers' sdpa attention (the function registered as `"sdpa"`), except that a masked pass of several query
    tokens over grouped key/value heads runs PyTorch's sdpa with `enable_gqa=True` instead of repeating the heads.
    """
    # One-token passes keep the stock path (it packs their heads without copies), so that a lookahead step of one
    # token computes exactly what plain decoding computes.
    if not (
        query.shape[2] > 1
        and attention_mask is not None
        and getattr(module, "num_key_value_groups", 1) > 1
        and query.device.type in GROUPED_KV_DEVICES
        and key.shape[-1] == value.shape[-1]
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
    ):
        sdpa_attention = ALL_ATTENTION_FUNCTIONS["sdpa"]
        return sdpa_attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    output = sdpa(query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True)
    return output.transpose(1, 2).contiguous(), None


def register_grouped_attention() -> None:
    """Registers `grouped_sdpa` as `GROUPED_SDPA`, with sdpa's masks; a new name, so nothing else changes."""
    AttentionInterface.register(GROUPED_SDPA, grouped_sdpa)
    AttentionMaskInterface.register(GROUPED_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def takes_grouped_kv(model: torch.nn.Module) -> bool:
    """
    Whether `model`'s lookahead passes should run `grouped_sdpa`: sdpa attention over grouped key/value heads, on a
    device in `GROUPED_KV_DEVICES`.
    """
    config = model.config.get_text_config(decoder=True)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return (
        attention_implementation(config) == "sdpa"
        and heads is not None
        and kv_heads < heads
        and model.device.type in GROUPED_KV_DEVICES
    )
