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

# Additive float masks for eager and sdpa (eager reads a bool 4D mask differently); `BlockMask`s for flex attention,
# whose kernel would apply a float mask as a `score_mod` to every score.
MASK_FORMATS = {"eager": "additive", "sdpa": "additive", "flex_attention": "block"}


@dataclass
class RowStep:
    """
    One sequence's part of a step: pending tokens, then the window, then the tree.

    Args:
        tokens (`list[int]`): the tokens, on the host.
        input_ids (`torch.LongTensor` of shape `(T_b,)`): the same on the model's device.
        positions (`torch.LongTensor` of shape `(T_b,)`).
        visible (`torch.BoolTensor` of shape `(T_b, T_b)`): which of the step's tokens each token sees.
        logits_rows (`list[int]`): the rows verification reads: the last pending token, the window's top level (if
            in the step), every tree node.
        tree_row (`int`): the index in `logits_rows` of the first tree node.
        window_used (`bool`): whether the window is in the step.
        pending_length (`int`): k, the pending tokens.
        tree_start (`int`): the index in the step of the first tree node.
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
        """The model's choices (one per `logits_rows` entry) at the window's top level: its next Jacobi iteration."""
        return choices[1 : self.tree_row]

    def kept_rows(self, matched_nodes: list[int], strategy: str) -> list[int]:
        """The step rows whose entries are kept: the pending tokens, then (`"gather"`) the accepted `matched_nodes`."""
        rows = list(range(self.pending_length))
        if strategy == "gather":
            rows += [self.tree_start + node for node in matched_nodes]
        return rows


@dataclass
class StepInputs:
    """
    The forward pass of one step, and where its outputs are.

    Args:
        input_ids (`torch.LongTensor` of shape `(batch, T)`): each row's tokens, padded to T.
        position_ids (`torch.LongTensor` of shape `(batch, T)`, *optional*): `None` where the model numbers them.
        attention_mask (`torch.Tensor`, `BlockMask`, a dict of them, or `None`): `(batch, 1, T, kv_length)`, one per
            layer type where full and sliding layers mix; `None` for one unpadded token (the model's causal mask).
        logits_rows (`torch.LongTensor`): the step rows whose logits the pass computes.
        row_logits (`list[list[int] | None]`): per row, where its `RowStep.logits_rows` are (`None`: all, in order).
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
        """The logits of the sequence at `row`, in its `RowStep.logits_rows` order."""
        rows = self.row_logits[row]
        return logits[row] if rows is None else logits[row, rows]

    def choices_of(self, row: int, choices: list[list[int]]) -> list[int]:
        """The `choices` (`read_choices` of the logits) of the sequence at `row`, as `logits_of` orders them."""
        rows = self.row_logits[row]
        return choices[row] if rows is None else [choices[row][index] for index in rows]


@dataclass(frozen=True)
class HoleySlots:
    """
    For prompts whose masks have zeros after real tokens (right padding, holes): how sliding and chunked layers see
    each row's slots, as plain decoding's masks do, by slot rather than by position.

    Args:
        valid (`Callable[[int], torch.BoolTensor]`): which of the latest `past` slots of each row hold its tokens.
        shift (`torch.LongTensor` of shape `(batch, 1)`): each row's slot index past its left padding, minus its
            position.
    """

    valid: Callable[[int], torch.BoolTensor]
    shift: torch.LongTensor


@dataclass(frozen=True)
class AttentionGroup:
    """
    Attention layers that share one mask: a cache layer of theirs (`layer_idx`), their `sliding_window` (`None`: full
    attention), and whether it is a chunk (`chunked`, Llama 4: a token sees its own chunk's keys).
    """

    layer_idx: int
    sliding_window: int | None
    chunked: bool = False


def layer_types(model) -> list[str] | None:
    """`config.layer_types` of the model's decoder: the keys its forward expects in a dict of masks."""
    return getattr(model.config.get_text_config(decoder=True), "layer_types", None)


def attention_groups(cache: Cache, layer_types: list[str] | None) -> dict[str, AttentionGroup] | AttentionGroup:
    """The cache's layers by the mask they need: one `AttentionGroup`, or a dict keyed by `layer_types`."""
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
    Lays out one sequence's part of a step (drawn in the guide):

    - `k` pending tokens (accepted, not yet cached) at positions `p - k + 1 .. p`, causal among themselves;
    - window level `l`, column `i` at `p + 1 + l + i`, seeing level 0 up to its column and its own column's levels
      1..l: a contiguous history of positions `p + 1 .. p + 1 + l + i`;
    - tree nodes at `p + depth`, each seeing its ancestors.

    Every token sees the pending tokens; the window and the tree never see each other.

    Args:
        window (`int`): W, columns of the window.
        levels (`int`): N - 1, its levels.
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
        """The part of `pending` tokens (the last at `position`), the window's guesses (`None`: none) and `tree`."""
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

        # Built on the host and moved once: one torch call per piece costs more than the whole construction.
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
    Lays out a step of `generate`'s loop: every row's part padded to one length, with masks over the shared cache
    (hiding each row's padding and unused slots, and on sliding layers the keys a window or more back).

    Args:
        window (`int`): W, columns of the window.
        levels (`int`): N - 1, its levels.
        groups (`dict[str, AttentionGroup]` or `AttentionGroup`): one mask per layer type, or one for all.
        dtype (`torch.dtype`): the additive masks' dtype (the model's).
        device (`torch.device`): where the step tensors live.
        mask_format (`str`): `"additive"` or `"block"` (flex attention).
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
        """The layout for `model`'s attention backend and the layer types of `cache` (created)."""
        groups = attention_groups(cache, layer_types(model))
        mask_format = MASK_FORMATS[attention_implementation(model)]
        return cls(window, levels, groups, model.dtype, model.device, mask_format)

    def candidates(self, tree: TokenTree, window_allowed: bool, pending: int) -> tuple[TokenTree, bool]:
        """What of a row's candidates and window a step holds: all of them (`ChainLayout` holds one path)."""
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
        holey: HoleySlots | None = None,
    ) -> StepInputs:
        """
        Pads the rows' parts to one length and builds the masks over the cache and the step.

        Args:
            cache (`Cache`): asked for each group's key/value length and offset.
            rows (`list[RowStep]`): one part per row, in batch order.
            slot_valid (`torch.BoolTensor` of shape `(batch, cache_length)`, *optional*): `SlotMap.valid`, for
                full-attention layers (sliding layers keep each row's tokens last, so positions give their masks).
            fixed_length (`int`, *optional*): the length every multi-token step is padded to (compiled passes).
            seq_length (`Callable[[int], int]`, *optional*): the tokens a layer holds, known on the host.
            holey (`HoleySlots`, *optional*): how sliding and chunked layers see each row's slots, for prompts whose
                masks have zeros after real tokens.
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
                # A lone token sees everything before it: the model's own mask, as in plain decoding, is cheaper.
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
            cache, seq_length or cache.get_seq_length, visible, positions, slot_valid, holey
        )
        return StepInputs(input_ids, positions, attention_mask, logits_rows, row_logits)

    def _attention_mask(
        self,
        cache,
        held: Callable[[int], int],
        visible: torch.Tensor,
        positions: torch.Tensor,
        slot_valid: torch.BoolTensor | None,
        holey: HoleySlots | None = None,
    ) -> torch.Tensor | BlockMask | dict[str, torch.Tensor | BlockMask]:
        if isinstance(self.groups, AttentionGroup):
            return self._mask(cache, held, self.groups, visible, positions, slot_valid, holey)
        return {
            name: self._mask(cache, held, group, visible, positions, slot_valid, holey)
            for name, group in self.groups.items()
        }

    def _rows(self, rows: list[int]) -> torch.LongTensor:
        return self._last_row if rows == [0] else torch.tensor(rows, device=self.device)

    def _mask(
        self,
        cache,
        held: Callable[[int], int],
        group: AttentionGroup,
        visible: torch.Tensor,
        positions: torch.Tensor,
        slot_valid: torch.BoolTensor | None,
        holey: HoleySlots | None,
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
                # step starts with the sequence's first token not in the cache: slot j is `past - j` slots before it,
                # as if at position `first - past + j`; negative for left padding.
                cached = positions[:, :1] - past + torch.arange(past, device=self.device)
                hidden = cached < 0 if holey is None else ~holey.valid(past)
                mask[:, :, :past].masked_fill_(hidden[:, None, :], self.min_value)
            kv_positions = torch.cat([cached, positions], dim=1)
            if group.chunked:
                # Chunks start after the left padding and count every slot after it, holes too.
                shift = 0 if holey is None else holey.shift
                chunk = (positions + shift) // group.sliding_window
                too_far = chunk[:, :, None] != ((kv_positions + shift) // group.sliding_window)[:, None, :]
            else:
                too_far = positions[:, :, None] - kv_positions[:, None, :] >= group.sliding_window
            mask[:, :, : past + length].masked_fill_(too_far, self.min_value)
        elif slot_valid is not None and past:
            mask[:, :, :past].masked_fill_(~slot_valid[:, None, -past:], self.min_value)
        if self.mask_format == "block":
            return block_mask(mask == 0)
        return mask[:, None]


def padded_length(length: int, buckets: tuple[int, ...] | int) -> int:
    """The shortest of `buckets` holding `length` (the longest if none does), or the next multiple of an int."""
    if isinstance(buckets, int):
        return -(-length // buckets) * buckets
    return next((bucket for bucket in buckets if bucket >= length), buckets[-1])


def generate_position_shift(model: PreTrainedModel) -> int | None:
    """
    How `generate` numbers a model's positions, so steps number them alike: `None` where the model numbers them by
    cache slot itself (its forward or `prepare_inputs_for_generation` takes none: Whisper's decoder as a causal LM,
    Exaone 4.5); else what that preparation adds (0; 1 for PaliGemma).
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
    """The flex attention `BlockMask` letting each query see the keys `allowed` (`(batch, queries, keys)`) marks."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, length, kv_length = allowed.shape

    def mask_mod(b, h, q_idx, kv_idx):
        return allowed[b, q_idx, kv_idx]

    return create_block_mask(mask_mod, batch, None, length, kv_length, device=allowed.device)
