"""
Lookahead decoding inside Transformers' continuous batching (`generate_batch`, `init_continuous_batching`).

Each decoding request contributes a block instead of one token: its pending token, window and candidates
(`RowLayout.row`), masked over its own paged KV. The step verifies every request on its own, moves the accepted
entries into place in its pages and gives back the pages past them. Prefill, scheduling and requests joining and
leaving stay Transformers' own. The processor and model runner that run the step, and the page moves, are in
`engine_compatibility.py`; `LookaheadBatching` reads the scheduler's request states and writes the positions and
masks of the batch Transformers prepared.
"""

from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor
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
from transformers.generation.continuous_batching.requests import (
    RequestState,
    RequestStatus,
)
from transformers.utils import logging

from .adaptive_planner import AdaptivePlanner
from .adaptive_policy import batch_step_length
from .compatibility import attention_implementation
from .configuration_lookahead import LookaheadConfig
from .cost_measurement import model_key
from .cost_model import EngineStepCost, StepCostModel, padded_step_cost, padded_table
from .engine_compatibility import (
    PER_REQUEST_WARPERS,
    LookaheadBatchProcessor,
    ManagerHooks,
    kept_continuous_batching_manager,
    move_accepted_entries,
    release_pages_past,
)
from .lookahead_state import LookaheadState
from .sequence_lookahead import SequenceLookahead, SequenceStep, StepPlanner
from .step_layout import RowLayout
from .token_tree import TokenTree
from .verification import processors_for_row

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

logger = logging.get_logger(__name__)

# The paged-attention backends that take an explicit mask (the flash ones build causal masks from sequence lengths).
MASKED_BACKENDS = ("sdpa", "paged|eager", "eager")
# At most this share of a batch's token budget goes to lookahead blocks while requests wait for their prefill, so
# that speculation never holds new requests back for long.
SHARE_WHILE_REQUESTS_WAIT = 0.5


