"""The lookahead decoding loop of one `generate` call: prefill, then one forward pass per step, then the outputs."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerateEncoderDecoderOutput
from transformers.utils import logging

from .cache_commit import CacheCommitter
from .compatibility import can_auto_compile, pad_token_id, prefill
from .configuration_lookahead import LookaheadConfig
from .sequence_lookahead import SequenceLookahead, SequenceStep, StepPlanner
from .step_forward import StepForward
from .step_layout import HoleySlots, StepLayout, generate_position_shift, padded_length
from .verification import Verdict, processors_for_row, read_choices

if TYPE_CHECKING:
    from transformers import GenerationConfig, PreTrainedModel
    from transformers.generation.streamers import BaseStreamer

logger = logging.get_logger(__name__)


@dataclass
class LookaheadDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """
    `GenerateDecoderOnlyOutput` plus what lookahead decoding did.

    Args:
        num_forward_passes (`int`): forward passes, the prefill included (one per step for the whole batch).
        accepted_per_step (`tuple[int]` or `tuple[tuple[int]]`): tokens each step after the prefill added; one tuple
            per row for a batch.
    """

    num_forward_passes: int | None = None
    accepted_per_step: tuple[int, ...] | tuple[tuple[int, ...], ...] | None = None


@dataclass
class LookaheadEncoderDecoderOutput(GenerateEncoderDecoderOutput):
    """
    `GenerateEncoderDecoderOutput` plus what lookahead decoding did, per row (Whisper splits every field by row).

    Args:
        num_forward_passes (`torch.LongTensor` of shape `(batch_size,)`): passes each row took part in.
        accepted_per_step (`torch.LongTensor` of shape `(batch_size, steps)`): tokens each step added, 0 once done.
    """

    num_forward_passes: torch.LongTensor | None = None
    accepted_per_step: torch.LongTensor | None = None


class StepSync(Protocol):
    """Keeps tensor-parallel ranks taking the same steps (`RankSync`): a step's shape decides its collectives."""

    def check(self, step: int, fingerprint: int) -> None:
        """Raises on every rank unless all ranks planned a step with this `fingerprint` (0: no step)."""


class SequenceState(SequenceLookahead):
    """
    One row of the batch: its lookahead, and its text in a preallocated device buffer holding its left padding
    (`input_ids`, what processors, criteria and the output read), mirrored past the padding in `tokens`. `length` and
    `limit` count the padding.

    Args:
        index (`int`): the row in the batch `generate` was called with.
        row (`torch.LongTensor` of shape `(1, length)`): the prompt, padding included.
        padding (`int`): the row's left padding.
        tokens (`list[int]`): the text past the padding: the prompt, then its first token where it fits.
        limit (`int`): `max_length`.
        lookahead: its planner and verifier, as `SequenceLookahead` takes them.
    """

    def __init__(
        self, index: int, row: torch.LongTensor, padding: int, tokens: list[int], limit: int, *lookahead: Any
    ):
        self.padding = padding
        self.buffer = row.new_empty((1, max(limit, row.shape[1])))
        self.buffer[:, : row.shape[1]] = row
        self.buffer[0, row.shape[1] : padding + len(tokens)] = row.new_tensor(tokens[row.shape[1] - padding :])
        super().__init__(tokens, limit, *lookahead)
        self.index = index
        self.stopped_at: int | None = None
        self.done = False
        self.scores: list[torch.Tensor] = []
        self.raw_logits: list[torch.Tensor] = []

    @property
    def length(self) -> int:
        return self.padding + len(self.tokens)

    @property
    def input_ids(self) -> torch.LongTensor:
        return self.buffer[:, : self.length]

    def append(self, token: int) -> None:
        self.buffer[0, self.length] = token
        self.tokens.append(token)

    def truncate(self, length: int) -> None:
        del self.tokens[max(0, length - self.padding) :]


