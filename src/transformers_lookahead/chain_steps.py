"""
Chain steps, for models that cannot take a full lookahead step but compute several consecutive tokens as plain
decoding does (`StepCheck`): the pending tokens and one candidate continuation at consecutive positions, no window.
`ChainLayout` lays them out; `ChainCommitter` rolls back the caches that only chain steps can roll back (running
states of linear-attention and state-space layers, kept before a step and put back when it is undone; indexed
layers, cropped through their own `crop`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from transformers import Cache
from transformers.utils import logging

from .cache_commit import CacheCommitter
from .compatibility import (
    CHAIN_ROLLBACK_LAYERS,
    RECURRENT_LAYERS,
    DynamicLayer,
    crop_attention_part,
    forget_recorded_past,
    recurrent_state_tensors,
)
from .step_layout import AttentionGroup, HoleySlots, RowStep, StepInputs, StepLayout, generate_position_shift
from .token_tree import TokenTree
from .verification import Verdict

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.cache_utils import CacheLayerMixin

logger = logging.get_logger(__name__)

# The longest chain step `chain_failure` checks, and so the longest one `generate` takes.
LONGEST_CHAIN_CHECKED = 16


class ChainLayout(StepLayout):
    """
    Lays out chain steps, for models that compute a pass over several consecutive tokens as plain decoding computes
    them one at a time but cannot take a full step (`StepCheck`): the pending tokens, then one candidate continuation,
    at consecutive positions, no window. The attention mask is the 2D padding mask plain decoding passes (none for
    one unpadded sequence), from which the model builds its own causal, sliding or chunked masks, with any attention
    backend; a model that ignores `position_ids` and numbers tokens by cache slot is then fed exactly as plain
    decoding feeds it, provided every sequence of a batch keeps as many tokens per step (no unused slots).

    Args:
        dtype (`torch.dtype`): the model's dtype.
        device (`torch.device`): where the step tensors live.
        pass_positions (`bool`, *optional*, defaults to `True`): whether steps carry `position_ids`; not for a model
            `generate` leaves to number positions itself (`generate_position_shift`), as plain decoding does.
    """

    def __init__(self, dtype: torch.dtype, device: torch.device, pass_positions: bool = True):
        super().__init__(0, 0, AttentionGroup(0, None), dtype, device)
        self.pass_positions = pass_positions

    @classmethod
    def for_model(
        cls, model: PreTrainedModel, cache: Cache | None = None, window: int = 0, levels: int = 0
    ) -> ChainLayout:
        """The chain layout for `model` (a chain step has no window, so `cache`, `window` and `levels` are unused)."""
        return cls(model.dtype, model.device, pass_positions=generate_position_shift(model) is not None)

    def build(self, cache, rows: list[RowStep], *args, **kwargs) -> StepInputs:
        """
        As `StepLayout.build`, without position ids where the model numbers positions itself. The tokens padding a
        shorter row continue its positions, as the tokens after it: a model that decides what a token sees by
        position (an attention indexer choosing its keys) then finds them after it, as the 2D mask has them.
        """
        step = super().build(cache, rows, *args, **kwargs)
        if not self.pass_positions:
            return replace(step, position_ids=None)
        shorter = [b for b, row in enumerate(rows) if row.length < step.length]
        if not shorter:
            return step
        # No further than a position some row takes in this step (a table of learned positions ends somewhere);
        # kept on the device, so that laying a step out never waits for it.
        furthest = torch.stack([row.positions[-1] for row in rows]).max()
        for b in shorter:
            row = rows[b]
            after = torch.arange(1, step.length - row.length + 1, device=self.device)
            step.position_ids[b, row.length :] = torch.minimum(row.positions[-1] + after, furthest)
        return step

    def candidates(self, tree: TokenTree, window_allowed: bool, pending: int) -> tuple[TokenTree, bool]:
        """One candidate path (`TokenTree.chain`), no window, at most `LONGEST_CHAIN_CHECKED` tokens in all."""
        return tree.subtree(tree.chain()[: max(0, LONGEST_CHAIN_CHECKED - pending)]), False

    def even_out(self, verdicts: list[Verdict]) -> list[Verdict]:
        """
        Every row keeps as many tokens, the shortest verdict's: chain steps leave positions to the model, which may
        number them by cache slot, so no row may leave a slot unused (any prefix of a verdict is plain decoding's).
        """
        if len(verdicts) < 2:
            return verdicts
        shortest = min(len(verdict.tokens) for verdict in verdicts)
        return [verdict.truncated(shortest) for verdict in verdicts]

    def row(self, pending: list[int], position: int, window_tokens: list[int] | None, tree: TokenTree) -> RowStep:
        """A chain step's row: `pending` and `tree`, which must be a single path, and no window."""
        if window_tokens is not None or any(parent != node - 1 for node, parent in enumerate(tree.parents)):
            raise ValueError("A chain step holds one candidate continuation (a single path) and no window.")
        return super().row(pending, position, None, tree)

    def _attention_mask(
        self,
        cache,
        held: Callable[[int], int],
        visible: torch.Tensor,
        positions: torch.Tensor,
        slot_valid: torch.BoolTensor | None,
        holey: HoleySlots | None = None,
    ) -> torch.LongTensor | None:
        # The model builds its own masks from the 2D padding mask, holes and sliding windows included.
        if slot_valid is None:
            return None
        # Tokens padding a shorter row come after its own: causal masking already hides them from it.
        step = torch.ones(positions.shape, dtype=torch.long, device=self.device)
        return torch.cat([slot_valid.long(), step], dim=1)


class RecurrentStates:
    """
    The running states of a cache's linear-attention and state-space layers (convolution and recurrent states),
    kept before a chain step so that the step can be undone: such a layer keeps one state, not an entry per token,
    so the state after a step's rejected tokens cannot be cropped back to the accepted ones. A step that keeps every
    token it fed keeps the state; any other is undone (`restore`), and its accepted tokens are fed again.

    Args:
        layers (`list`): the cache's layers among `RECURRENT_LAYERS`.
    """

    def __init__(self, layers: list):
        self.layers = layers
        self._kept: list[dict] | None = None

    def save(self) -> None:
        """Keeps a copy of every layer's state (before a step)."""
        self._kept = []
        for layer in self.layers:
            kept = {}
            for name, value in recurrent_state_tensors(layer).items():
                if isinstance(value, dict):
                    kept[name] = {index: clone(tensor) for index, tensor in value.items()}
                else:
                    kept[name] = clone(value)
            self._kept.append(kept)

    def restore(self) -> None:
        """Puts back the states `save` kept, in the tensors the layers hold where shapes allow (static addresses)."""
        if self._kept is None:
            raise RuntimeError("A step was undone without its recurrent states kept before it (`save`).")
        for layer, kept in zip(self.layers, self._kept):
            for name, value in kept.items():
                held = getattr(layer, name)
                if isinstance(value, dict):
                    for index, tensor in value.items():
                        if (
                            isinstance(tensor, torch.Tensor)
                            and isinstance(held[index], torch.Tensor)
                            and (held[index].shape == tensor.shape)
                        ):
                            held[index].copy_(tensor)
                        else:
                            held[index] = tensor
                else:
                    held.copy_(value)
        self.forget_past()

    def forget_past(self) -> None:
        """After a step, kept or undone: layers recording their past drop what only a `crop` would have used."""
        for layer in self.layers:
            forget_recorded_past(layer)
        self._kept = None

    def nbytes(self) -> int:
        """The bytes a `save` copies."""
        total = 0
        for layer in self.layers:
            for value in recurrent_state_tensors(layer).values():
                for tensor in value.values() if isinstance(value, dict) else [value]:
                    total += tensor.nbytes if isinstance(tensor, torch.Tensor) else 0
        return total


def clone(value):
    """A copy of a state tensor (other values as they are)."""
    return value.clone() if isinstance(value, torch.Tensor) else value


def chain_only_layers(cache: Cache) -> list[str]:
    """
    The kinds of `cache`'s layers that only chain steps can roll back (recurrent layers, indexed layers), by class
    name, each once; empty when full steps can.
    """
    kinds = []
    for layer in cache.layers:
        kind = type(layer).__name__
        if type(layer) in RECURRENT_LAYERS + CHAIN_ROLLBACK_LAYERS and kind not in kinds:
            kinds.append(kind)
    return kinds


def chain_only_reason(owner: str, cache: Cache) -> str | None:
    """Why `owner`, holding `cache`, takes chain steps only (`chain_only_layers`), or `None`."""
    kinds = chain_only_layers(cache)
    if not kinds:
        return None
    recurrent = [kind for kind in kinds if "LinearAttention" in kind]
    why = []
    if recurrent:
        why.append(
            f"its {', '.join(recurrent)} layers keep one running state (linear attention, state space) instead of an "
            "entry per token and read a step's tokens in order, so a step's branches cannot sit side by side in one "
            "pass"
        )
    if len(recurrent) < len(kinds):
        indexed = [kind for kind in kinds if kind not in recurrent]
        why.append(
            f"its {', '.join(indexed)} layers keep an indexer's keys beside their own, which a step's entry moves "
            "would not move"
        )
    return f"`{owner}` cannot take full lookahead steps: {'; '.join(why)}."


class ChainCommitter(CacheCommitter):
    """
    A `CacheCommitter` for the layers only chain steps can roll back. Linear-attention and state-space layers keep
    one running state, not an entry per token, so a step whose every fed token is kept keeps the new states, and any
    other step is undone: the states are put back, the attention entries of the step cropped, and the accepted tokens
    fed again (their entries are kept whole, "gather"). Indexed layers crop their indexer's keys with their own `crop`.

    Indexed (top-k sparse) attention attends to every key while a query sees at most `index_topk` of them, and to the
    top-k an indexer scores once it sees more, which a step's queries would choose among other keys than plain
    decoding's: steps then stay within `index_topk` keys, so past that context they are one token long.

    Args:
        cache (`Cache`), strategy (`str`), owner (`str`): as for `CacheCommitter`.
        index_topk (`int`, *optional*): the keys an indexed layer's query attends to at most (its config's).
    """

    def __init__(
        self, cache: Cache, strategy: str = "gather", owner: str = "The model", index_topk: int | None = None
    ):
        super().__init__(cache, strategy, owner)
        indexed = [index for index, layer in enumerate(cache.layers) if type(layer) in CHAIN_ROLLBACK_LAYERS]
        self.index_topk = index_topk if indexed else None
        self._indexed_layer = indexed[0] if indexed else None
        self.owner = owner
        recurrent = [layer for layer in cache.layers if type(layer) in RECURRENT_LAYERS]
        # `None` without recurrent layers: nothing to keep before a step.
        self.states = RecurrentStates(recurrent) if recurrent else None
        if self.states is not None:
            self.strategy = "gather"

    @staticmethod
    def takes(layer: CacheLayerMixin) -> bool:
        return CacheCommitter.takes(layer) or type(layer) in RECURRENT_LAYERS + CHAIN_ROLLBACK_LAYERS

    def room(self) -> int | None:
        """`CacheCommitter.room`, and within `index_topk` keys (at least the one token plain decoding feeds)."""
        room = super().room()
        if self.index_topk is None:
            return room
        within = self.index_topk - self.seq_length(self._indexed_layer)
        if within < 2:
            logger.warning_once(
                f"{self.owner}'s indexed attention attends to the top {self.index_topk} keys its indexer scores, "
                "which a lookahead step's queries would score among other keys than plain decoding's: past "
                f"{self.index_topk} tokens of context, lookahead decodes one token per step, as plain decoding does."
            )
        return within if room is None else min(room, within)

    def before_step(self, feeds_guesses: bool) -> None:
        """Keeps the recurrent states where the step feeds tokens that may not be kept."""
        if self.states is not None and feeds_guesses:
            self.states.save()

    def keep(self, step_length: int, kept_rows: list[list[int]]) -> tuple[int, bool]:
        if not self._keeps_whole(step_length, kept_rows):
            self.undo(step_length)
            return 0, True
        return self.commit(step_length, kept_rows), False

    def _keeps_whole(self, step_length: int, kept_rows: list[list[int]]) -> bool:
        """Whether the step can be kept: without recurrent states any part of it, with them every token it fed."""
        return self.states is None or all(rows == list(range(step_length)) for rows in kept_rows)

    def undo(self, step_length: int) -> None:
        """Drops the whole step, recurrent states put back."""
        super().undo(step_length)
        if self.states is not None:
            self.states.restore()

    def commit(self, step_length: int, kept_rows: list[list[int]]) -> int:
        if not self._keeps_whole(step_length, kept_rows):
            raise RuntimeError("A step that did not keep every token it fed must be undone (`undo`) on this cache.")
        added = super().commit(step_length, kept_rows)
        if self.states is not None:
            self.states.forget_past()
        return added

    @staticmethod
    def _crop(layer: CacheLayerMixin, tokens_to_remove: int) -> None:
        """A layer's `crop`; a recurrent hybrid layer's attention part alone (`RecurrentStates` keeps its state)."""
        if type(layer) in RECURRENT_LAYERS:
            if isinstance(layer, DynamicLayer):
                crop_attention_part(layer, tokens_to_remove)
        else:
            CacheCommitter._crop(layer, tokens_to_remove)


def committer_for(
    cache: Cache, strategy: str = "gather", owner: str = "The model", index_topk: int | None = None
) -> CacheCommitter:
    """
    The committer of `cache`: a `ChainCommitter` where it holds layers only chain steps can roll back, its steps within
    `index_topk` keys where some of them are indexed.
    """
    if chain_only_layers(cache):
        return ChainCommitter(cache, strategy, owner, index_topk)
    return CacheCommitter(cache, strategy, owner)


def index_topk(model: PreTrainedModel) -> int | None:
    """The keys an indexed attention layer of `model` attends to at most (`index_topk`), if it has such layers."""
    return getattr(model.config.get_text_config(decoder=True), "index_topk", None)