class LookaheadBatching:
    """
    The lookahead part of a continuous-batching engine, holding every decoding request's lookahead. Each step `plan`
    gives every decoding request its block (before the scheduler budgets and pages it), `lay_out` writes the blocks'
    positions and masks over the batch Transformers prepared, `accept` verifies each request, and `commit` moves the
    accepted KV entries into place. With `"auto"` the step settles on one length per request priced as `requests x
    length` tokens (by the engine's own timed steps once it has some), so a full engine takes one-token steps.

    Args:
        model (`PreTrainedModel`), config (`LookaheadConfig`), generation_config (`GenerationConfig`): the engine's.
        logits_processor (`LogitsProcessorList`): the processors `generate` would build for it.
        state (`LookaheadState`): the carried estimates and the suffix memory.
        cost (`StepCostModel`, *optional*): `"auto"`'s table, measured before the engine switched to paged attention.
        max_batch_tokens (`int`): the engine's token budget per pass.
        query_padding (`int`, *optional*): the multiple the engine pads queries to, where it pads them.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        config: LookaheadConfig,
        generation_config: GenerationConfig,
        logits_processor: LogitsProcessorList,
        state: LookaheadState,
        cost: StepCostModel | None,
        max_batch_tokens: int,
        query_padding: int | None = None,
    ):
        self.logits_processor = logits_processor
        self.state = state
        self.max_batch_tokens = max_batch_tokens
        self.query_padding = query_padding
        self.engine_cost = None
        # Keyed as the model runs in the engine (paged attention): steps of another dtype or thread count, or of
        # the model's own backend, would price these wrongly.
        self.engine_key = model_key(model)
        tuning = state.tuning
        if cost is not None and state.follow_durations:
            self.engine_cost = EngineStepCost(
                cost, tuning.engine_steps_kept, tuning.engine_steps_needed, state.recall_engine_steps(self.engine_key)
            )
        # Query and key tokens of the pass `lay_out` prepared, and the requests it verifies, for `observe_step`.
        self.step_shape: tuple[int, int, int] | None = None
        # A window for one request, priced as the engine pads it; the engine times whole steps itself
        # (`EngineStepCost`), not through the policies' pricing, which `plan` prices per batch.
        window_cost = padded_table(cost, 1, query_padding, max_batch_tokens) if cost and query_padding else None
        do_sample = bool(generation_config.do_sample)
        if config.adaptive:
            self.planner = AdaptivePlanner(
                model, config, state, do_sample, cost, batch_size=None, window_cost=window_cost
            )
        else:
            self.planner = StepPlanner(model, config, do_sample, observer=state.step_observer)
        # Transformers lays out the masks over the paged cache, and `lay_out` fills each block.
        self.layout = RowLayout(self.planner.window_size, config.levels, torch.device("cpu"))
        self.reset()

    def reset(self) -> None:
        """Forgets every request and step (the engine's processor starts afresh)."""
        self.requests: dict[str, SequenceLookahead] = {}
        self.steps: dict[str, SequenceStep] = {}
        self.logits: torch.Tensor | None = None
        self.choices: list[int] = []
        self.logits_rows: dict[str, tuple[int, int]] = {}
        self.moves: list[tuple[str, int, int, int, list[int]]] = []

    # Planning, before the scheduler.

    def plan(self, active: dict[str, RequestState], requests_wait: bool) -> None:
        """
        Gives every decoding request of `active` (the scheduler's) its block for the next step (its
        `tokens_to_process`) within the token budget, or `SHARE_WHILE_REQUESTS_WAIT` of it where `requests_wait`.
        """
        self.steps = {}
        for request_id in [request_id for request_id in self.requests if request_id not in active]:
            del self.requests[request_id]  # cancelled, or failed
        decoding = [
            (request_id, state)
            for request_id, state in active.items()
            if state.status == RequestStatus.DECODING
            and request_id in self.requests
            and state.tokens_to_process == self.requests[request_id].tokens[-1:]
        ]
        if not decoding:
            return
        lookaheads = [self.requests[request_id] for request_id, _ in decoding]
        share = SHARE_WHILE_REQUESTS_WAIT if requests_wait else 1.0
        longest = max(1, int(self.max_batch_tokens * share) // len(decoding))
        # A step of T tokens per request costs what `requests x T` tokens cost: the policies plan with that.
        self.planner.price_batch(len(decoding), self.query_padding, self.max_batch_tokens // len(decoding))
        offers = [lookahead.offer() for lookahead in lookaheads]
        budget = None
        if isinstance(self.planner, AdaptivePlanner):
            lengths = sorted(
                {option.length for offer in offers for option in offer.options if option.length <= longest}
            )
            cached = sum(lookahead.position for lookahead in lookaheads)
            engine_cost = self.engine_cost.for_batch(len(decoding), cached) if self.engine_cost else None
            if engine_cost and self.query_padding:
                engine_cost = padded_step_cost(engine_cost, len(decoding), self.query_padding)
            budget = batch_step_length(offers, engine_cost or self.planner.pricing, tuple(lengths or [1]))
        room = self.max_batch_tokens
        for (request_id, state), lookahead, offer in zip(decoding, lookaheads, offers):
            # Within the step's budget, leaving every request after this one a token.
            fits = min(longest, room - (len(decoding) - len(self.steps) - 1))
            step = lookahead.plan(offer, self.layout, budget, fits)
            step.past = state.position_offset
            room -= step.row.length
            self.steps[request_id] = step
            state.tokens_to_process = list(step.row.tokens)

    def unplan(self, scheduled: set[str], active: dict[str, RequestState]) -> None:
        """Puts back the pending token of the planned requests the scheduler left out of the step."""
        for request_id in [request_id for request_id in self.steps if request_id not in scheduled]:
            step = self.steps.pop(request_id)
            state = active.get(request_id)
            if state is not None:
                state.tokens_to_process = step.sequence.tokens[-1:]

    # Laying out, after Transformers prepared the batch.

    def lay_out(self, inputs_and_outputs: Any) -> list[int]:
        """
        Writes each block's positions and mask over the batch Transformers prepared (causal blocks at consecutive
        positions), and returns the rows whose logits the step needs: every row a block verifies from, and the last
        row of every other request that gets a token.
        """
        io = inputs_and_outputs
        count = len(io.requests_in_batch)
        starts = io.cumulative_seqlens_q[: count + 1].tolist()
        key_starts = {name: seqlens[: count + 1].tolist() for name, seqlens in io.cumulative_seqlens_k.items()}
        rows, self.logits_rows = [], {}
        verified = 0
        for index, future in enumerate(io.requests_in_batch):
            if not future.has_new_token:
                continue
            request_id = future.state.request_id
            start, end = starts[index], starts[index + 1]
            step = self.steps.get(request_id)
            if step is None or step.row.length == 1:
                self.logits_rows[request_id] = (len(rows), 1)
                rows.append(end - 1)
                continue
            row = step.row
            if end - start != row.length:
                raise RuntimeError(
                    f"Request {request_id} was scheduled {end - start} of its {row.length} step tokens."
                )
            io.position_ids[start:end] = row.positions.to(io.position_ids)
            if io.attention_mask is not None:
                hidden = torch.where(row.visible, 0.0, torch.finfo(io.model_dtype).min)
                for name, mask in io.attention_mask.items():
                    key_start = key_starts[name][index] + step.past
                    mask[0, 0, start:end, key_start : key_start + row.length] = hidden.to(mask)
            self.logits_rows[request_id] = (len(rows), len(row.logits_rows))
            rows.extend(start + index for index in row.logits_rows)
            verified += 1
        # A padded step costs what its padded query does.
        self.step_shape = (io.num_q_tokens, max(keys[-1] for keys in key_starts.values()), verified)
        return rows

    def observe_step(self, seconds: float) -> None:
        """Learns the engine's cost from the step `lay_out` prepared, which took `seconds` in all."""
        if self.engine_cost is not None and self.step_shape is not None:
            self.engine_cost.observe(*self.step_shape, seconds)
            self.state.remember_engine_steps(self.engine_key, self.engine_cost.history())
        self.step_shape = None

    # Settling, after the forward pass.

    def accept(
        self, state: RequestState, return_logprobs: bool
    ) -> tuple[SequenceLookahead, SequenceStep | None, bool]:
        """
        Verifies one request's part of the step (`state`, its next token due) and appends what it accepted, with
        log-probabilities where `return_logprobs`; its entries' moves wait for `commit`. Returns the request's
        lookahead, its step (`None` right after its prefill), and whether it finished.
        """
        request_id = state.request_id
        lookahead = self.requests.get(request_id)
        step = self.steps.get(request_id)
        first, count = self.logits_rows[request_id]
        logits, choices = self.logits[first : first + count], self.choices[first : first + count]
        finished = False

        def stop(token: int, raw: torch.Tensor, scores: torch.Tensor) -> bool:
            nonlocal finished
            logprob = float(torch.log_softmax(scores[0], dim=-1)[token]) if return_logprobs else None
            finished = state.update_and_check_completion(token, logprob)
            return finished

        if lookahead is None:
            # Right after its prefill: its lookahead is built from its prompt and this first token, as in `generate`.
            tokens = list(state.initial_tokens) + list(state.generated_tokens)
            remaining = state.max_new_tokens - state.generated_len() if state.max_new_tokens is not None else 1 << 30
            processors = request_processors(self.logits_processor, state.logit_processor_kwargs)
            verifier = self.planner.verifiers([processors_for_row(processors, 0, 1)])[0]
            input_ids = torch.tensor([tokens], device="cpu") if verifier.reads_text else None
            verdict = verifier.verify(logits, TokenTree(), 1, input_ids, remaining, choices)
            tokens.append(verdict.tokens[0])
            stop(verdict.tokens[0], verdict.logits[0], verdict.scores[0])
            limit = len(tokens) - 1 + remaining
            lookahead = self.requests[request_id] = SequenceLookahead(tokens, limit, self.planner, verifier)
        else:
            verified = step is not None and step.row.length > 1
            verdict = lookahead.verify(step if verified else None, logits, choices)
            kept = lookahead.accept(verdict, stop)
            if step is not None:
                lookahead.learn(step, verdict, kept, choices)
            else:
                # A plain one-token step (the scheduler left its block out): the text moved on, nothing was verified.
                lookahead.advance(kept)
            if verified and not finished:
                nodes = verdict.nodes[: kept - 1]
                self.moves.append((request_id, step.past, step.row.length, step.row.tree_start, nodes))
                state.position_offset = step.past + kept
        if finished:
            self.finish(request_id)
        return lookahead, step, finished

    def commit(self, cache: Any) -> None:
        """Moves the step's accepted entries into place, then gives back the pages past what each request kept."""
        move_accepted_entries(cache, self.moves)
        for request_id, past, _, _, nodes in self.moves:
            release_pages_past(cache, request_id, past + 1 + len(nodes))
        self.moves = []

    def finish(self, request_id: str) -> None:
        """Forgets a finished request; what it learnt and its text are kept for later calls (`StepPlanner.finish`)."""
        lookahead = self.requests.pop(request_id, None)
        if lookahead is not None:
            self.planner.finish([lookahead])


class LookaheadContinuousBatchingManager(ManagerHooks):
    """Transformers' `ContinuousBatchingManager` whose batch processor is a `LookaheadBatchProcessor`."""

    def __init__(
        self,
        *args: Any,
        lookahead_config: LookaheadConfig,
        lookahead_state: LookaheadState,
        lookahead_cost: StepCostModel | None,
        **kwargs: Any,
    ):
        self.lookahead_config = lookahead_config
        self.lookahead_state = lookahead_state
        self.lookahead_cost = lookahead_cost
        super().__init__(*args, **kwargs)

    def adopt_processor(self, processor: ContinuousBatchProcessor) -> ContinuousBatchProcessor:
        if isinstance(processor, LookaheadBatchProcessor):
            return processor  # reused, and reset
        runner = processor.model_runner
        lookahead = LookaheadBatching(
            self.model,
            self.lookahead_config,
            self.generation_config,
            self.logit_processor.logits_processor,
            self.lookahead_state,
            self.lookahead_cost,
            processor.max_batch_tokens,
            runner.cb_config.q_padding_interval_size if runner.pad_inputs else None,
        )
        return LookaheadBatchProcessor.adopt(processor, self.model, lookahead)

    def add_request(self, input_ids: list[int], *args: Any, **kwargs: Any) -> str | None:
        """The stock `add_request`, its per-request sampling settings checked first (a `ValueError` names one refused)."""
        request_processors(self.logit_processor.logits_processor, kwargs)
        return super().add_request(input_ids, *args, **kwargs)


def init_continuous_batching_with_lookahead(
    model: PreTrainedModel,
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    workload_hints: Any = None,
) -> ContinuousBatchingManager:
    """
    The model's `init_continuous_batching` (which `generate_batch` calls), whose engine decodes with lookahead when a
    `lookahead_window` is set; the stock manager otherwise. The model needs full-attention layers only and `sdpa` or
    `eager` attention; the engine runs synchronously, compiled or captured where its config asks. Arguments are
    `init_continuous_batching`'s; a `ValueError` names, before anything runs, a setting lookahead cannot serve.
    """
    stock = _class_init_continuous_batching(model)
    generation = generation_config if generation_config is not None else model.generation_config
    config = LookaheadConfig.from_sources(generation or {}, getattr(model, "generation_config", None) or {})
    if config is None or kept_continuous_batching_manager(model) is not None:
        # Off, or a manager kept from an earlier session (`persistent_manager=True`), which the stock method returns.
        return stock(generation_config, continuous_batching_config, workload_hints)
    cb_config = _lookahead_cb_config(model, generation, continuous_batching_config)
    state = getattr(model, "lookahead_state", None) or LookaheadState()
    # Checked and measured while the model still runs its own attention backend (the engine switches `eager` to paged
    # eager), and in a thread that ends: on a CPU, torch's OpenMP workers stay with the thread that ran the passes and would
    # compete with the engine's own.
    cost = None
    with ThreadPoolExecutor(max_workers=1) as measuring:
        # A model that does not compute steps as plain decoding does is refused before the engine starts.
        measuring.submit(state.step_check.refuse_if_failing, model).result()
        if config.adaptive:
            cost = measuring.submit(state.cost_model, model).result()
    if generation.eos_token_id is None:
        # What the stock method sets before building its manager (with a warning): no EOS stops a request.
        logger.warning("`eos_token_id` not set in GenerationConfig. Setting to -1 (disabled).")
        generation.eos_token_id = -1
    # Built as the stock method builds its manager, which resolves the engine's settings and switches the attention
    # backend; the lookahead manager differs only in the processor it builds.
    return LookaheadContinuousBatchingManager(
        model=model,
        generation_config=generation,
        continuous_batching_config=cb_config,
        workload_hints=workload_hints,
        lookahead_config=config,
        lookahead_state=state,
        lookahead_cost=cost,
    )


def _class_init_continuous_batching(model: PreTrainedModel) -> Any:
    """The `init_continuous_batching` of the model's class that this package did not define, bound to the model."""
    for klass in type(model).__mro__:
        method = vars(klass).get("init_continuous_batching")
        if method is not None and not method.__module__.startswith(f"{__package__}."):
            return method.__get__(model, type(model))
    raise TypeError(f"{type(model).__name__} has no `init_continuous_batching` of Transformers'.")


def _lookahead_cb_config(
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