class TokenStoppingCriteria:
    """
    `generate`'s default criteria (`MaxLengthCriteria`, `EosTokenCriteria`) decided on the host from a length and a
    last token: they are checked after every accepted token, and the list builds tensors at every call.
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
        """Whether they fire at `length` tokens ending in `token`; `None`: ask the list (it warns past the positions)."""
        if self.max_position_embeddings is not None and length > self.max_position_embeddings:
            return None
        return token in self.eos_token_ids or (self.max_length is not None and length >= self.max_length)


class StopTracker:
    """Where each sequence stops, as plain decoding decides it, keeping each token's logits and scores where asked."""

    def __init__(self, stopping_criteria: StoppingCriteriaList, generation_config: GenerationConfig):
        self.stopping_criteria = stopping_criteria
        return_dict = generation_config.return_dict_in_generate
        self.keep_scores = return_dict and generation_config.output_scores
        self.keep_logits = return_dict and generation_config.output_logits
        # As in plain decoding: with an EOS criterion a finished sequence is padded; without one, a sequence whose
        # criteria fired keeps generating until every sequence's have.
        self.has_eos = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)
        self.token_stops = TokenStoppingCriteria.of(stopping_criteria)

    def record(self, sequence: SequenceState, raw: torch.Tensor, processed: torch.Tensor) -> bool:
        """Keeps the appended token's logits and scores and checks the stopping criteria; whether the sequence ends."""
        if self.keep_scores:
            sequence.scores.append(processed)
        if self.keep_logits:
            sequence.raw_logits.append(raw)
        if sequence.stopped_at is None:
            stops = None if self.token_stops is None else self.token_stops(sequence.length, sequence.tokens[-1])
            if stops is None:
                scores = tuple(sequence.scores) if self.keep_scores else None
                stops = bool(self.stopping_criteria(sequence.input_ids, scores).any())
            if stops:
                sequence.stopped_at = sequence.length
                return self.has_eos
        return False

    def mark_finished(self, sequences: list[SequenceState]) -> None:
        """
        Marks finished sequences: where their criteria fired with an EOS criterion; without one, plain decoding runs
        every sequence to the length where the last one's fired, so once that is known they run to it and are cut.
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
                sequence.truncate(final_length)
                sequence.done = True


class SlotMap:
    """
    Which slots of the shared cache hold a token of which row (`valid`, `(rows, slots)`): padding and the slots a row
    left unused (it accepted fewer than the row that accepted the most) are masked. `None` for one unpadded row.
    """

    def __init__(self, valid: torch.BoolTensor | None, holey_prompt_length: int | None = None):
        self.valid = valid
        # The prompts' length (their mask is `valid`'s first columns) where some zero follows a one (right padding,
        # holes): sliding and chunked layers then count slots, not positions, as plain decoding's masks do.
        self.holey_prompt_length = holey_prompt_length

    @classmethod
    def after_prefill(cls, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None) -> SlotMap:
        if input_ids.shape[0] == 1 and attention_mask is None:
            return cls(None)
        if attention_mask is None:
            return cls(torch.ones(input_ids.shape, dtype=torch.bool, device=input_ids.device))
        valid = attention_mask.bool()
        holey = bool((valid[:, :-1] & ~valid[:, 1:]).any())
        return cls(valid, valid.shape[1] if holey else None)

    def add(self, added: int, kept_rows: list[list[int]]) -> None:
        if self.valid is not None:
            kept = torch.tensor([len(rows) for rows in kept_rows], device=self.valid.device)
            new_slots = torch.arange(added, device=self.valid.device)[None, :] < kept[:, None]
            self.valid = torch.cat([self.valid, new_slots], dim=1)

    def keep(self, indices: torch.LongTensor) -> None:
        self.valid = self.valid[indices]

    def holey_slots(self, plans: list[SequenceStep]) -> HoleySlots:
        """
        How sliding and chunked layers see each row's slots in the step of `plans` where some prompt's mask has zeros
        after real tokens (`holey_prompt_length`); left padding alone needs nothing, positions show it.
        """
        prompts = self.valid[:, : self.holey_prompt_length]
        # Each row's first token of the step: its slot in the row (padding and holes counted), and its position.
        starts = [plan.sequence.length - len(plan.sequence.pending) for plan in plans]
        positions = [plan.sequence.position - len(plan.sequence.pending) + 1 for plan in plans]
        starts = torch.tensor(starts, device=prompts.device)[:, None]
        left_padding = (prompts.cumsum(-1) == 0).sum(-1, keepdim=True)
        shift = starts - left_padding - torch.tensor(positions, device=prompts.device)[:, None]

        def valid(past: int) -> torch.BoolTensor:
            slots = starts - past + torch.arange(past, device=prompts.device)
            in_prompt = prompts.gather(1, slots.clamp(0, prompts.shape[1] - 1))
            return (slots >= 0) & ((slots >= prompts.shape[1]) | in_prompt)

        return HoleySlots(valid, shift)


class LookaheadDecoder:
    """
    The decoding loop of one `generate` call. Every row has its own lookahead (`SequenceState`); one forward pass per
    step serves all of them, each part padded to the longest, over a shared cache where every row gets as many new
    slots as the row that accepted the most (`SlotMap`). Finished rows leave the batch.

    Args:
        model (`PreTrainedModel`): the model.
        config (`LookaheadConfig`): the step shape.
        planner (`StepPlanner`): how the rows plan their steps (`AdaptivePlanner` for `"auto"`).
        forward (`StepForward`): how the model takes a step.
        committer (`CacheCommitter`): keeps a step's accepted entries in the cache.
        logits_processor (`LogitsProcessorList`): applied to every accepted position.
        stopping_criteria (`StoppingCriteriaList`): checked after every accepted token.
        generation_config (`GenerationConfig`): the resolved generation config.
        layout (`type[StepLayout]`, *optional*): full steps, or `ChainLayout` for a model that takes none.
        sync (`StepSync`, *optional*): keeps tensor-parallel ranks in step.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        config: LookaheadConfig,
        planner: StepPlanner,
        forward: StepForward,
        committer: CacheCommitter,
        logits_processor: LogitsProcessorList,
        stopping_criteria: StoppingCriteriaList,
        generation_config: GenerationConfig,
        layout: type[StepLayout] = StepLayout,
        sync: StepSync | None = None,
    ):
        self.model = model
        self.config = config
        self.planner = planner
        self.forward = forward
        self.committer = committer
        self.logits_processor = logits_processor
        self.generation_config = generation_config
        self.layout_class = layout
        self.sync = sync
        self.stops = StopTracker(stopping_criteria, generation_config)
        self.position_shift = generate_position_shift(model)

    def run(
        self,
        input_ids: torch.LongTensor,
        model_kwargs: dict[str, Any],
        streamer: BaseStreamer | None,
    ) -> LookaheadDecoderOnlyOutput | LookaheadEncoderDecoderOutput | torch.LongTensor:
        """Prefills the prompts, then runs steps until every sequence has stopped."""
        if streamer is not None:
            streamer.put(input_ids.cpu())
        sequences, slots = self._prefill(input_ids, model_kwargs, streamer)
        self.committer.start()
        self._choose_forward(model_kwargs)
        # Built once the prefill created the cache's layers, whose kinds decide the masks.
        layout = self.layout_class.for_model(
            self.model, self.committer.cache, self.planner.window_size, self.config.levels
        )
        forward_passes = 1
        active = self._drop_finished(sequences, sequences, slots)
        while True:
            # Each running sequence's part of the step, within the length the batch settles on.
            plans = self._plan(active, layout) if active else []
            if self.sync is not None:
                # Every rank takes this step, or stops here, together.
                self.sync.check(forward_passes, step_fingerprint(plans))
            if not plans:
                break
            self.step(plans, layout, slots, streamer)
            forward_passes += 1
            active = self._drop_finished(sequences, active, slots)

        if streamer is not None:
            streamer.end()
        self.planner.finish(sequences)
        return self._outputs(sequences, forward_passes, slots)

    def step(
        self, plans: list[SequenceStep], layout: StepLayout, slots: SlotMap, streamer: BaseStreamer | None
    ) -> None:
        """
        One step: one forward pass over every row's pending tokens, Jacobi window and candidate tree; each row's
        verified prefix plus one token appended; the cache rolled forward over what was kept; and what it taught.
        """
        rows = [plan.row for plan in plans]
        # 1. Lay out: every part padded to the longest and masked, over the shared cache.
        holey = slots.holey_slots(plans) if slots.holey_prompt_length is not None else None
        inputs = layout.build(
            self.committer.cache, rows, slots.valid, self._bucket(plans), self.committer.seq_length, holey
        )
        # 2. Forward, then the step's one device-to-host transfer: the model's choice at every row it kept.
        self.committer.before_step(feeds_guesses=any(row.pending_length < inputs.length for row in rows))
        started = time.perf_counter()
        logits = self.forward(inputs)
        choices = read_choices(logits)
        row_choices = [inputs.choices_of(b, choices) for b in range(len(plans))]
        # 3. Verify each part, and append what it accepted until the sequence stops.
        verdicts = [
            plan.sequence.verify(plan, inputs.logits_of(b, logits), row_choices[b]) for b, plan in enumerate(plans)
        ]
        verdicts = layout.even_out(verdicts)
        kept = [self._accept(plan.sequence, verdict, streamer) for plan, verdict in zip(plans, verdicts)]
        # The choices reached the host, so on accelerators too the step has finished here.
        elapsed = time.perf_counter() - started
        # 4. Commit the kept entries to the cache, or undo a step a recurrent state cannot keep part of.
        kept_rows = [
            plan.row.kept_rows(verdict.nodes[: count - 1], self.committer.strategy)
            for plan, verdict, count in zip(plans, verdicts, kept)
        ]
        added, undone = self.committer.keep(inputs.length, kept_rows)
        if not undone:
            slots.add(added, kept_rows)
        # 5. Learn: each sequence's window, pool and policy; the planner, from the step's duration.
        for plan, verdict, count, choices_of_row in zip(plans, verdicts, kept, row_choices):
            plan.sequence.learn(plan, verdict, count, choices_of_row, undone=undone)
        self.planner.observe_step(inputs.length, elapsed)

    def _prefill(
        self, input_ids: torch.LongTensor, model_kwargs: dict[str, Any], streamer: BaseStreamer | None
    ) -> tuple[list[SequenceState], SlotMap]:
        attention_mask = model_kwargs.get(
            "decoder_attention_mask" if self.forward.is_encoder_decoder else "attention_mask"
        )
        # Plain decoding numbers each new token one past the last prompt position it prepared (1 after a padded
        # last token), whatever the mask's zeros are; multimodal rotary ids `(sections, batch, length)` alike.
        positions = model_kwargs.get("position_ids")
        next_positions = None if positions is None else positions.reshape(-1, *positions.shape[-2:])[0, :, -1].tolist()
        outputs = prefill(self.model, input_ids, self.generation_config, model_kwargs)
        first = outputs.logits[:, -1].to(dtype=torch.float32, copy=True)
        del outputs
        rows = input_ids.shape[0]
        # Every row has its processors to itself from the first token on: some keep state per batch row.
        processors = [processors_for_row(self.logits_processor, index, rows) for index in range(rows)]
        first_scores = torch.cat([processors[i](input_ids[i : i + 1], first[i : i + 1]) for i in range(rows)])
        verifiers = self.planner.verifiers(processors)
        if self.generation_config.do_sample:
            first_tokens = [
                verifier.noise.sample(first_scores[index], input_ids.shape[1])
                for index, verifier in enumerate(verifiers)
            ]
        else:
            first_tokens = first_scores.argmax(-1).tolist()

        slots = SlotMap.after_prefill(input_ids, attention_mask)
        sequences = []
        limit = self.generation_config.max_length
        for index in range(rows):
            row = input_ids[index : index + 1]
            tokens = row[0].tolist() if slots.valid is None else row[0, slots.valid[index]].tolist()
            padding = row.shape[1] - len(tokens)
            appended = row.shape[1] < limit
            if appended:
                tokens.append(first_tokens[index])
            # Built from the prompt and its first token, as every later step sees the text.
            sequence = SequenceState(index, row, padding, tokens, limit, self.planner, verifiers[index])
            if self.position_shift is None:
                sequence.position_offset = padding
            elif next_positions is None:
                sequence.position_offset = self.position_shift
            else:
                sequence.position_offset = self.position_shift + next_positions[index] + 1 - (row.shape[1] - padding)
            if appended:
                self.stops.record(sequence, first[index : index + 1], first_scores[index : index + 1])
            sequences.append(sequence)
        self._stream(streamer, sequences[0], 1)
        return sequences, slots

    def _plan(self, active: list[SequenceState], layout: StepLayout) -> list[SequenceStep]:
        """
        Each row's part of the step. A pass costs what its longest row costs, so a batch (or a compiled pass) first
        settles on one length, and every row verifies what fits in it.
        """
        offers = [sequence.offer(layout) for sequence in active]
        # A static cache has room for so many more entries (an indexed layer, keys its top-k takes all of): the
        # step must fit.
        room = self.committer.room()
        budget = None
        if self.buckets is not None:
            # A compiled forward pass knows a few step shapes: one token, and each bucket length that fits the cache.
            fitting = tuple(length for length in self.buckets if room >= length)
            budget = self.planner.step_length(offers, (1, *fitting)) if fitting else 1
        elif len(active) > 1:
            budget = self.planner.step_length(offers)
        return [sequence.plan(offer, layout, budget, room) for sequence, offer in zip(active, offers)]

    def _accept(self, sequence: SequenceState, verdict: Verdict, streamer: BaseStreamer | None) -> int:
        kept = sequence.accept(verdict, lambda token, raw, processed: self.stops.record(sequence, raw, processed))
        self._stream(streamer, sequence, kept)
        return kept

    def _drop_finished(
        self, sequences: list[SequenceState], active: list[SequenceState], slots: SlotMap
    ) -> list[SequenceState]:
        self.stops.mark_finished(sequences)
        running = [sequence for sequence in active if not sequence.done]
        if running and len(running) < len(active):
            # Dropped from the cache, so that the next steps compute only the running ones.
            keep = torch.tensor([active.index(sequence) for sequence in running], device=slots.valid.device)
            self.forward.select(keep)
            slots.keep(keep)
            # A smaller batch makes each extra token per row cheaper again.
            self.planner.price_batch(len(running))
        return running

    def _choose_forward(self, model_kwargs: dict[str, Any]) -> None:
        """
        Compiles the step where plain decoding would compile its own; multi-token steps are then padded to a few
        bucket lengths, so the compiled function sees one shape per bucket and one for a single token.
        """
        model, generation_config = self.model, self.generation_config
        self.buckets = None
        if not self.committer.is_static or not can_auto_compile(model, model_kwargs, generation_config):
            return
        self.forward.compile(generation_config.compile_config)
        self.buckets = self.planner.buckets(self.config.max_step_length(self.planner.window_size))

    def _bucket(self, plans: list[SequenceStep]) -> int | None:
        if self.buckets is None:
            return None
        length = max(plan.row.length for plan in plans)
        if length == 1:
            return None
        # Planning keeps steps within the buckets; a longer one fails in the layout rather than compiling anew.
        return padded_length(length, self.buckets)

    def _outputs(
        self, sequences: list[SequenceState], forward_passes: int, slots: SlotMap
    ) -> LookaheadDecoderOnlyOutput | LookaheadEncoderDecoderOutput | torch.LongTensor:
        output_ids = self._output_ids(sequences)
        if not self.generation_config.return_dict_in_generate:
            return output_ids
        if slots.valid is not None:
            logger.warning_once(
                "Lookahead decoding returns no cache (`cache=None` in the output) for a batch or a padded prompt: "
                "its cache holds unused slots and only the rows still running at the end, so `generate` could not "
                "continue from it. Generate one unpadded row per call to get the cache back."
            )
        outputs = {
            "sequences": output_ids,
            "scores": self._per_token(sequences, "scores") if self.stops.keep_scores else None,
            "logits": self._per_token(sequences, "raw_logits") if self.stops.keep_logits else None,
            # With several sequences the cache holds unused slots and only the rows still running at the end.
            "cache": self.forward.cache if slots.valid is None else None,
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
        rows = [sequence.input_ids[0] for sequence in sequences]
        padding = pad_token_id(self.generation_config) or 0
        return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=padding)

    @staticmethod
    def _per_token(sequences: list[SequenceState], name: str) -> tuple[torch.Tensor, ...]:
        """One `(batch, vocab)` tensor per generated token; zeros where a row had finished."""
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


def step_fingerprint(plans: list[SequenceStep]) -> int:
    """A digest of a step's decisions (its rows, their lengths, every token fed); 0 for no step."""
    if not plans:
        return 0
    return hash(tuple((plan.sequence.index, plan.sequence.length, tuple(plan.row.tokens)) for plan in plans))
