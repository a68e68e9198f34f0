"""
Transformers' continuous-batching engine (`transformers.generation.continuous_batching`) as the lookahead engine
reaches it, in one place: the processor, model runner and manager it takes over (`LookaheadBatchProcessor` and
`LookaheadModelRunner` run a step's lookahead blocks, which `continuous_batching.LookaheadBatching` plans and
verifies from plain values), the request states and prepared batch they read and write, the paged-cache moves of a
step, the engine settings lookahead needs, and the request settings its warpers read. A release that changes one
breaks here, and `tests/test_compatibility.py` says which one moved.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.continuous_batching import cb_logits_processors
from transformers.generation.continuous_batching.cache import group_layers_by_attn_type
from transformers.generation.continuous_batching.continuous_api import (
    ContinuousBatchingManager,
    ContinuousBatchProcessor,
)
from transformers.generation.continuous_batching.model_runner import ModelRunner
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestState, RequestStatus

from .compatibility import attention_implementation
from .step_forward import logits_at
from .verification import read_choices

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

# The paged-attention backends that take an explicit mask (the flash ones build causal masks from sequence lengths).
MASKED_BACKENDS = ("sdpa", "paged|eager", "eager")
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

    @property
    def logits_processor(self) -> LogitsProcessorList:
        """The processors the engine applies (per-request warpers among them, `per_request_processors=True`)."""
        return self.logit_processor.logits_processor


def engine_step_budget(processor: ContinuousBatchProcessor) -> tuple[int, int | None]:
    """The engine's token budget per pass, and the multiple it pads queries to where it pads them."""
    runner = processor.model_runner
    return processor.max_batch_tokens, runner.cb_config.q_padding_interval_size if runner.pad_inputs else None


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


@dataclass
class LookaheadGenerationOutput(GenerationOutput):
    """
    `GenerationOutput` of continuous batching, plus what lookahead did for the request.

    Args:
        accepted_per_step (`list[int]`): tokens the request accepted at each of its forward passes after the prefill
            (1 for a step that verified nothing).
    """

    accepted_per_step: list[int] = field(default_factory=list)


class LookaheadModelRunner(ModelRunnerHooks):
    """
    Transformers' `ModelRunner` for an engine that pads its steps (compiled, or captured CUDA graphs): logits rows and
    logits live in buffers allocated once at the token budget (`max_batch_tokens x vocabulary` in the model's
    dtype), so a padded shape is one graph whatever its blocks hold; the padding intervals are the steps' buckets.
    """

    rows: torch.LongTensor
    logits: torch.Tensor

    @classmethod
    def adopt(cls, runner: ModelRunnerHooks, model: PreTrainedModel, max_batch_tokens: int) -> LookaheadModelRunner:
        runner = taken_over(runner, cls)
        head = model.get_output_embeddings()
        vocabulary = head.weight.shape[0] if head is not None else model.config.get_text_config().vocab_size
        runner.rows = torch.zeros(max_batch_tokens, dtype=torch.long, device=model.device)
        runner.logits = torch.empty(max_batch_tokens, vocabulary, dtype=model.dtype, device=model.device)
        runner.compile_step_function()
        return runner

    def step_function(self, model: torch.nn.Module, batch_data: dict) -> None:
        # Rows and logits as long as the padded query, so that the shape the engine keys its graphs on fixes both;
        # the engine's own sampling is left out: each request is verified on the host.
        length = batch_data["input_ids"].shape[1]
        rows = self.rows[:length]
        self.logits[:length].copy_(logits_at(model, batch_data, rows, "logits_to_keep" in batch_data)[0])

    def run(self, model: torch.nn.Module, batch_data: dict, rows: list[int]) -> torch.Tensor:
        """Runs one step whose logits are needed at `rows`, and returns them."""
        length = batch_data["input_ids"].shape[1]
        self.rows[:length].copy_(torch.tensor(rows + [0] * (length - len(rows)), dtype=torch.long))
        stream = self.inputs_and_outputs.compute_stream
        if stream is not None:
            # The engine runs the step on a stream of its own; the blocks' positions and masks and the rows were
            # written on this one.
            stream.wait_stream(torch.get_device_module(model.device).current_stream())
        self.compute_batch(model, batch_data)
        self.inputs_and_outputs.retrieve_device_outputs()
        return self.logits[: len(rows)]


