"""Cache commit and rollback after a step, through the `Cache` API."""

from __future__ import annotations

import torch
from transformers import Cache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from .configuration_lookahead import CACHE_COMMIT_STRATEGIES
from .step_layout import AttentionGroup


def layer_types(model) -> list[str] | None:
    """`config.layer_types` of the model's decoder: the keys its forward expects in a dict of masks."""
    return getattr(model.config.get_text_config(decoder=True), "layer_types", None)


def attention_groups(cache: Cache, layer_types: list[str] | None) -> dict[str, AttentionGroup] | AttentionGroup:
    """
    Groups the cache layers by the attention mask they need.

    Args:
        cache (`Cache`): the model's cache, its layers already created.
        layer_types (`list[str]` or `None`): `config.layer_types`, the names models key their mask dicts by.

    Returns:
        A single `AttentionGroup` when every layer takes the same mask, otherwise a dict keyed by layer type.
    """
    groups: dict[str, AttentionGroup] = {}
    for idx, layer in enumerate(cache.layers):
        name = layer_types[idx] if layer_types is not None else "full_attention"
        if name not in groups:
            groups[name] = AttentionGroup(idx, layer.sliding_window if layer.is_sliding else None)
    if len({group.sliding_window for group in groups.values()}) == 1:
        return next(iter(groups.values()))
    return groups


class CacheCommitter:
    """
    Keeps the KV entries of the tokens a step accepted and drops the rest.

    After a step's forward pass the last `T` entries of every layer belong to the step: its pending tokens first,
    then the window and the tree. Two exact ways to keep the accepted tokens:

    - `"gather"`: copy the matched tree nodes' entries right after the pending tokens, then crop the remainder. The
      entries were computed at the nodes' final positions with their final context, so they are the entries plain
      decoding would have written. Only the last accepted token is fed to the next step.
    - `"refeed"`: crop everything but the pending tokens and feed all accepted tokens again in the next step. It
      never touches layer tensors, at the price of `m` more tokens in the next forward pass.

    Sliding-window layers keep their full recent states until the crop (`activate_past_recording`), so both ways
    work for them too.

    Args:
        cache (`Cache`): a cache whose layers are `DynamicLayer` or `DynamicSlidingWindowLayer`.
        strategy (`str`): `"gather"` or `"refeed"`.
    """

    def __init__(self, cache: Cache, strategy: str = "gather"):
        if strategy not in CACHE_COMMIT_STRATEGIES:
            raise ValueError(f"`lookahead_cache_commit` must be one of {CACHE_COMMIT_STRATEGIES}, got {strategy!r}.")
        unsupported = {type(layer).__name__ for layer in cache.layers} - {"DynamicLayer", "DynamicSlidingWindowLayer"}
        if unsupported or not all(isinstance(layer, DynamicLayer) for layer in cache.layers):
            raise ValueError(
                f"Lookahead decoding rolls back `DynamicCache` layers; this cache ({type(cache).__name__}) has "
                f"{sorted(unsupported)} layers. Use the default `DynamicCache`."
            )
        self.cache = cache
        self.strategy = strategy

    def start(self) -> None:
        """Called once after the prefill: from here on, sliding layers keep the states a crop may need."""
        if any(isinstance(layer, DynamicSlidingWindowLayer) for layer in self.cache.layers):
            self.cache.activate_past_recording()

    def commit(self, step_length: int, pending_length: int, kept_nodes_rows: list[int]) -> None:
        """
        Args:
            step_length (`int`): T, the tokens of the step's forward pass.
            pending_length (`int`): the step's pending tokens (its first rows), all kept.
            kept_nodes_rows (`list[int]`): step rows of the tree nodes to keep after them, in order. Ignored by
                `"refeed"`, which feeds those tokens again.
        """
        kept = len(kept_nodes_rows) if self.strategy == "gather" else 0
        if kept:
            for layer in self.cache.layers:
                if not layer.is_initialized:
                    continue
                start = layer.keys.shape[-2] - step_length
                source = torch.tensor(kept_nodes_rows, device=layer.keys.device) + start
                target = slice(start + pending_length, start + pending_length + kept)
                layer.keys[..., target, :] = layer.keys[..., source, :]
                layer.values[..., target, :] = layer.values[..., source, :]
        # Sliding layers also fall back to their window here, which is why crop runs even with nothing to drop.
        self.cache.crop(-(step_length - pending_length - kept))
