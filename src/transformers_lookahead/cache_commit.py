"""Cache commit and rollback after a step, through the `Cache` API."""

from __future__ import annotations

import torch
from transformers import Cache, DynamicCache
from transformers.cache_utils import CacheLayerMixin

from .compatibility import (
    RECURRENT_LAYERS,
    ROLLBACK_LAYERS,
    DynamicSlidingWindowLayer,
    StaticLayer,
    can_roll_back,
    is_shared_layer,
    layer_step_start,
    length_on_device,
)
from .configuration_lookahead import CACHE_COMMIT_STRATEGIES


class EntryMoves:
    """
    A commit's copies, in every layer: in row b, entry `start + index[b][j]` goes to `start + j`. The index tensors
    are built once per step; one row moves by `index_select` / `index_copy_` (cheaper), several by `gather`.
    """

    def __init__(self, index: list[list[int]]):
        self.index = index
        self.width = len(index[0])
        self._placed: dict[tuple, tuple[torch.LongTensor, ...]] = {}

    def apply(self, layer: CacheLayerMixin, start: int) -> None:
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
        # Keys and values each by their own shape: they differ in head size under multi-head latent attention.
        for tensor in (layer.keys, layer.values):
            shape = (*tensor.shape[:2], self.width, tensor.shape[-1])
            if shape not in self._placed:
                self._placed[shape] = (torch.tensor(self.index, device=device)[:, None, :, None].expand(shape),)
            (source,) = self._placed[shape]
            tensor[:, :, start : start + self.width] = torch.gather(tensor[:, :, start:], 2, source)


def has_static_layers(cache: Cache) -> bool:
    """Whether `cache` holds static layers, sized for plain decoding."""
    return any(isinstance(layer, StaticLayer) for layer in cache.layers)


def keep_cache_rows(cache: Cache, indices: torch.Tensor) -> None:
    """Keeps the batch rows `indices` of every layer (recurrent layers by `reorder_cache`)."""
    for layer in cache.layers:
        if type(layer) in RECURRENT_LAYERS:
            layer.reorder_cache(indices)
        else:
            layer.batch_select_indices(indices)


def unsupported_layer_message(owner: str, cache: Cache, layer: CacheLayerMixin) -> str:
    """Why a cache layer of `owner`'s cannot be rolled back after a step, and what its user can do."""
    kind = type(layer).__name__
    if "LinearAttention" in kind:
        # A static hybrid layer: its running state sits beside a static attention buffer.
        why = "lookahead keeps the running states of linear-attention and state-space layers in dynamic caches only"
        remedy = "Use the default `DynamicCache`."
    else:
        why = "lookahead drops the entries of the tokens a step does not accept, and these layers cannot drop them"
        if type(cache) is DynamicCache:
            # The cache `generate` builds by default: no other cache would give this model other layers.
            remedy = "Lookahead decoding is not available for this model yet; remove the `lookahead_*` settings."
        else:
            names = tuple(rollback.__name__ for rollback in ROLLBACK_LAYERS)
            remedy = (
                f"Use a cache whose layers are one of {names}: `DynamicCache` (the default) or "
                '`cache_implementation="static"`.'
            )
    return f"`{owner}` keeps {kind} layers in its {type(cache).__name__}: {why}. {remedy}"


