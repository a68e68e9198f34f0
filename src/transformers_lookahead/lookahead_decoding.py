"""The lookahead decoding loop, usable as `model.generate(..., custom_generate=transformers_lookahead.generate)`."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerateEncoderDecoderOutput

from .auto_tuning import AUTO_TUNING, AutoTuning
from .cache_commit import CacheCommitter
from .compatibility import can_auto_compile, pad_token_id, prefill, processors_for_row
from .configuration_lookahead import (
    LookaheadConfig,
    validate_lookahead_setup,
)
from .cost_model import COST_GRID, StepCostModel, StepPricing
from .lookahead_state import LookaheadState
from .rank_sync import RankSync
from .sequence_lookahead import LookaheadFactory, SequenceLookahead, learn_from_step, offer_candidates
from .step_check import LONGEST_CHAIN_CHECKED
from .step_forward import StepForward, max_positions, select_rows
from .step_layout import ChainLayout, RowStep, StepLayout, generate_position_shift
from .step_policy import (
    PolicyEstimates,
    StepChoice,
    StepOffer,
    batch_step_length,
    choose_window,
)
from .verification import GreedyVerifier, PositionNoise, SamplingVerifier, Verdict, read_choices

if TYPE_CHECKING:
    from transformers import GenerationConfig, PreTrainedModel
    from transformers.generation.streamers import BaseStreamer


# Used when lookahead is requested through `custom_generate` without any `lookahead_window`.
DEFAULT_WINDOW = "auto"


@dataclass
class LookaheadDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """
    `GenerateDecoderOnlyOutput` plus what lookahead decoding did.

    Args:
        num_forward_passes (`int`): forward passes of the model, the prefill included (one per step for the whole
            batch).
        accepted_per_step (`tuple[int]` or `tuple[tuple[int]]`): tokens added to the sequence by each decoding step
            after the prefill; for a batch of several rows, one such tuple per row (rows that finish early have
            fewer steps).
    """

    num_forward_passes: int | None = None
    accepted_per_step: tuple[int, ...] | tuple[tuple[int, ...], ...] | None = None


@dataclass
class LookaheadEncoderDecoderOutput(GenerateEncoderDecoderOutput):
    """
    `GenerateEncoderDecoderOutput` plus what lookahead decoding did, one row per sequence (Whisper's `generate`
    splits every output field by batch row).

    Args:
        num_forward_passes (`torch.LongTensor` of shape `(batch_size,)`): decoder forward passes each sequence took
            part in, the prefill included.
        accepted_per_step (`torch.LongTensor` of shape `(batch_size, steps)`): tokens each decoding step after the
            prefill added to each sequence; 0 after a sequence finished.
    """

    num_forward_passes: torch.LongTensor | None = None
    accepted_per_step: torch.LongTensor | None = None


def generate(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    synced_gpus: bool = False,
    lookahead_window: int | str | None = None,
    lookahead_ngram: int | str | None = None,
    lookahead_guess: int | str | None = None,
    lookahead_pool_from_prompt: bool | None = None,
    lookahead_cache_commit: str | None = None,
    lookahead_memory: bool | None = None,
    lookahead_memory_size: int | None = None,
    lookahead_memory_namespace: str | None = None,
    lookahead_config: LookaheadConfig | None = None,
    lookahead_state: LookaheadState | None = None,
    lookahead_streamer: BaseStreamer | None = None,
    lookahead_assistant_model: PreTrainedModel | None = None,
    **model_kwargs: Any,
) -> LookaheadDecoderOnlyOutput | LookaheadEncoderDecoderOutput | torch.LongTensor:
    r"""
    Generates with lookahead decoding: each step runs one forward pass that both advances a Jacobi window of guesses
    and verifies candidate n-grams from a pool, then accepts every verified token plus one. Greedy output is the
    output of plain greedy decoding and sampled output follows the distribution of plain sampling, with the same
    logits processors, warpers and stopping criteria.

    `generate` calls this after preparing the inputs, either as a `custom_generate` callable
    (`model.generate(..., custom_generate=transformers_lookahead.generate, lookahead_window=7)`) or through
    `LookaheadGenerationMixin`. Settings come from `lookahead_config`, else from the `lookahead_*` arguments, else
    from the `generation_config` fields of the same names.

    Args:
        model (`PreTrainedModel`): a decoder-only model whose attention applies custom 4D masks, or an
            encoder-decoder model whose decoder also takes position ids (Whisper).
        input_ids (`torch.LongTensor` of shape `(batch_size, prompt_length)`): the prompts (for encoder-decoder
            models, the decoder's), left-padded as `generate` expects (the padding is read from
            `model_kwargs["attention_mask"]`, for encoder-decoder models `model_kwargs["decoder_attention_mask"]`).
        logits_processor (`LogitsProcessorList`): processors applied to every accepted position.
        stopping_criteria (`StoppingCriteriaList`): checked after every accepted token.
        generation_config (`GenerationConfig`): the resolved generation config.
        synced_gpus (`bool`, *optional*, defaults to `False`): unsupported, must be False.
        lookahead_window, lookahead_ngram, lookahead_guess, lookahead_pool_from_prompt, lookahead_cache_commit,
        lookahead_memory, lookahead_memory_size, lookahead_memory_namespace (*optional*): the `LookaheadConfig`
            fields of the same names (`window`, `ngram`, ...). Named here because Transformers passes a
            `custom_generate` callable only the keyword arguments its signature names.
        lookahead_config (`LookaheadConfig`, *optional*): the settings, already resolved (what
            `LookaheadGenerationMixin` passes); the `lookahead_*` arguments above are then ignored.
        lookahead_state (`LookaheadState`, *optional*): what earlier calls on this model learnt; defaults to
            `model.lookahead_state` (set by `enable_lookahead`), else a new state for this call only.
        lookahead_streamer (`BaseStreamer`, *optional*): receives the prompt, then every accepted chunk.
        lookahead_assistant_model (`PreTrainedModel`, *optional*): only checked, to refuse assisted decoding.
        model_kwargs: the model keyword arguments `generate` prepared, the cache among them.

    Returns:
        `torch.LongTensor` of shape `(batch_size, length)` (finished rows padded with `pad_token_id`, as plain
        `generate` pads them), or `LookaheadDecoderOnlyOutput` (`LookaheadEncoderDecoderOutput` for encoder-decoder
        models) if `generation_config.return_dict_in_generate=True`.
    """
    config = lookahead_config
    if config is None:
        arguments = {
            "lookahead_window": lookahead_window,
            "lookahead_ngram": lookahead_ngram,
            "lookahead_guess": lookahead_guess,
            "lookahead_pool_from_prompt": lookahead_pool_from_prompt,
            "lookahead_cache_commit": lookahead_cache_commit,
            "lookahead_memory": lookahead_memory,
            "lookahead_memory_size": lookahead_memory_size,
            "lookahead_memory_namespace": lookahead_memory_namespace,
        }
        config = LookaheadConfig.from_sources(arguments, generation_config, default_window=DEFAULT_WINDOW)
        if config is None:
            raise ValueError(
                '`lookahead_window="off"` turns lookahead decoding off, but `custom_generate=transformers_lookahead.'
                "generate` is the lookahead decoding loop: remove `custom_generate` to decode without lookahead."
            )
    validate_lookahead_setup(model, generation_config, model_kwargs, lookahead_assistant_model)
    if synced_gpus:
        raise ValueError("Lookahead decoding does not support `synced_gpus=True`.")
    if lookahead_streamer is not None and input_ids.shape[0] > 1:
        raise ValueError(
            f"Streaming supports one sequence; got a batch of {input_ids.shape[0]} rows (input rows x "
            "`num_return_sequences`). With lookahead the rows advance by different numbers of tokens per step, so "
            "there is no per-step token column to stream: generate the rows one at a time to stream them."
        )
    if lookahead_state is None:
        lookahead_state = getattr(model, "lookahead_state", None) or LookaheadState()
    cache = model_kwargs.get("cache")
    if model.config.is_encoder_decoder:
        forward = StepForward(model, cache, model_kwargs["encoder_outputs"], model_kwargs.get("attention_mask"))
    else:
        forward = StepForward(model, cache)
    committer = CacheCommitter(forward.decoder_cache, config.cache_commit, type(model).__name__)
    chain = False
    if not model.config.is_encoder_decoder:
        # After the cache's own checks, before anything runs the model for this call (the prefill, or measuring the
        # cost table for "auto").
        attention_mask = model_kwargs.get("attention_mask")
        padded = attention_mask is not None and not bool(attention_mask.all())
        chain = lookahead_state.step_check.refuse_if_failing(model, padded, chain_steps=True)
        # The check classifies the layers of the model's default cache; a call's own cache decides too.
        chain = chain or committer.chain_only
    decoder = LookaheadDecoder(
        model,
        config,
        logits_processor,
        stopping_criteria,
        generation_config,
        committer,
        forward,
        input_ids.shape[0],
        lookahead_state,
        chain,
    )
    return decoder.run(input_ids, model_kwargs, lookahead_streamer)


class SequenceText:
    """
    One sequence's text, as gpt-fast keeps it: a buffer on the model's device, preallocated for the longest text
    and holding the row's left padding, and the length in use (`input_ids`, a view, is what processors, stopping
    criteria and the output read). `tokens` mirrors the text past the padding as host integers, for the host-side
    parts; `append` and `truncate` change both.

    Args:
        row (`torch.LongTensor` of shape `(1, length)`): the sequence as plain `generate` holds it (padding included).
        tokens (`list[int]`): the same sequence without its padding.
        capacity (`int`): the longest the sequence may grow (`max_length`).
    """

    def __init__(self, row: torch.LongTensor, tokens: list[int], capacity: int):
        self.buffer = row.new_empty((1, max(capacity, row.shape[1])))
        self.buffer[:, : row.shape[1]] = row
        self.length = row.shape[1]
        self.tokens = tokens

    @property
    def input_ids(self) -> torch.LongTensor:
        """The sequence so far, shape `(1, length)`: a view of the buffer."""
        return self.buffer[:, : self.length]

    def append(self, token: int) -> None:
        self.buffer[0, self.length] = token
        self.length += 1
        self.tokens.append(token)

    def truncate(self, length: int) -> None:
        """Cuts the sequence to `length` tokens (padding included)."""
        if length < self.length:
            del self.tokens[len(self.tokens) - (self.length - length) :]
            self.length = length


class SequenceState(SequenceLookahead):
    """
    One sequence of the batch: its lookahead (`SequenceLookahead`), its text with the row's padding, and what
    `generate` returns of it. `length` and `limit` count the padding.

    Args:
        index (`int`): the sequence's row in the batch `generate` was called with.
        text (`SequenceText`): its text.
        limit (`int`): the length the sequence may not exceed.
        parts: its pool, window, policy, context index and verifier, as `SequenceLookahead` takes them
            (`LookaheadFactory.parts`, then the verifier).
    """

    def __init__(self, index: int, text: SequenceText, limit: int, *parts: Any):
        super().__init__(text.tokens, limit, *parts)
        self.index = index
        self.text = text
        self.stopped_at: int | None = None
        self.done = False
        self.scores: list[torch.Tensor] = []
        self.raw_logits: list[torch.Tensor] = []

    @property
    def length(self) -> int:
        return self.text.length


@dataclass
class StepPlan:
    """
    One sequence's part of the next step.

    Args:
        sequence (`SequenceState`): the sequence.
        choice (`StepChoice`): what its policy chose from what was offered (the policy learns from all of it).
        row (`RowStep`): the sequence's tokens, positions and visibility in the step, and where its outputs are.
    """

    sequence: SequenceState
    choice: StepChoice
    row: RowStep


class TokenStoppingCriteria:
    """
    `generate`'s default stopping criteria (`MaxLengthCriteria`, `EosTokenCriteria`), decided on the host from a
    sequence's length and its last token: lookahead checks them after every accepted token, and the criteria list
    builds tensors at every call.

    Args:
        max_length (`int` or `None`): `MaxLengthCriteria.max_length`.
        eos_token_ids (`set[int]`): `EosTokenCriteria.eos_token_id`'s tokens.
        max_position_embeddings (`int` or `None`): past this length `MaxLengthCriteria` logs a warning, so the
            criteria themselves decide there.
    """

    def __init__(self, max_length: int | None, eos_token_ids: set[int], max_position_embeddings: int | None):
        self.max_length = max_length
        self.eos_token_ids = eos_token_ids
        self.max_position_embeddings = max_position_embeddings

    @classmethod
    def of(cls, criteria: StoppingCriteriaList) -> TokenStoppingCriteria | None:
        """The host form of `criteria`, or `None` unless each criterion is exactly one of the two default classes."""
        if any(type(criterion) not in (MaxLengthCriteria, EosTokenCriteria) for criterion in criteria):
            return None
        max_length = max_position_embeddings = None
        eos_token_ids: set[int] = set()
        for criterion in criteria:
            if isinstance(criterion, MaxLengthCriteria):
                max_length = criterion.max_length if max_length is None else min(max_length, criterion.max_length)
                if criterion.max_position_embeddings is not None:
                    max_position_embeddings = criterion.max_position_embeddings
            else:
                eos_token_ids.update(torch.as_tensor(criterion.eos_token_id).reshape(-1).tolist())
        return cls(max_length, eos_token_ids, max_position_embeddings)

    def __call__(self, length: int, token: int) -> bool | None:
        """
        Whether the criteria fire on a sequence of `length` tokens (padding included) that ends with `token`, or
        `None` where the criteria list must be asked instead.
        """
        if self.max_position_embeddings is not None and length > self.max_position_embeddings:
            return None
        return token in self.eos_token_ids or (self.max_length is not None and length >= self.max_length)


class LookaheadDecoder:
    """
    The decoding loop of one `generate` call.

    Every sequence of the batch has its own window, pool, policy and acceptance; one forward pass per step serves
    all of them, each sequence's step padded to the longest. The cache is shared: after a step every sequence gets
    as many new slots as the sequence that accepted the most, and `slot_valid` records which slots hold a token of
    which sequence (left padding and unused slots do not), so every later mask hides the others. Finished
    sequences leave the batch (`Cache.batch_select_indices`), so they stop costing compute.

    Args:
        model (`PreTrainedModel`): the model.
        config (`LookaheadConfig`): the step shape.
        logits_processor (`LogitsProcessorList`): applied to every accepted position.
        stopping_criteria (`StoppingCriteriaList`): checked after every accepted token.
        generation_config (`GenerationConfig`): the resolved generation config.
        committer (`CacheCommitter`): keeps the accepted tokens in the (self-attention) cache.
        forward (`StepForward`): runs a step through the model.
        batch_size (`int`, *optional*, defaults to 1): rows of the batch (after `num_return_sequences`).
        state (`LookaheadState`, *optional*): what earlier calls on the model learnt; a new one if unset.
        chain (`bool`, *optional*, defaults to `False`): decode in chain steps (`ChainLayout`): for a model that
            computes consecutive tokens as plain decoding does but cannot take a full step (`StepCheck`).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        config: LookaheadConfig,
        logits_processor: LogitsProcessorList,
        stopping_criteria: StoppingCriteriaList,
        generation_config: GenerationConfig,
        committer: CacheCommitter,
        forward: StepForward,
        batch_size: int = 1,
        state: LookaheadState | None = None,
        chain: bool = False,
    ):
        self.model = model
        self.chain = chain
        self.config = config
        self.logits_processor = logits_processor
        self.stopping_criteria = stopping_criteria
        self.generation_config = generation_config
        self.committer = committer
        self.forward = forward
        self.state = state if state is not None else LookaheadState()
        tuning = self.state.tuning
        # Tensor-parallel ranks must take identical steps (see `RankSync`); `None` on one device.
        self.sync = RankSync.for_model(model)
        if config.adaptive:
            # The cost table is per model, not per batch: an encoder-decoder model is timed over one input.
            first_input = None
            if forward.is_encoder_decoder:
                first_input = select_rows(forward.encoder_outputs, torch.tensor([0], device=model.device))
            self.cost = self.state.cost_model(model, encoder_outputs=first_input, chain=chain)
            if self.sync is not None:
                self.cost = self.sync.agree(self.cost)
            batch_cost = self.cost.for_batch(batch_size)
            self.window_size = choose_window(batch_cost, config.levels, tuning)
            # One pricing for the batch: every row's step costs what the batch's step costs.
            self.pricing = StepPricing(batch_cost, self.follows_durations, tuning)
        else:
            self.window_size = config.window
            self.pricing = None
        # Models with learned absolute positions cannot embed positions past this; guesses stop short of it.
        self.max_positions = max_positions(model)
        self.position_shift = generate_position_shift(model)
        return_dict = generation_config.return_dict_in_generate
        self.keep_scores = return_dict and generation_config.output_scores
        self.keep_logits = return_dict and generation_config.output_logits
        # As in plain decoding: with an EOS criterion a finished sequence is padded; without one, a sequence whose
        # criteria fired keeps generating until every sequence's have.
        self.has_eos = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)
        self.token_stops = TokenStoppingCriteria.of(stopping_criteria)
        self._carried: dict[tuple, PolicyEstimates | None] = {}
        # Earlier calls' text, whose continuations the steps also verify; this call's is added when it ends.
        self.memory = None
        if config.memory:
            self.memory = self.state.memory(model, config.memory_namespace, config.memory_size)
        self.factory = LookaheadFactory(
            config,
            self.window_size,
            bool(generation_config.do_sample),
            self._carried_estimates,
            self.memory,
            self.pricing,
            tuning,
        )

    @property
    def follows_durations(self) -> bool:
        """Whether `"auto"` learns from step durations: not where the state says so, nor on tensor-parallel ranks."""
        return self.sync is None and self.state.follow_durations

    def run(
        self,
        input_ids: torch.LongTensor,
        model_kwargs: dict[str, Any],
        streamer: BaseStreamer | None,
    ) -> LookaheadDecoderOnlyOutput | LookaheadEncoderDecoderOutput | torch.LongTensor:
        """Prefills the prompts, then runs steps until every sequence has stopped."""
        if streamer is not None:
            streamer.put(input_ids.cpu())
        sequences, slot_valid = self._prefill(input_ids, model_kwargs, streamer)
        self.committer.start()
        self._choose_forward(model_kwargs)
        layout = (ChainLayout if self.chain else StepLayout).for_model(
            self.model, self.committer.cache, self.window_size, self.config.levels
        )
        forward_passes = 1
        active = [sequence for sequence in sequences if not sequence.done]
        if active and len(active) < len(sequences):
            slot_valid = self._keep_running(active, sequences, slot_valid)
        # Recurrent states cannot keep part of a step: its entries are kept whole ("gather") or the step is undone.
        recurrent = self.committer.states is not None
        strategy = "gather" if recurrent else self.config.cache_commit
        refeed, observer = strategy == "refeed", self.state.step_observer
        while True:
            plans = self._plan(active, layout) if active else []
            if self.sync is not None:
                # Every rank takes this step, or stops here, together.
                self.sync.check(forward_passes, step_fingerprint(plans))
            if not plans:
                break
            rows = [plan.row for plan in plans]
            step = layout.build(self.committer.cache, rows, slot_valid, self._bucket(plans), self.committer.seq_length)
            self.committer.before_step(feeds_guesses=any(row.pending_length < step.length for row in rows))
            started = time.perf_counter()
            logits = self.forward(step)
            forward_passes += 1
            # The step's one device-to-host transfer: the model's choice at every row it kept.
            choices = read_choices(logits)
            row_choices = [step.choices_of(b, choices) for b in range(len(plans))]
            verdicts = [self._verify(plan, step.logits_of(b, logits), row_choices[b]) for b, plan in enumerate(plans)]
            if self.chain and len(plans) > 1:
                # Chain steps leave positions to the model, which may number them by cache slot: every row keeps as
                # many tokens (any prefix of a verdict is plain decoding's), so no row has an unused slot.
                shortest = min(len(verdict.tokens) for verdict in verdicts)
                verdicts = [verdict.truncated(shortest) for verdict in verdicts]
            verdicts = [(verdict, self._keep(plan, verdict, streamer)) for plan, verdict in zip(plans, verdicts)]
            # The choices reached the host, so on accelerators too the step has finished here.
            elapsed = time.perf_counter() - started
            kept_rows = [
                plan.row.kept_rows(verdict.nodes[: kept - 1], strategy)
                for plan, (verdict, kept) in zip(plans, verdicts)
            ]
            # A recurrent state holds every token the step fed: unless every row keeps them all, the step is undone
            # and its accepted tokens are fed again.
            undone = recurrent and any(rows != list(range(step.length)) for rows in kept_rows)
            if undone:
                self.committer.undo(step.length)
            else:
                slot_valid = self._commit(step.length, kept_rows, slot_valid)
            for plan, (verdict, kept), choices_of_row in zip(plans, verdicts, row_choices):
                learn_from_step(
                    plan.sequence,
                    plan.choice,
                    plan.row,
                    verdict,
                    kept,
                    choices_of_row,
                    self.config,
                    refeed,
                    observer,
                    undone=undone,
                )
            if self.pricing is not None and self.pricing.timed:
                self.pricing.observe(step.length, elapsed)
            active, slot_valid = self._settle(sequences, active, slot_valid)

        if streamer is not None:
            streamer.end()
        if self.config.adaptive:
            estimates = self.factory.estimates([sequence.policy for sequence in sequences])
            self.state.remember(self.factory.estimates_key(sequences[0].policy), estimates)
        if self.memory is not None:
            self.state.add_to_memory(self.config.memory_namespace, [sequence.tokens for sequence in sequences])
        return self._outputs(sequences, forward_passes, slot_valid)

    def _prefill(
        self, input_ids: torch.LongTensor, model_kwargs: dict[str, Any], streamer: BaseStreamer | None
    ) -> tuple[list[SequenceState], torch.BoolTensor | None]:
        """Runs the prompts through the model, appends each sequence's first token and equips the sequences."""
        attention_mask = model_kwargs.get(
            "decoder_attention_mask" if self.forward.is_encoder_decoder else "attention_mask"
        )
        outputs = prefill(self.model, input_ids, self.generation_config, model_kwargs)
        first = outputs.logits[:, -1].to(dtype=torch.float32, copy=True)
        del outputs
        rows = input_ids.shape[0]
        # Every row has its processors to itself from the first token on: some keep state per batch row.
        processors = [processors_for_row(self.logits_processor, index, rows) for index in range(rows)]
        first_scores = torch.cat([processors[i](input_ids[i : i + 1], first[i : i + 1]) for i in range(rows)])
        noises = None
        if self.generation_config.do_sample:
            # One seed per sequence from torch's generator: `torch.manual_seed` fixes the call's text.
            seeds = torch.randint(0, 2**62, (input_ids.shape[0],), dtype=torch.int64, device="cpu").tolist()
            noises = [PositionNoise(seed) for seed in seeds]
            first_tokens = [
                noise.sample(first_scores[index], input_ids.shape[1]) for index, noise in enumerate(noises)
            ]
        else:
            first_tokens = first_scores.argmax(-1).tolist()

        slot_valid = self._initial_slots(input_ids, attention_mask)
        sequences = []
        for index in range(input_ids.shape[0]):
            row = input_ids[index : index + 1]
            tokens = row[0].tolist() if slot_valid is None else row[0, slot_valid[index]].tolist()
            padding = row.shape[1] - len(tokens)
            limit = self.generation_config.max_length
            text = SequenceText(row, tokens, limit)
            appended = text.length < limit
            if appended:
                text.append(first_tokens[index])
            # Built from the prompt and its first token, as every later step sees the text.
            verifier = GreedyVerifier(processors[index])
            if noises is not None:
                verifier = SamplingVerifier(processors[index], noises[index])
            sequence = self._new_sequence(index, text, limit, verifier)
            sequence.position_offset = padding if self.position_shift is None else self.position_shift
            if appended:
                self._record(sequence, first[index : index + 1], first_scores[index : index + 1])
            sequences.append(sequence)
        self._stream(streamer, sequences[0], 1)
        self._mark_finished(sequences)
        return sequences, slot_valid

    def _new_sequence(self, index: int, text: SequenceText, limit: int, verifier: GreedyVerifier) -> SequenceState:
        """A sequence with its own pool, window and policy, seeded from its text, and its `verifier`."""
        return SequenceState(index, text, limit, *self.factory.parts(text.tokens), verifier)

    def _carried_estimates(self, key: tuple) -> PolicyEstimates | None:
        """What the last call of this kind left for a policy of this shape; rank 0's under tensor parallelism."""
        if key not in self._carried:
            learnt = self.state.recall(key)
            self._carried[key] = learnt if self.sync is None else self.sync.agree(learnt)
        return self._carried[key]

    def _plan(self, active: list[SequenceState], layout: StepLayout) -> list[StepPlan]:
        """
        Chooses each sequence's part of the step: whether its window runs, and its candidates. The forward pass costs
        what the longest part costs, so with the adaptive policy a batch first settles on one length that maximises
        the expected tokens of all rows per unit of cost, and every row then verifies as much as fits in it.
        """
        offers = [self._offer(sequence) for sequence in active]
        room = self.committer.room()
        budget = None
        adapts = active[0].policy.adapts
        if self.buckets is not None:
            # A compiled forward pass knows a few step shapes: one token, and each bucket length that fits the cache.
            fitting = tuple(length for length in self.buckets if room >= length)
            if not fitting:
                budget = 1
            elif adapts:
                budget = batch_step_length(offers, self.pricing, (1, *fitting))
        elif adapts and len(active) > 1:
            budget = batch_step_length(offers, self.pricing)
        plans = []
        for sequence, offer in zip(active, offers):
            if budget == 1:
                choice = StepChoice(offer, False, offer.tree.subtree([]))
            else:
                choice = sequence.policy.plan(offer, budget)
            use_window, tree = choice.use_window, choice.tree
            pending = offer.pending
            if room is not None:
                # A static cache has room for `room` more entries: the step must fit, the window first to go.
                if use_window and pending + len(sequence.window) + len(tree) > room:
                    use_window = False
                if pending + len(tree) > room:
                    tree = tree.subtree(list(range(room - pending)))
            if use_window != choice.use_window or tree is not choice.tree:
                # Trimmed to fit: no longer the choice its prediction was made for, so it does not calibrate.
                choice = replace(choice, use_window=use_window, tree=tree, predicted=0.0)
            window_tokens = sequence.window.flat() if use_window else None
            row = layout.row(sequence.pending, sequence.position, window_tokens, tree)
            plans.append(StepPlan(sequence, choice, row))
        return plans

    def _offer(self, sequence: SequenceState) -> StepOffer:
        chain = LONGEST_CHAIN_CHECKED if self.chain else None
        return offer_candidates(sequence, self.factory.sources, self.max_positions, chain)

    @staticmethod
    def _verify(plan: StepPlan, logits: torch.Tensor, choices: list[int]) -> Verdict:
        """Verifies one sequence's part of the step."""
        sequence = plan.sequence
        return sequence.verifier.verify(
            logits,
            plan.choice.tree,
            plan.row.tree_row,
            sequence.text.input_ids,
            sequence.limit - sequence.length,
            choices,
        )

    def _keep(self, plan: StepPlan, verdict: Verdict, streamer: BaseStreamer | None) -> int:
        """
        Appends what one sequence accepted; returns how many of its tokens were kept (fewer where a stopping
        criterion or the length limit fired inside the chunk).
        """
        kept = self._append(plan.sequence, verdict)
        self._stream(streamer, plan.sequence, kept)
        return kept

    def _commit(
        self, step_length: int, kept_rows: list[list[int]], slot_valid: torch.BoolTensor | None
    ) -> torch.BoolTensor | None:
        """Keeps each sequence's accepted entries in the cache; returns the slot map with the step's new slots."""
        added = self.committer.commit(step_length, kept_rows)
        if slot_valid is None:
            return None
        kept_counts = torch.tensor([len(rows) for rows in kept_rows], device=slot_valid.device)
        new_slots = torch.arange(added, device=slot_valid.device)[None, :] < kept_counts[:, None]
        return torch.cat([slot_valid, new_slots], dim=1)

    def _settle(
        self, sequences: list[SequenceState], active: list[SequenceState], slot_valid: torch.BoolTensor | None
    ) -> tuple[list[SequenceState], torch.BoolTensor | None]:
        """Marks finished sequences and drops them from the batch; returns the sequences still running."""
        self._mark_finished(sequences)
        running = [sequence for sequence in active if not sequence.done]
        if running and len(running) < len(active):
            slot_valid = self._keep_running(running, active, slot_valid)
            if self.config.adaptive:
                # A smaller batch makes each extra token per row cheaper again.
                self.pricing.use_table(self.cost.for_batch(len(running)))
        return running, slot_valid

    def _initial_slots(
        self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None
    ) -> torch.BoolTensor | None:
        """Which cache slots hold a token of each row after the prefill; `None` for one unpadded row."""
        if input_ids.shape[0] == 1 and attention_mask is None:
            return None
        if self.committer.is_static and input_ids.shape[0] > 1:
            raise ValueError(
                "Batched lookahead decoding leaves unused cache slots where rows accept fewer tokens, which a "
                f"static cache sized for plain decoding cannot hold; got a batch of {input_ids.shape[0]} rows with "
                "a static cache. Use the default dynamic cache for batches, or one row per call."
            )
        if attention_mask is None:
            return torch.ones(input_ids.shape, dtype=torch.bool, device=input_ids.device)
        return attention_mask.bool()

    def _choose_forward(self, model_kwargs: dict[str, Any]) -> None:
        """
        Compiles the step forward pass where plain decoding would compile its own (a static cache on an accelerator,
        or a `compile_config` that asks for it): multi-token steps are then padded to one of a few bucket lengths, so
        the compiled function sees one shape per bucket and one for a single token, in every call.
        """
        model, generation_config = self.model, self.generation_config
        self.buckets = None
        if not self.committer.is_static or not can_auto_compile(model, model_kwargs, generation_config):
            return
        self.forward.compile(generation_config.compile_config)
        longest = self.config.max_step_length(self.window_size)
        self.buckets = compiled_buckets(self.cost, longest, self.state.tuning) if self.config.adaptive else (longest,)

    def _bucket(self, plans: list[StepPlan]) -> int | None:
        """The length a compiled step is padded to: the shortest bucket that holds its longest row."""
        if self.buckets is None:
            return None
        length = max(plan.row.length for plan in plans)
        if length == 1:
            return None
        # Planning keeps steps within the buckets; a longer one fails in the layout rather than compiling anew.
        return next((bucket for bucket in self.buckets if bucket >= length), self.buckets[-1])

    def _keep_running(
        self, running: list[SequenceState], batch: list[SequenceState], slot_valid: torch.BoolTensor
    ) -> torch.BoolTensor:
        """Drops finished sequences from the cache, so the next steps compute only the running ones."""
        keep = torch.tensor([batch.index(sequence) for sequence in running], device=slot_valid.device)
        self.forward.select(keep)
        return slot_valid[keep]

    def _append(self, sequence: SequenceState, verdict: Verdict) -> int:
        """Appends tokens one at a time, as plain decoding would, until the sequence stops; returns how many."""
        kept = 0
        for token, raw, processed in zip(verdict.tokens, verdict.logits, verdict.scores):
            if sequence.length >= sequence.limit:
                break
            kept += 1
            sequence.text.append(token)
            if self._record(sequence, raw, processed):
                break
        return kept

    def _record(self, sequence: SequenceState, raw: torch.Tensor, processed: torch.Tensor) -> bool:
        """Keeps the appended token's logits and scores and checks the stopping criteria; whether the sequence ends."""
        if self.keep_scores:
            sequence.scores.append(processed)
        if self.keep_logits:
            sequence.raw_logits.append(raw)
        if sequence.stopped_at is None:
            stops = None if self.token_stops is None else self.token_stops(sequence.length, sequence.tokens[-1])
            if stops is None:
                scores = tuple(sequence.scores) if self.keep_scores else None
                stops = bool(self.stopping_criteria(sequence.text.input_ids, scores).any())
            if stops:
                sequence.stopped_at = sequence.length
                return self.has_eos
        return False

    def _mark_finished(self, sequences: list[SequenceState]) -> None:
        """
        Marks finished sequences. With an EOS criterion a sequence ends where its criteria fired. Without one, plain
        decoding runs every sequence to the length at which the last one's criteria fired: once that length is
        known, sequences run to it and are cut there.
        """
        for sequence in sequences:
            if sequence.stopped_at is not None and (self.has_eos or sequence.length >= sequence.limit):
                sequence.done = True
        if self.has_eos or any(sequence.stopped_at is None for sequence in sequences):
            return
        final_length = max(sequence.stopped_at for sequence in sequences)
        for sequence in sequences:
            sequence.limit = min(sequence.limit, final_length)
            if sequence.length >= final_length:
                sequence.text.truncate(final_length)
                sequence.done = True

    def _outputs(
        self, sequences: list[SequenceState], forward_passes: int, slot_valid: torch.BoolTensor | None
    ) -> LookaheadDecoderOnlyOutput | LookaheadEncoderDecoderOutput | torch.LongTensor:
        output_ids = self._output_ids(sequences)
        if not self.generation_config.return_dict_in_generate:
            return output_ids
        outputs = {
            "sequences": output_ids,
            "scores": self._per_token(sequences, "scores") if self.keep_scores else None,
            "logits": self._per_token(sequences, "raw_logits") if self.keep_logits else None,
            # With several sequences the cache holds unused slots and only the rows still running at the end.
            "cache": self.forward.cache if slot_valid is None else None,
        }
        if self.forward.is_encoder_decoder:
            steps = max(len(sequence.accepted) for sequence in sequences)
            accepted = [sequence.accepted + [0] * (steps - len(sequence.accepted)) for sequence in sequences]
            return LookaheadEncoderDecoderOutput(
                **outputs,
                num_forward_passes=torch.tensor([1 + len(sequence.accepted) for sequence in sequences], device="cpu"),
                accepted_per_step=torch.tensor(accepted, dtype=torch.long, device="cpu").reshape(
                    len(sequences), steps
                ),
            )
        return LookaheadDecoderOnlyOutput(
            **outputs,
            num_forward_passes=forward_passes,
            accepted_per_step=(
                tuple(sequences[0].accepted)
                if len(sequences) == 1
                else tuple(tuple(sequence.accepted) for sequence in sequences)
            ),
        )

    def _output_ids(self, sequences: list[SequenceState]) -> torch.LongTensor:
        if len(sequences) == 1:
            return sequences[0].text.input_ids
        length = max(sequence.length for sequence in sequences)
        pad_id = pad_token_id(self.generation_config)
        rows = [
            torch.nn.functional.pad(sequence.text.input_ids, (0, length - sequence.length), value=pad_id or 0)
            for sequence in sequences
        ]
        return torch.cat(rows, dim=0)

    @staticmethod
    def _per_token(sequences: list[SequenceState], name: str) -> tuple[torch.Tensor, ...]:
        """One `(batch, vocab)` tensor per generated token; zeros where a sequence had already finished."""
        per_sequence = [getattr(sequence, name) for sequence in sequences]
        steps = max(len(values) for values in per_sequence)
        template = next(values[0] for values in per_sequence if values)
        return tuple(
            torch.cat([values[t] if t < len(values) else torch.zeros_like(template) for values in per_sequence])
            for t in range(steps)
        )

    @staticmethod
    def _stream(streamer: BaseStreamer | None, sequence: SequenceState, kept: int) -> None:
        if streamer is not None and kept:
            streamer.put(torch.tensor(sequence.tokens[-kept:]))


