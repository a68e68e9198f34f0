"""The input row of one lookahead step: token ids, position ids, the 4D attention mask and the logits to keep."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers import Cache

from .compatibility import attention_implementation
from .token_tree import TokenTree

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask
    from transformers import PreTrainedModel

    from .verification import Verdict

# How the masks reach the attention layers: additive float masks for eager and sdpa (a bool 4D mask is read
# differently by the eager backend), `BlockMask`s for flex attention (a float mask would reach its kernel as a
# `score_mod` applied to every score; a `BlockMask` also lets it skip the blocks no query sees).
MASK_FORMATS = {"eager": "additive", "sdpa": "additive", "flex_attention": "block"}


@dataclass
class RowStep:
    """
    One sequence's part of a step, before the rows of a batch are padded to one length.

    Args:
        tokens (`list[int]`): pending tokens, then the window, then the tree, on the host.
        input_ids (`torch.LongTensor` of shape `(T_b,)`): the same tokens on the model's device.
        positions (`torch.LongTensor` of shape `(T_b,)`).
        visible (`torch.BoolTensor` of shape `(T_b, T_b)`): which of the step's tokens each token sees.
        logits_rows (`list[int]`): the rows whose logits verification reads, in this order: the last pending token,
            the window's top level (if the window is in the step), every tree node.
        tree_row (`int`): the index in `logits_rows` of the first tree node.
        window_used (`bool`): whether the window is part of this step.
        pending_length (`int`): k, the pending tokens the step starts with.
        tree_start (`int`): the index in the step of the first tree node (after the pending tokens and the window).
    """

    tokens: list[int]
    input_ids: torch.LongTensor
    positions: torch.LongTensor
    visible: torch.BoolTensor | None
    logits_rows: list[int]
    tree_row: int
    window_used: bool
    pending_length: int
    tree_start: int

    @property
    def length(self) -> int:
        return self.input_ids.shape[0]

    def window_top(self, choices: list[int]) -> list[int]:
        """
        The model's choices (one per entry of `logits_rows`) at the window's top level: the next Jacobi iteration of
        its guesses. Empty when the window is not part of the step.
        """
        return choices[1 : self.tree_row]

    def kept_rows(self, matched_nodes: list[int], strategy: str) -> list[int]:
        """
        The step rows whose cache entries the sequence keeps: its pending tokens, then (for `"gather"`) the tree
        nodes it accepted, in order. With `"refeed"` the accepted tokens are fed again by the next step instead.

        Args:
            matched_nodes (`list[int]`): the accepted tree nodes, top down.
            strategy (`str`): `"gather"` or `"refeed"` (see `CacheCommitter`).
        """
        rows = list(range(self.pending_length))
        if strategy == "gather":
            rows += [self.tree_start + node for node in matched_nodes]
        return rows


@dataclass
class StepInputs:
    """
    Everything the forward pass of one step needs, and where its outputs are.

    Args:
        input_ids (`torch.LongTensor` of shape `(batch, T)`): each row's `RowStep` tokens, padded to T.
        position_ids (`torch.LongTensor` of shape `(batch, T)`, or `None` for chain steps of a model that numbers
            positions itself, see `ChainLayout`).
        attention_mask (`torch.Tensor`, `BlockMask`, a dict of them, or `None`): additive float masks of shape
            `(batch, 1, T, kv_length)` (flex attention: `BlockMask`s of that shape), one per attention layer type
            when the model mixes full and sliding layers; `None` for a single-token step of one unpadded sequence,
            which needs only the causal mask the model builds.
        logits_rows (`torch.LongTensor`): the step rows whose logits the forward pass computes (for every sequence).
        row_logits (`list[list[int] | None]`): per sequence, where its `RowStep.logits_rows` are among `logits_rows`
            (`None`: all of them, in order).
    """

    input_ids: torch.LongTensor
    position_ids: torch.LongTensor | None
    attention_mask: torch.Tensor | BlockMask | dict[str, torch.Tensor | BlockMask] | None
    logits_rows: torch.LongTensor
    row_logits: list[list[int] | None]

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]

    def logits_of(self, row: int, logits: torch.Tensor) -> torch.Tensor:
        """The logits (what the forward pass returned) of the sequence at `row`, in its `RowStep.logits_rows` order."""
        rows = self.row_logits[row]
        return logits[row] if rows is None else logits[row, rows]

    def choices_of(self, row: int, choices: list[list[int]]) -> list[int]:
        """The `choices` (`read_choices` of the step's logits) of the sequence at `row`, as `logits_of` orders them."""
        rows = self.row_logits[row]
        return choices[row] if rows is None else [choices[row][index] for index in rows]


@dataclass(frozen=True)
class AttentionGroup:
    """
    Attention layers that share one mask.

    Args:
        layer_idx (`int`): a cache layer of the group, asked for the key/value length of the step.
        sliding_window (`int` or `None`): the window of sliding layers, `None` for full attention.
        chunked (`bool`, *optional*): whether the window is a chunk (Llama 4's chunked attention): a token sees the
            keys of its own chunk of `sliding_window` positions, not the last `sliding_window` keys.
    """

    layer_idx: int
    sliding_window: int | None
    chunked: bool = False


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
            # A static sliding layer that can be rolled back never holds more than its window: no key is too far.
            window = getattr(layer, "sliding_window", None) if layer.is_sliding else None
            groups[name] = AttentionGroup(idx, window, chunked=window is not None and name == "chunked_attention")
    if len({(group.sliding_window, group.chunked) for group in groups.values()}) == 1:
        return next(iter(groups.values()))
    return groups


class RowLayout:
    """
    Lays out one sequence's part of a step as a single sequence (see `docs/source/en/lookahead_decoding.md` for a
    drawing), as both loops do:

    - `k` pending tokens (accepted, not yet in the cache) at positions `p - k + 1 .. p`, causal among themselves;
    - window level `l`, column `i` at position `p + 1 + l + i`, seeing level 0 up to its column and its own
      column's levels 1..l, i.e. a contiguous history of positions `p + 1 .. p + 1 + l + i`;
    - tree nodes at `p + depth`, each seeing its ancestors.

    Every row sees all pending tokens; the window and the tree never see each other.

    Args:
        window (`int`): W, columns of the lookahead window.
        levels (`int`): N - 1, levels of the window.
        device (`torch.device`): where the row tensors live.
    """

    def __init__(self, window: int, levels: int, device: torch.device):
        self.window = window
        self.levels = levels
        self.device = device
        # The window's structure is the same every step: built once, on the host, where `row` lays steps out.
        level = np.arange(levels).repeat(window)
        column = np.tile(np.arange(window), levels)
        self.window_offsets = (1 + level + column).tolist()
        sees_first_level = (level[None, :] == 0) & (column[None, :] <= column[:, None])
        sees_own_column = (
            (column[None, :] == column[:, None]) & (level[None, :] >= 1) & (level[None, :] <= level[:, None])
        )
        self.window_block = sees_first_level | sees_own_column
        self.top_rows = list(range((levels - 1) * window, levels * window))

    def row(
        self,
        pending: list[int],
        position: int,
        window_tokens: list[int] | None,
        tree: TokenTree,
    ) -> RowStep:
        """
        One sequence's part of a step: its `pending` tokens (accepted, not yet cached, k >= 1), the last at
        `position`, the window's guesses level by level (`None`: no window this step), and the `tree` to verify.
        """
        device = self.device
        k = len(pending)
        window_length = 0 if window_tokens is None else len(window_tokens)
        tree_length = len(tree)
        length = k + window_length + tree_length
        tree_start = k + window_length
        tree_row = 1 + (self.window if window_tokens is not None else 0)
        tokens = [*pending, *(window_tokens or ()), *tree.tokens]
        input_ids = torch.tensor(tokens, dtype=torch.long, device=device)
        if length == 1:
            positions = torch.tensor([position], device=device)
            return RowStep(tokens, input_ids, positions, None, [0], tree_row, False, k, tree_start)

        # Built on the host and moved once: a step is a few dozen tokens, and one torch call per piece cost more
        # than the whole host-side construction.
        positions = list(range(position - k + 1, position + 1))
        if window_tokens is not None:
            positions += [position + offset for offset in self.window_offsets]
        positions += [position + depth for depth in tree.depths]

        visible = np.zeros((length, length), dtype=bool)
        visible[:, :k] = True
        visible[:k, :k] = np.tri(k, dtype=bool)
        if window_tokens is not None:
            visible[k:tree_start, k:tree_start] = self.window_block
        # Each node sees what its parent sees, and itself; parents come first.
        tree_visible = visible[tree_start:, tree_start:]
        for node, parent in enumerate(tree.parents):
            if parent >= 0:
                tree_visible[node] = tree_visible[parent]
            tree_visible[node, node] = True
        logits_rows = [k - 1]
        if window_tokens is not None:
            logits_rows += [row + k for row in self.top_rows]
        logits_rows += range(tree_start, length)
        return RowStep(
            tokens,
            input_ids,
            torch.tensor(positions, device=device),
            torch.from_numpy(visible).to(device),
            logits_rows,
            tree_row,
            window_tokens is not None,
            k,
            tree_start,
        )


class StepLayout(RowLayout):
    """
    Lays out a step of `generate`'s loop: every sequence's part (`RowLayout.row`) padded to one length, with the
    masks over the shared cache and the step. Every row sees the whole cache (but its batch row's padding and unused
    slots); sliding layers additionally hide keys `sliding_window` or more positions back.

    Args:
        window (`int`): W, columns of the lookahead window.
        levels (`int`): N - 1, levels of the window.
        groups (`dict[str, AttentionGroup]` or `AttentionGroup`): one group per attention layer type (the masks are
            then passed as a dict keyed by layer type), or a single group when all layers share one mask.
        dtype (`torch.dtype`): the dtype of the additive masks (the model's).
        device (`torch.device`): where the step tensors live.
        mask_format (`str`): `"additive"` (float masks, 0 or the dtype's minimum) or `"block"` (flex attention
            `BlockMask`s).
    """

    def __init__(
        self,
        window: int,
        levels: int,
        groups: dict[str, AttentionGroup] | AttentionGroup,
        dtype: torch.dtype,
        device: torch.device,
        mask_format: str = "additive",
    ):
        if mask_format not in MASK_FORMATS.values():
            raise ValueError(
                f"`mask_format` must be one of {sorted(set(MASK_FORMATS.values()))}, got {mask_format!r}."
            )
        super().__init__(window, levels, device)
        self.groups = groups
        self.dtype = dtype
        self.mask_format = mask_format
        self.min_value = torch.finfo(dtype).min
        self._last_row = torch.tensor([0], device=device)

    @classmethod
    def for_model(cls, model: PreTrainedModel, cache: Cache, window: int, levels: int) -> StepLayout:
        """
        The layout of W = `window` columns and N - 1 = `levels` for `model`'s attention layers (its backend among
        `MASK_FORMATS`): one mask per layer type of `cache` (created), in the format the backend reads.
        """
        groups = attention_groups(cache, layer_types(model))
        mask_format = MASK_FORMATS[attention_implementation(model)]
        return cls(window, levels, groups, model.dtype, model.device, mask_format)

    def candidates(self, tree: TokenTree, window_allowed: bool, pending: int) -> tuple[TokenTree, bool]:
        """What of a sequence's candidates (`tree`) and window a step holds, after `pending` tokens: all of them."""
        return tree, window_allowed

    def even_out(self, verdicts: list[Verdict]) -> list[Verdict]:
        """The tokens each sequence keeps of its verdict: all of them (`ChainLayout` keeps as many in every row)."""
        return verdicts

    def build(
        self,
        cache,
        rows: list[RowStep],
        slot_valid: torch.BoolTensor | None = None,
        fixed_length: int | None = None,
        seq_length: Callable[[int], int] | None = None,
    ) -> StepInputs:
        """
        Pads the sequences' steps to one length and builds the masks over the cache and the step.

        Args:
            cache (`Cache`): the model's cache, asked for each group's key/value length and offset.
            rows (`list[RowStep]`): one step per sequence of the batch, in batch order.
            slot_valid (`torch.BoolTensor` of shape `(batch, cache_length)`, *optional*): which cache slots hold a
                token of each sequence (left padding and the slots a sequence did not accept are False). `None`
                when every slot is valid. It describes full-attention layers: sliding layers hold each sequence's
                tokens contiguously at the end of its row (see `CacheCommitter`), and their masks follow from the
                step's positions.
            fixed_length (`int`, *optional*): pad every multi-token step to this length and compute the logits of
                every row, so that all of them have one shape (a compiled forward pass then compiles once).
            seq_length (`Callable[[int], int]`, *optional*): the tokens a layer holds, by layer index, known on the
                host (`CacheCommitter.seq_length`); `cache.get_seq_length` when not given.

        Returns:
            `StepInputs`.
        """
        device = self.device
        length = max(row.length for row in rows)
        fixed = fixed_length is not None and length > 1
        if fixed:
            if length > fixed_length:
                raise RuntimeError(f"A step of {length} tokens was planned for a fixed step length of {fixed_length}.")
            length = fixed_length
        if len(rows) == 1 and rows[0].length == length:
            only = rows[0]
            if length == 1 and slot_valid is None:
                # A lone token sees everything before it: the model builds that mask itself (for sliding layers too),
                # exactly as in plain decoding, which is cheaper than a custom mask.
                return StepInputs(
                    only.input_ids[None], only.positions[None], None, self._rows(only.logits_rows), [None]
                )
            input_ids, positions = only.input_ids[None], only.positions[None]
            visible = (
                only.visible[None]
                if only.visible is not None
                else torch.ones(1, 1, 1, dtype=torch.bool, device=device)
            )
            logits_rows, row_logits = self._rows(only.logits_rows), [None]
        else:
            batch = len(rows)
            input_ids = torch.zeros(batch, length, dtype=torch.long, device=device)
            positions = torch.zeros(batch, length, dtype=torch.long, device=device)
            # Padding tokens see only themselves: no sequence sees them, and their rows stay finite.
            visible = torch.eye(length, dtype=torch.bool, device=device).repeat(batch, 1, 1)
            for b, row in enumerate(rows):
                input_ids[b, : row.length] = row.input_ids
                positions[b, : row.length] = row.positions
                positions[b, row.length :] = row.positions[-1]
                if row.visible is not None:
                    visible[b, : row.length, : row.length] = row.visible
            # On the host: the union of the rows' logits rows, and where each row's are in it.
            union = sorted({index for row in rows for index in row.logits_rows})
            where = {index: position for position, index in enumerate(union)}
            logits_rows = self._rows(union)
            row_logits = [[where[index] for index in row.logits_rows] for row in rows]
        if fixed:
            logits_rows = torch.arange(length, device=device)
            row_logits = [row.logits_rows for row in rows]

        attention_mask = self._attention_mask(
            cache, seq_length or cache.get_seq_length, visible, positions, slot_valid
        )
        return StepInputs(input_ids, positions, attention_mask, logits_rows, row_logits)

    def _attention_mask(
        self,
        cache,
        held: Callable[[int], int],
        visible: torch.Tensor,
        positions: torch.Tensor,
        slot_valid: torch.BoolTensor | None,
    ) -> torch.Tensor | BlockMask | dict[str, torch.Tensor | BlockMask]:
        """The step's masks: one, or one per attention layer type (see `StepInputs.attention_mask`)."""
        if isinstance(self.groups, AttentionGroup):
            return self._mask(cache, held, self.groups, visible, positions, slot_valid)
        return {
            name: self._mask(cache, held, group, visible, positions, slot_valid) for name, group in self.groups.items()
        }

    def _rows(self, rows: list[int]) -> torch.LongTensor:
        """The logits rows to keep, on the device: the last row alone (a one-token step) is built once."""
        return self._last_row if rows == [0] else torch.tensor(rows, device=self.device)

    def _mask(
        self,
        cache,
        held: Callable[[int], int],
        group: AttentionGroup,
        visible: torch.Tensor,
        positions: torch.Tensor,
        slot_valid: torch.BoolTensor | None,
    ) -> torch.Tensor | BlockMask:
        batch, length = positions.shape
        kv_length, kv_offset = cache.get_mask_sizes(length, group.layer_idx)
        # Dynamic layers return the cache followed by the step; static layers return their whole buffer, the step
        # written right after the cached tokens and stale entries after it.
        past = min(kv_length - length, held(group.layer_idx))
        mask = torch.zeros(batch, length, kv_length, dtype=self.dtype, device=self.device)
        mask[:, :, past : past + length].masked_fill_(~visible, self.min_value)
        mask[:, :, past + length :] = self.min_value
        if group.sliding_window is not None:
            if slot_valid is None:
                # One unpadded sequence: a cached token's position is its index in the cache.
                cached = torch.arange(kv_offset, kv_offset + past, device=self.device).expand(batch, -1)
            else:
                # Sliding layers hold each sequence's latest tokens at the end of its row (`CacheCommitter`), and a
                # step starts with the sequence's first token not in the cache: slot j holds position
                # `first - past + j`, negative for padding.
                cached = positions[:, :1] - past + torch.arange(past, device=self.device)
                mask[:, :, :past].masked_fill_((cached < 0)[:, None, :], self.min_value)
            kv_positions = torch.cat([cached, positions], dim=1)
            if group.chunked:
                too_far = (
                    positions[:, :, None] // group.sliding_window != kv_positions[:, None, :] // group.sliding_window
                )
            else:
                too_far = positions[:, :, None] - kv_positions[:, None, :] >= group.sliding_window
            mask[:, :, : past + length].masked_fill_(too_far, self.min_value)
        elif slot_valid is not None and past:
            mask[:, :, :past].masked_fill_(~slot_valid[:, None, -past:], self.min_value)
        if self.mask_format == "block":
            return block_mask(mask == 0)
        return mask[:, None]


def padded_length(length: int, buckets: tuple[int, ...] | int) -> int:
    """
    The length a fixed-shape pass runs `length` tokens as: the shortest of `generate`'s compiled `buckets` holding
    them (the longest if none does), or the next multiple of a continuous-batching engine's padding interval.
    """
    if isinstance(buckets, int):
        return -(-length // buckets) * buckets
    return next((bucket for bucket in buckets if bucket >= length), buckets[-1])


def generate_position_shift(model: PreTrainedModel) -> int | None:
    """
    How `generate` numbers a decoder-only model's positions, so that lookahead steps number them alike: `None` where
    the model numbers them itself, by cache slot with left padding included (`generate` prepares position ids only
    for a forward that names them, which Whisper's decoder as a causal LM does not, and the model's own
    `prepare_inputs_for_generation` may drop them: Exaone 4.5); else what that preparation adds to the position ids
    `generate` prepared (0; 1 for PaliGemma, whose positions start at 1).
    """
    if model.config.is_encoder_decoder:
        return 0
    if "position_ids" not in inspect.signature(model.forward).parameters:
        return None
    ids = torch.zeros((1, 2), dtype=torch.long, device=model.device)
    prepared = torch.arange(2, device=model.device)[None]
    try:
        inputs = model.prepare_inputs_for_generation(ids, attention_mask=torch.ones_like(ids), position_ids=prepared)
    except Exception:  # noqa: BLE001 - a preparation that needs more inputs (images) passes generate's own ids on
        return 0
    positions = inputs.get("position_ids")
    if positions is None:
        return None
    shift = positions.reshape(-1, 2)[0] - prepared[0]
    # A preparation that computes positions otherwise (multimodal rotary ids) is left to its model's own steps.
    return int(shift[0]) if bool((shift == shift[0]).all()) else 0


def block_mask(allowed: torch.BoolTensor) -> BlockMask:
    """
    The flex attention `BlockMask` letting each query see the keys `allowed` marks.

    Args:
        allowed (`torch.BoolTensor` of shape `(batch, query_length, kv_length)`).
    """
    from torch.nn.attention.flex_attention import create_block_mask

    batch, length, kv_length = allowed.shape

    def mask_mod(b, h, q_idx, kv_idx):
        return allowed[b, q_idx, kv_idx]

    return create_block_mask(mask_mod, batch, None, length, kv_length, device=allowed.device)