class LookaheadBatchProcessor(BatchProcessorHooks):
    """
    Transformers' `ContinuousBatchProcessor` whose steps carry lookahead blocks, `adopt`ed from the one Transformers
    built: scheduling, paging, offloading, prefix sharing and cancellation stay the stock code.
    """

    # `continuous_batching.LookaheadBatching`, which imports this module.
    lookahead: Any

    @classmethod
    def adopt(
        cls, processor: ContinuousBatchProcessor, model: PreTrainedModel, lookahead: Any
    ) -> LookaheadBatchProcessor:
        processor = taken_over(processor, cls)
        processor.lookahead = lookahead
        runner = processor.model_runner
        if runner.pad_inputs:
            processor.model_runner = LookaheadModelRunner.adopt(runner, model, lookahead.max_batch_tokens)
        processor.step_rows = None
        processor.step_shape = None
        processor.step_started = 0.0
        return processor

    def reset(self) -> None:
        super().reset()
        self.lookahead.reset()

    def prepare_next_batch(self) -> bool:
        # A step is priced whole (`EngineStepCost`): from here, planning, to `update_batch`'s last cache move.
        self.step_started = time.perf_counter()
        active = self.scheduler.active_requests
        decoding = {
            request_id: state.position_offset
            if state.status == RequestStatus.DECODING and state.tokens_to_process == self.lookahead.pending(request_id)
            else None
            for request_id, state in active.items()
        }
        planned = self.lookahead.plan(decoding, requests_wait=bool(self.scheduler.waiting_requests))
        for request_id, tokens in planned.items():
            active[request_id].tokens_to_process = tokens
        ready = super().prepare_next_batch()
        batch = self.inputs_and_outputs.requests_in_batch if ready else []
        for request_id, tokens in self.lookahead.unplan({future.state.request_id for future in batch}).items():
            if request_id in active:
                active[request_id].tokens_to_process = tokens
        if ready:
            self.step_rows = self._lay_out()
        return ready

    def _lay_out(self) -> list[int]:
        """Writes each lookahead block's positions and mask over the batch Transformers prepared; the logits rows."""
        io = self.inputs_and_outputs
        count = len(io.requests_in_batch)
        starts = io.cumulative_seqlens_q[: count + 1].tolist()
        key_starts = {name: seqlens[: count + 1].tolist() for name, seqlens in io.cumulative_seqlens_k.items()}
        given = [(index, future) for index, future in enumerate(io.requests_in_batch) if future.has_new_token]
        blocks = [(future.state.request_id, starts[index], starts[index + 1]) for index, future in given]
        rows, written = self.lookahead.lay_out(blocks)
        for block, step in written:
            index = given[block][0]
            _, start, end = blocks[block]
            io.position_ids[start:end] = step.row.positions.to(io.position_ids)
            if io.attention_mask is not None:
                hidden = torch.where(step.row.visible, 0.0, torch.finfo(io.model_dtype).min)
                for name, mask in io.attention_mask.items():
                    key_start = key_starts[name][index] + step.past
                    mask[0, 0, start:end, key_start : key_start + step.row.length] = hidden.to(mask)
        # A padded step costs what its padded query does.
        self.step_shape = (io.num_q_tokens, max(keys[-1] for keys in key_starts.values()), len(written))
        return rows

    @torch.no_grad()
    def forward_step(self, model: torch.nn.Module) -> None:
        rows = self.step_rows
        if isinstance(self.model_runner, LookaheadModelRunner):
            batch = self.inputs_and_outputs.get_model_kwargs(use_padding=True)
            logits = self.model_runner.run(model, batch, rows)
        else:
            batch = self.inputs_and_outputs.get_model_kwargs(use_padding=False)
            rows = torch.tensor(rows, dtype=torch.long, device=batch["input_ids"].device)
            batch["logits_indices"] = rows
            logits = logits_at(model, batch, rows, self.model_runner.supports_logits_to_keep(model))[0]
        # Kept in the model's dtype: verification converts only the rows its walk reads, as in `generate`. The
        # choices at every row reach the host in the step's one transfer.
        self.lookahead.logits = logits
        self.lookahead.choices = read_choices(logits)

    def update_batch(self) -> None:
        settled = []
        for future in self.inputs_and_outputs.requests_in_batch:
            state = future.state
            if state.status in (RequestStatus.FINISHED, RequestStatus.PENDING):
                raise RuntimeError(f"Tried to update {state.status.name} request {state.request_id} in sync mode.")
            if future.has_new_token:
                if state.generated_len() == 0:
                    state.status = RequestStatus.DECODING
                settled.append((future, *self._accept(state)))
            elif state.status == RequestStatus.PREFILLING:
                self.cache.mark_complete_blocks(state, future.complete_blocks)
        self.lookahead.commit(self.cache)
        outputs = []
        for future, lookahead, step, finished in settled:
            state = future.state
            if step is not None and step.row.length > 1:
                mark_kept_blocks(self.cache, state, step.past)
            else:
                self.cache.mark_complete_blocks(state, future.complete_blocks)
            if finished:
                self.scheduler.finish_request(state.request_id)
                self.scheduler.block_new_requests = False
            if state.streaming or finished:
                output = state.to_generation_output()
                outputs.append(LookaheadGenerationOutput(**vars(output), accepted_per_step=list(lookahead.accepted)))
        # The step's choices were read on the host, so the device's work is done by now.
        if self.step_shape is not None:
            self.lookahead.observe_step(time.perf_counter() - self.step_started, *self.step_shape)
            self.step_shape = None
        if outputs:
            self.output_router.deliver_batch(outputs)

    def _accept(self, state: RequestState) -> tuple[Any, Any, bool]:
        """Verifies one request's part of the step (`LookaheadBatching.accept`) and updates its request state."""

        def append(token: int, scores: torch.Tensor) -> bool:
            logprob = float(torch.log_softmax(scores[0], dim=-1)[token]) if self.return_logprobs else None
            return state.update_and_check_completion(token, logprob)

        new = None
        if self.lookahead.pending(state.request_id) is None:
            remaining = state.max_new_tokens - state.generated_len() if state.max_new_tokens is not None else 1 << 30
            new = ([*state.initial_tokens, *state.generated_tokens], remaining, state.logit_processor_kwargs)
        lookahead, step, finished, cached = self.lookahead.accept(state.request_id, append, new)
        if cached is not None:
            state.position_offset = cached
        return lookahead, step, finished