def compiled_buckets(cost: StepCostModel, longest: int, tuning: AutoTuning = AUTO_TUNING) -> tuple[int, ...]:
    """
    The multi-token step lengths a compiled forward pass compiles, shortest first: the widest step this device runs
    for at most `compiled_step_cost` one-token steps (on a GPU about all of it, a few tokens on a CPU), and below it
    at most `compiled_buckets - 1` shorter lengths, each kept only where the next longer one costs at least
    `compiled_bucket_ratio` times as much. A flat cost curve gives one bucket holding wide windows and many
    candidates; a steep one, small buckets.

    Args:
        cost (`StepCostModel`): the device's step costs.
        longest (`int`): the longest step the call's settings allow.
        tuning (`AutoTuning`): the tuned constants.
    """
    affordable = [
        length for length in COST_GRID if 4 <= length <= longest and cost(length) <= tuning.compiled_step_cost
    ]
    buckets = [max(affordable, default=min(4, longest))]
    for length in sorted(affordable, reverse=True):
        if len(buckets) == tuning.compiled_buckets:
            break
        if cost(buckets[-1]) >= tuning.compiled_bucket_ratio * cost(length):
            buckets.append(length)
    return tuple(sorted(buckets))


def step_fingerprint(plans: list[StepPlan]) -> int:
    """
    A digest of a step's decisions: which sequences take part, how long each is, and every token each feeds (its
    pending tokens, window and candidates, in layout order). 0 when there is no step.
    """
    if not plans:
        return 0
    return hash(tuple((plan.sequence.index, plan.sequence.length, tuple(plan.row.tokens)) for plan in plans))