class CacheCommitter:
    """
    Keeps the KV entries of the tokens a step accepted and drops the rest. After a pass the last `T` entries of every
    layer are the step's. `"gather"` copies the matched nodes' entries (computed at their final positions: plain
    decoding's) right after the pending tokens and crops the rest; `"refeed"` crops all but the pending tokens and
    feeds the accepted ones again. Sliding layers record their past until the crop; static layers' length is kept on
    the host. In a batch the cache grows by the most any row kept; dynamic sliding layers keep each row's tokens last.

    Args:
        cache (`Cache`): a cache whose layers are among `ROLLBACK_LAYERS`.
        strategy (`str`): `"gather"` or `"refeed"`.
        owner (`str`, *optional*): the model's class name, for the errors.
    """

    def __init__(self, cache: Cache, strategy: str = "gather", owner: str = "The model"):
        if strategy not in CACHE_COMMIT_STRATEGIES:
            raise ValueError(f"`lookahead_cache_commit` must be one of {CACHE_COMMIT_STRATEGIES}, got {strategy!r}.")
        for layer in cache.layers:
            if self.takes(layer):
                continue
            if type(layer) in ROLLBACK_LAYERS:  # a static sliding layer past its window
                raise ValueError(
                    f"A static sliding-window layer (window {layer.max_cache_len}) cannot be rolled back once the "
                    "generation outgrows its window. Use the default dynamic cache for this model, or keep "
                    "prompt + `max_new_tokens` within the window."
                )
            raise ValueError(unsupported_layer_message(owner, cache, layer))
        self.cache = cache
        self.strategy = strategy
        self.is_static = has_static_layers(cache)
        self._device_length: int | None = None

    @staticmethod
    def takes(layer: CacheLayerMixin) -> bool:
        """Whether a step's entries can be dropped from `layer` (shared layers hold none)."""
        return can_roll_back(layer) or is_shared_layer(layer)

    def seq_length(self, layer_idx: int = 0) -> int:
        """`Cache.get_seq_length(layer_idx)`, without reading the device."""
        layer = self.cache.layers[layer_idx]
        if self._device_length is not None and length_on_device(layer):
            return self._device_length
        return self.cache.get_seq_length(layer_idx)

    def room(self) -> int | None:
        """The tokens the next step may feed: what static buffers have left; `None` for dynamic caches."""
        if not self.is_static:
            return None
        return min(
            layer.max_cache_len - self.seq_length(index)
            for index, layer in enumerate(self.cache.layers)
            if isinstance(layer, StaticLayer)
        )

    def start(self) -> None:
        """After the prefill: sliding layers start recording, and static layers' length is read once."""
        lengths = {
            int(layer.get_seq_length())
            for layer in self.cache.layers
            if length_on_device(layer) and layer.is_initialized
        }
        if len(lengths) > 1:
            raise RuntimeError(f"The static cache's full-attention layers hold different lengths: {sorted(lengths)}.")
        self._device_length = lengths.pop() if lengths else None
        for layer in self.cache.layers:
            # So that a crop reaches back past the window (a hybrid's recurrent part too; `ChainCommitter` trims it).
            if isinstance(layer, DynamicSlidingWindowLayer):
                layer.activate_past_recording()

    def before_step(self, feeds_guesses: bool) -> None:
        """Before each pass, with whether it feeds tokens that may not be kept (`ChainCommitter` saves states)."""

    def keep(self, step_length: int, kept_rows: list[list[int]]) -> tuple[int, bool]:
        """`commit`s the step (`ChainCommitter` may undo it instead); returns the slots added and whether undone."""
        return self.commit(step_length, kept_rows), False

    def undo(self, step_length: int) -> None:
        """Drops the whole step: its tokens must be fed again."""
        for layer in self.cache.layers:
            self._crop(layer, -step_length)
        if self._device_length is not None:
            self._device_length -= step_length

    def commit(self, step_length: int, kept_rows: list[list[int]]) -> int:
        """
        Keeps each row's `kept_rows` (non-empty, in order) right after the cache as it was, and drops the rest of the
        step of `step_length` tokens. Every row gets `A = max(len(rows))` slots, the unused ones masked later
        (`SlotMap`); returns A.
        """
        added = max(len(rows) for rows in kept_rows)
        uneven = any(len(rows) != added for rows in kept_rows)
        in_place = all(rows == list(range(len(rows))) for rows in kept_rows)
        # Unused slots copy the row's last kept entry: any finite value does, they are masked.
        moves = None if in_place else EntryMoves([rows + rows[-1:] * (added - len(rows)) for rows in kept_rows])
        for layer in self.cache.layers:
            # Shared layers hold nothing; running states (`ChainCommitter`) have no entries to move.
            if is_shared_layer(layer) or not getattr(layer, "is_initialized", False):
                continue
            # The step was written right after what the layer held before it.
            start = self._device_length if length_on_device(layer) else layer_step_start(layer, step_length)
            if isinstance(layer, DynamicSlidingWindowLayer) and uneven:
                # Uneven counts: right-align each row (filler, the row as it was, what it kept); even counts
                # already leave them so without copying the whole window.
                index = [
                    [0] * (added - len(rows)) + list(range(start)) + [start + row for row in rows]
                    for rows in kept_rows
                ]
                EntryMoves(index).apply(layer, 0)
            elif moves is not None:
                moves.apply(layer, start)
        # Sliding layers also fall back to their window here, which is why crop runs even with nothing to drop.
        for layer in self.cache.layers:
            self._crop(layer, -(step_length - added))
        if self._device_length is not None:
            self._device_length += added
        return added

    @staticmethod
    def _crop(layer: CacheLayerMixin, tokens_to_remove: int) -> None:
        if not is_shared_layer(layer):
            layer.crop(tokens_to_remove)
