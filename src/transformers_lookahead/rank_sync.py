"""Keeping the ranks of a tensor-parallel model on the same decisions, step after step."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .compatibility import tensor_parallel_group

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_MASK_63 = (1 << 63) - 1


class RankSync:
    """
    Under tensor parallelism every forward pass runs collectives that all ranks must enter with tensors of one shape,
    and lookahead chooses each step's shape, so every rank must choose the same step. What is measured per process
    is agreed once per call (rank 0's cost table and carried estimates, `agree`; step times do not steer the plan);
    the rest follows from the tokens, which are the same on every rank. Before every step and after the last, one
    all-reduce of the step's fingerprint (`check`) makes every rank raise the same error where one planned otherwise,
    instead of hanging in a collective.

    Args:
        group (`torch.distributed.ProcessGroup`): the tensor-parallel group.
        device (`torch.device`): where the group's backend takes tensors (the model's device).
    """

    def __init__(self, group: Any, device: torch.device):
        self.group = group
        self.device = device if dist.get_backend(group) != "gloo" else torch.device("cpu")
        self.rank = dist.get_rank(group)
        self.source = dist.get_global_rank(group, 0)

    @classmethod
    def for_model(cls, model: PreTrainedModel) -> RankSync | None:
        """The sync of a tensor-parallel model, `None` for a model on one device."""
        group = tensor_parallel_group(model)
        return None if group is None else cls(group, model.device)

    def agree(self, value: Any) -> Any:
        """Rank 0's `value` (any picklable object), on every rank."""
        objects = [value]
        device = self.device if self.device.type != "cpu" else None
        dist.broadcast_object_list(objects, src=self.source, group=self.group, device=device)
        return objects[0]

    def check(self, step: int, fingerprint: int) -> None:
        """
        Confirms that every rank is about to take the same step (`fingerprint`, 0 for none: generation is over) after
        `step` forward passes; raises `RuntimeError` on every rank if any rank's differs.
        """
        value = fingerprint & _MASK_63
        extremes = torch.tensor([value, -value], dtype=torch.long, device=self.device)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=self.group)
        largest, smallest = int(extremes[0]), -int(extremes[1])
        if largest != smallest:
            raise RuntimeError(
                f"Lookahead decoding diverged between tensor-parallel ranks before forward pass {step + 1}: the ranks "
                f"planned different steps (this is rank {self.rank}). Every rank must run the same `generate` call "
                "with the same inputs, settings and seed; a stopping criterion that depends on the process (such "
                "as `max_time`) can stop one rank and not another. Stopped on every rank instead of hanging in the "
                "next collective."
            )
