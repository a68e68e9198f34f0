"""
Lookahead decoding inside Transformers' continuous batching (`generate_batch`, `init_continuous_batching`).

Each decoding request contributes a block instead of one token: its pending token, window and candidates
(`RowLayout.row`), masked over its own paged KV. The step verifies every request on its own, moves the accepted
entries into place in its pages and gives back the pages past them. Prefill, scheduling and requests joining and
leaving stay Transformers' own. Everything that reads or writes the engine's objects (its processor, model runner,
request states, prepared batch, paged cache and config) is in `engine_compatibility.py`; `LookaheadBatching` plans,
verifies and commits from plain values.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation.continuous_batching.continuous_api import (
    ContinuousBatchingManager,
    ContinuousBatchProcessor,
)
from transformers.utils import logging

from .adaptive_planner import AdaptivePlanner
from .adaptive_policy import batch_step_length
from .configuration_lookahead import LookaheadConfig
from .cost_measurement import model_key
from .cost_model import EngineStepCost, StepCostModel, padded_step_cost, padded_table
from .engine_compatibility import (
    LookaheadBatchProcessor,
    ManagerHooks,
    engine_step_budget,
    kept_continuous_batching_manager,
    lookahead_engine_config,
    move_accepted_entries,
    release_pages_past,
    request_processors,
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

    def pending(self, request_id: str) -> list[int] | None:
        """The token a known request decodes from next (its last), or `None` for a request not decoding yet."""
        lookahead = self.requests.get(request_id)
        return None if lookahead is None else lookahead.tokens[-1:]

    def plan(self, active: dict[str, int | None], requests_wait: bool) -> dict[str, list[int]]:
        """
        Gives every decoding request its block for the next step within the token budget, or
        `SHARE_WHILE_REQUESTS_WAIT` of it where `requests_wait`.

        Args:
            active (`dict[str, int | None]`): the engine's active requests, each with the entries it has cached
                where it decodes from its `pending` token this step, else `None`.

        Returns:
            `dict[str, list[int]]`: the tokens each planned request processes.
        """
        self.steps = {}
        for request_id in [request_id for request_id in self.requests if request_id not in active]:
            del self.requests[request_id]  # cancelled, or failed
        decoding = [(request_id, cached) for request_id, cached in active.items() if cached is not None]
        if not decoding:
            return {}
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
        for (request_id, cached), lookahead, offer in zip(decoding, lookaheads, offers):
            # Within the step's budget, leaving every request after this one a token.
            fits = min(longest, room - (len(decoding) - len(self.steps) - 1))
            step = lookahead.plan(offer, self.layout, budget, fits)
            step.past = cached
            room -= step.row.length
            self.steps[request_id] = step
        return {request_id: list(step.row.tokens) for request_id, step in self.steps.items()}

    def unplan(self, scheduled: set[str]) -> dict[str, list[int]]:
        """Drops the planned requests the scheduler left out of the step; returns the pending token of each."""
        left_out = [request_id for request_id in self.steps if request_id not in scheduled]
        return {request_id: self.steps.pop(request_id).sequence.tokens[-1:] for request_id in left_out}

    # Laying out, after Transformers prepared the batch.

    def lay_out(self, blocks: list[tuple[str, int, int]]) -> tuple[list[int], list[tuple[int, SequenceStep]]]:
        """
        The rows whose logits the step needs (every row a block verifies from, and the last row of every other
        request that gets a token), and the blocks whose positions and masks the batch must take.

        Args:
            blocks (`list[tuple[str, int, int]]`): each request that gets a token: its id and its rows in the batch.

        Returns:
            The rows, and `(index in blocks, step)` of each lookahead block (causal blocks at consecutive positions).
        """
        rows, written, self.logits_rows = [], [], {}
        for index, (request_id, start, end) in enumerate(blocks):
            step = self.steps.get(request_id)
            if step is None or step.row.length == 1:
                self.logits_rows[request_id] = (len(rows), 1)
                rows.append(end - 1)
                continue
            if end - start != step.row.length:
                raise RuntimeError(
                    f"Request {request_id} was scheduled {end - start} of its {step.row.length} step tokens."
                )
            written.append((index, step))
            self.logits_rows[request_id] = (len(rows), len(step.row.logits_rows))
            rows.extend(start + row for row in step.row.logits_rows)
        return rows, written

    def observe_step(self, seconds: float, query_tokens: int, key_tokens: int, verified: int) -> None:
        """Learns the engine's cost from a step of that shape, which took `seconds` in all."""
        if self.engine_cost is not None:
            self.engine_cost.observe(query_tokens, key_tokens, verified, seconds)
            self.state.remember_engine_steps(self.engine_key, self.engine_cost.history())

    # Settling, after the forward pass.

    def accept(
        self,
        request_id: str,
        append: Callable[[int, torch.Tensor], bool],
        new: tuple[list[int], int, dict[str, Any]] | None = None,
    ) -> tuple[SequenceLookahead, SequenceStep | None, bool, int | None]:
        """
        Verifies one request's part of the step and appends what it accepted; its entries' moves wait for `commit`.

        Args:
            request_id (`str`): the request.
            append (`Callable[[int, torch.Tensor], bool]`): gives the request a token (with its scores); whether
                the request finished.
            new (`tuple`, *optional*): for a request right after its prefill: its text, the tokens it may still
                generate, and its sampling settings.

        Returns:
            The request's lookahead, its step (`None` right after its prefill), whether it finished, and the entries
            it has cached after the step where they changed.
        """
        lookahead = self.requests.get(request_id)
        step = self.steps.get(request_id)
        first, count = self.logits_rows[request_id]
        logits, choices = self.logits[first : first + count], self.choices[first : first + count]
        finished, cached = False, None

        def stop(token: int, raw: torch.Tensor, scores: torch.Tensor) -> bool:
            nonlocal finished
            finished = append(token, scores)
            return finished

        if lookahead is None:
            # Right after its prefill: its lookahead is built from its prompt and this first token, as in `generate`.
            tokens, remaining, settings = new
            processors = request_processors(self.logits_processor, settings)
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
                cached = step.past + kept
        if finished:
            self.finish(request_id)
        return lookahead, step, finished, cached

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
        lookahead = LookaheadBatching(
            self.model,
            self.lookahead_config,
            self.generation_config,
            self.logits_processor,
            self.lookahead_state,
            self.lookahead_cost,
            *engine_step_budget(processor),
        )
        return LookaheadBatchProcessor.adopt(processor, self.model, lookahead)

    def add_request(self, input_ids: list[int], *args: Any, **kwargs: Any) -> str | None:
        """The stock `add_request`, its per-request sampling settings checked first (a `ValueError` names one refused)."""
        request_processors(self.logits_processor, kwargs)
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
    cb_config = lookahead_engine_config(model, generation, continuous_batching_config)
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
