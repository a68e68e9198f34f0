"""
Transformers' continuous-batching engine (`transformers.generation.continuous_batching`) as the lookahead engine
reaches it, in one place: the processor, model runner and manager methods it overrides, the paged-cache moves of a
step, and the request settings its warpers read. A release that changes one breaks here, and
`tests/test_compatibility.py` says which one moved.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers.generation.continuous_batching.continuous_api import (
    ContinuousBatchingManager,
    ContinuousBatchProcessor,
)
from transformers.generation.continuous_batching.model_runner import ModelRunner

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.generation.continuous_batching.requests import RequestState

# Transformers' per-request warpers (`per_request_processors=True`, as `transformers serve --continuous-batching`
# sets), and the request setting each reads.
PER_REQUEST_WARPERS = {
    "ContinuousBatchingTemperatureLogitsWarper": "temperature",
    "ContinuousBatchingTopKLogitsWarper": "top_k",
    "ContinuousBatchingTopPLogitsWarper": "top_p",
}


class BatchProcessorHooks(ContinuousBatchProcessor):
    """
    Transformers' `ContinuousBatchProcessor`, whose forward step (`_generation_step`) a subclass replaces by
    overriding `forward_step`.
    """

    def _generation_step(self, model: torch.nn.Module) -> None:
        self.forward_step(model)

    def forward_step(self, model: torch.nn.Module) -> None:
        """Runs the batch through `model` (Transformers' own step unless overridden)."""
        super()._generation_step(model)


class ModelRunnerHooks(ModelRunner):
    """
    Transformers' continuous-batching `ModelRunner`, whose step function (`_forward_process_and_sample`: what the
    engine compiles with its `varlen_compile_config` and captures as a CUDA graph with `use_cuda_graph`) a subclass
    replaces by overriding `step_function`; `compute_batch` then runs it compiled, captured or plain as the engine
    was configured.
    """

    def _forward_process_and_sample(
        self,
        model: torch.nn.Module,
        batch_data: dict,
        carry_over_ids: torch.Tensor,
        prev_output_ids: torch.Tensor,
        output_ids: torch.Tensor,
    ) -> None:
        self.step_function(model, batch_data)

    def step_function(self, model: torch.nn.Module, batch_data: dict) -> None:
        """One forward pass over `batch_data` (Transformers' forward, processing and sampling unless overridden)."""
        super()._forward_process_and_sample(model, batch_data, *self.inputs_and_outputs.get_cb_kwargs())

    def compile_step_function(self) -> None:
        """Compiles `step_function` as Transformers compiled its own in `__init__` (bound before the subclass)."""
        if self.cb_config.varlen_compile_config is not None:
            self._compiled_varlen = torch.compile(
                self._forward_process_and_sample, **self.cb_config.varlen_compile_config.to_dict()
            )
        if self.cb_config.decode_compile_config is not None:
            self._compiled_decode = torch.compile(
                self._forward_process_and_sample, **self.cb_config.decode_compile_config.to_dict()
            )


class ManagerHooks(ContinuousBatchingManager):
    """
    Transformers' `ContinuousBatchingManager`, whose batch processor (`_create_batch_processor`) a subclass takes
    over by overriding `adopt_processor`.
    """

    def _create_batch_processor(self) -> ContinuousBatchProcessor:
        return self.adopt_processor(super()._create_batch_processor())

    def adopt_processor(self, processor: ContinuousBatchProcessor) -> ContinuousBatchProcessor:
        """The processor the engine runs, given the one Transformers built (that one unless overridden)."""
        return processor


def taken_over(instance: Any, cls: type) -> Any:
    """
    A new instance of `cls`, a subclass of the Transformers class `instance` was built as that adds no state of its
    own to what `__init__` set, holding `instance`'s attributes; `instance` itself is left as it was, and the caller
    uses the new one in its place. Transformers builds the engine's processor and model runner each inside one
    method, with a dozen collaborators; taking those over keeps every one of them as Transformers made it.
    """
    base = next(klass for klass in cls.__mro__ if klass.__module__.startswith("transformers."))
    if not isinstance(instance, base):
        raise TypeError(f"{cls.__name__} extends {base.__name__}, not {type(instance).__name__}.")
    adopted = object.__new__(cls)
    adopted.__dict__.update(vars(instance))
    return adopted


def kept_continuous_batching_manager(model: PreTrainedModel) -> Any | None:
    """The manager a `persistent_manager=True` session left on the model (`_cached_continuous_batching_manager`)."""
    return getattr(model, "_cached_continuous_batching_manager", None)


def move_accepted_entries(cache: Any, moves: list[tuple[str, int, int, int, list[int]]]) -> None:
    """
    Copies each request's accepted tree entries to the positions right after its pending token, in every layer.

    Args:
        cache (`PagedAttentionCache`): the engine's cache.
        moves (`list[tuple]`): per request: its id, its pending token's position, its step length, the index in its
            step of the first tree node, and the accepted nodes (top down).
    """
    for allocator in cache.cache_allocators.values():
        source, target = [], []
        for request_id, past, length, tree_start, nodes in moves:
            slots = allocator.get_write_indices(request_id, past, length)
            for depth, node in enumerate(nodes, start=1):
                if tree_start + node != depth:
                    source.append(slots[tree_start + node])
                    target.append(slots[depth])
        if not source:
            continue
        device = allocator.cache_tensor.device
        source_index = torch.tensor(source, dtype=torch.long, device=device)
        target_index = torch.tensor(target, dtype=torch.long, device=device)
        for layer_idx in allocator.layer_indices:
            for view in allocator._kv_token_views[layer_idx]:
                view.index_copy_(0, target_index, view.index_select(0, source_index))


def release_pages_past(cache: Any, request_id: str, length: int) -> None:
    """Gives back a request's pages past its first `length` positions (a step allocated pages for all its tokens)."""
    for allocator in cache.cache_allocators.values():
        table = allocator.block_table.get(request_id)
        keep = -(-length // allocator.tokens_per_page)
        if table is None or len(table) <= keep:
            continue
        spare = table[keep:]
        del table[keep:]
        cache.pool.free_blocks(allocator.index, [block for block in spare if allocator.ledger.release(block, True)])


def mark_kept_blocks(cache: Any, state: RequestState, past: int) -> None:
    """Registers for prefix sharing the pages a step completed with accepted entries only (not the whole step's)."""
    kept_length = state.position_offset
    complete = {}
    for name, allocator in cache.cache_allocators.items():
        page = allocator.tokens_per_page
        count = kept_length // page - past // page
        if count > 0:
            complete[name] = count
    if complete:
        cache.mark_complete_blocks(state, complete)