def lookahead_engine_config(
    model: PreTrainedModel, generation_config: GenerationConfig, cb_config: ContinuousBatchingConfig | None
) -> ContinuousBatchingConfig:
    """Checks what lookahead needs of the engine, and returns the engine's config with those settings fixed."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    cb_config = copy.deepcopy(cb_config) if cb_config is not None else ContinuousBatchingConfig()
    problems = []
    attention = attention_implementation(model)
    if attention not in MASKED_BACKENDS:
        problems.append(
            f"an attention backend that takes an explicit mask ({', '.join(MASKED_BACKENDS)}), got "
            f"attn_implementation={attention!r}: load the model with attn_implementation='sdpa'"
        )
    layer_groups = set(group_layers_by_attn_type(model.config.get_text_config()))
    if layer_groups != {"full_attention"}:
        problems.append(f"full-attention layers only, got {sorted(layer_groups)}")
    if cb_config.scheduler_type != "fifo":
        problems.append(f"scheduler_type='fifo' (decoding requests scheduled first), got {cb_config.scheduler_type!r}")
    if cb_config.use_async_batching:
        problems.append("use_async_batching=False (a step's accepted tokens decide the next step's inputs)")
    if (generation_config.num_return_sequences or 1) > 1:
        problems.append(f"num_return_sequences=1, got {generation_config.num_return_sequences}")
    if getattr(model, "tp_size", None) and model.tp_size > 1:
        problems.append("a model on one device (tensor parallelism is not supported here yet)")
    if problems:
        raise ValueError(
            "Lookahead decoding inside continuous batching needs " + "; ".join(problems) + ". Or set "
            '`lookahead_window="off"` in the generation config for plain continuous batching.'
        )
    cb_config.use_async_batching = False
    # The stock engine would switch sdpa to a flash kernel where one is installed; those take no mask.
    cb_config.auto_switch_to_flash = False
    return cb_config


def request_processors(processors: LogitsProcessorList, settings: dict[str, Any]) -> LogitsProcessorList:
    """
    The processors one request is verified with: the engine's, its per-request temperature / top-k / top-p warpers
    (`per_request_processors=True`) replaced by the stock warper with the request's `settings` value.
    """
    own = LogitsProcessorList()
    for processor in processors:
        if isinstance(processor, cb_logits_processors.ContinuousBatchingLogitsProcessor):
            name = PER_REQUEST_WARPERS.get(type(processor).__name__)
            if name is None:
                raise ValueError(
                    f"Lookahead decoding verifies each request with its own {', '.join(PER_REQUEST_WARPERS.values())}"
                    f" only, got the per-request processor {type(processor).__name__}: set "
                    "per_request_processors=False in the continuous batching config."
                )
            value = settings.get(name, getattr(processor, name))
            if name == "temperature":
                processor = TemperatureLogitsWarper(value)
            elif name == "top_k":
                processor = TopKLogitsWarper(value, processor.filter_value, processor.min_tokens_to_keep)
            else:
                processor = TopPLogitsWarper(value, processor.filter_value, processor.min_tokens_to_keep)
        own.append(processor)
    return own
