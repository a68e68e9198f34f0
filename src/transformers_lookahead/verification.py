"""Verification: which candidate tokens of a step the model confirms, with each row's own logits processors."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch
from transformers import (
    EncoderNoRepeatNGramLogitsProcessor,
    EncoderRepetitionPenaltyLogitsProcessor,
    LogitsProcessor,
    LogitsProcessorList,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SynthIDTextWatermarkLogitsProcessor,
)

from .compatibility import prefix_function, with_prefix_function
from .token_tree import TokenTree

# The bit pattern of +inf in each half-precision dtype: positive finite values are the patterns below it.
_POSITIVE_INFINITY_BITS = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}


def greedy_tokens(logits: torch.Tensor) -> torch.LongTensor:
    """
    The float32 argmax of each row of `logits`, as plain greedy takes it (first maximum, NaN as the maximum); on the
    CPU by numpy, several times faster than torch's argmax over a large vocabulary.
    """
    if logits.device.type != "cpu":
        return logits.detach().to(torch.float32).argmax(-1)
    return torch.from_numpy(np.asarray(_cpu_argmax(logits)))


def read_choices(logits: torch.Tensor) -> list:
    """`greedy_tokens(logits)` as host integers, in the step's one device-to-host transfer."""
    if logits.device.type != "cpu":
        return logits.detach().to(torch.float32).argmax(-1).tolist()
    return np.asarray(_cpu_argmax(logits)).tolist()


def _cpu_argmax(logits: torch.Tensor) -> np.ndarray:
    if logits.dtype in _POSITIVE_INFINITY_BITS and logits.is_contiguous():
        choices = _half_precision_argmax(logits.detach())
        if choices is not None:
            return choices
    return np.argmax(logits.detach().to(torch.float32).numpy(), axis=-1)


def _half_precision_argmax(logits: torch.Tensor) -> np.ndarray | None:
    """
    The argmax of half-precision CPU rows read as 16-bit integers (positive floats order as their bits do), or `None`
    where it could differ from float32's: a maximum of zero or below, an infinity or a NaN.
    """
    infinity = _POSITIVE_INFINITY_BITS[logits.dtype]
    bits = logits.view(torch.int16).numpy()
    choices = np.argmax(bits, axis=-1)
    top = np.take_along_axis(bits, choices[..., None], axis=-1)
    # A negative NaN reads as a negative integer, so the maximum misses it: as unsigned integers its patterns lie
    # above negative infinity's, where no number's do.
    negative_nan = bits.view(np.uint16).max(initial=0) > (infinity | 0x8000)
    if (top <= 0).any() or (top >= infinity).any() or negative_nan:
        return None
    return choices


@dataclass
class Verdict:
    """
    The tokens a step accepts: the matched tree path, then the model's own token (`tokens`), the node of each matched
    one (`nodes`), and the raw `logits` and processed `scores` (`(1, vocab)` each) that chose each.
    """

    tokens: list[int]
    nodes: list[int]
    logits: list[torch.Tensor]
    scores: list[torch.Tensor]

    def truncated(self, length: int) -> Verdict:
        """The first `length` (>= 1) tokens: each is plain decoding's, so any prefix is too."""
        return Verdict(self.tokens[:length], self.nodes[: length - 1], self.logits[:length], self.scores[:length])


class GreedyVerifier:
    """
    Greedy verification of a token tree: the model's choice at each node is accepted and the walk goes on at the
    child holding it. Processors run once per accepted token, on the text up to it, as in plain decoding. Subclasses
    change how a token is chosen (`choose`), not the walk.

    Args:
        logits_processor (`LogitsProcessorList`): the row's processors.
    """

    # Whether the choice is the raw logits' argmax when there are no processors (the fast path).
    argmax_of_raw_logits = True

    def __init__(self, logits_processor: LogitsProcessorList):
        self.logits_processor = logits_processor

    def verify(
        self,
        logits: torch.Tensor,
        tree: TokenTree,
        tree_row: int,
        input_ids: torch.LongTensor,
        max_tokens: int,
        choices: list[int] | None = None,
    ) -> Verdict:
        """
        Args:
            logits (`torch.Tensor` of shape `(rows, vocab)`): row 0 follows the last token; node `i` is `tree_row + i`.
            tree (`TokenTree`): the candidates.
            tree_row (`int`): the row of the first node.
            input_ids (`torch.LongTensor` of shape `(1, length)`): the text so far.
            max_tokens (`int`): the most tokens to accept.
            choices (`list[int]`, *optional*): `read_choices(logits)`, where the step read them.
        """
        # Greedy without processors chooses the raw argmax: every row's, read in the step's one host transfer.
        fast = not self.reads_text
        if fast and choices is None:
            choices = read_choices(logits)
        verdict = Verdict([], [], [], [])
        row, node = 0, -1
        while True:
            raw = logits[row : row + 1].to(dtype=torch.float32, copy=True)
            if fast:
                scores, token = raw, choices[row]
            else:
                sequence = torch.cat([input_ids, input_ids.new_tensor([verdict.tokens])], dim=-1)
                scores = self.logits_processor(sequence, raw)
                token = self.choose(scores[0], sequence.shape[1])
            verdict.tokens.append(token)
            verdict.logits.append(raw)
            verdict.scores.append(scores)
            child = tree.child(node, token)
            if child is None or len(verdict.tokens) >= max_tokens:
                return verdict
            verdict.nodes.append(child)
            row, node = tree_row + child, child

    @property
    def reads_text(self) -> bool:
        """Whether verifying reads the text: processors read it, sampling its length."""
        return bool(self.logits_processor) or not self.argmax_of_raw_logits

    def choose(self, scores: torch.Tensor, position: int) -> int:
        """The token at index `position` of the text, from its processed `scores` (`(vocab,)`)."""
        return int(greedy_tokens(scores))


class PositionNoise:
    """
    Gumbel noise per position of one sequence, from its `seed` and the position alone: `argmax(scores + noise)`
    samples `softmax(scores)`, and the text is the same whatever candidates a step verified.
    """

    def __init__(self, seed: int):
        self.seed = seed

    def __call__(self, position: int, size: int) -> torch.Tensor:
        """`size` standard Gumbel values for `position`, on the CPU."""
        generator = torch.Generator().manual_seed(_mix(self.seed, position))
        # Uniform in (0, 1]: -log(-log(u)) is finite except at u = 1 (+inf, probability 2^-53 per value).
        uniform = 1.0 - torch.rand(size, generator=generator, dtype=torch.float64, device="cpu")
        return -torch.log(-torch.log(uniform))

    def sample(self, scores: torch.Tensor, position: int) -> int:
        """The token sampled from `softmax(scores)` (`(vocab,)`) at index `position` of the text."""
        noise = self(position, scores.shape[-1]).to(scores.device)
        return int((scores.to(torch.float64) + noise).argmax(-1))


def _mix(seed: int, position: int) -> int:
    """A 63-bit seed per position (splitmix64 of seed and position): neighbouring positions draw unrelated noise."""
    value = (seed + 0x9E3779B97F4A7C15 * (position + 1)) & 0xFFFFFFFFFFFFFFFF
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (value ^ (value >> 31)) >> 1


class SamplingVerifier(GreedyVerifier):
    """
    Verification that keeps plain sampling's distribution: the greedy walk on the processed scores plus each
    position's Gumbel `noise`, so the text depends on the seed and the model, never the candidates.
    """

    argmax_of_raw_logits = False

    def __init__(self, logits_processor: LogitsProcessorList, noise: PositionNoise):
        super().__init__(logits_processor)
        self.noise = noise

    def choose(self, scores: torch.Tensor, position: int) -> int:
        return self.noise.sample(scores, position)


# Transformers' processors whose calls span the batch as a whole (guidance halves, per-row state set up for the whole
# batch): called one row at a time, they would compute something else.
BATCH_PROCESSORS = (
    "ClassifierFreeGuidanceLogitsProcessor",
    "DiaClassifierFreeGuidanceLogitsProcessor",
    "DiaEOSChannelFilterLogitsProcessor",
    "DiaEOSDelayPatternLogitsProcessor",
    "UnbatchedClassifierFreeGuidanceLogitsProcessor",
    "WhisperNoSpeechDetection",
)


def check_processors(logits_processor: LogitsProcessorList, batch_size: int) -> None:
    """
    Refuses, for a batch of several rows, the processors that row-by-row calls could change: lookahead verifies each
    row with `(1, length)` inputs, as many times as the row accepts tokens, while plain decoding calls a processor once
    per token with the whole batch. Transformers' own processors give the same scores either way (those holding
    per-row data are adapted by `processors_for_row`); a processor of another kind may keep state per batch row or
    read the batch size.
    """
    if batch_size <= 1:
        return
    for processor in logits_processor:
        kind = type(processor)
        if kind.__module__ != LogitsProcessor.__module__ or kind.__name__ in BATCH_PROCESSORS:
            raise ValueError(
                "Lookahead decoding calls logits processors for one batch row at a time (input ids of shape "
                "`(1, length)`, once per accepted token), not once per token with the whole batch; "
                f"`{kind.__name__}` is not one of Transformers' row-wise processors, so it could keep state per row "
                f"or read the batch size and behave otherwise. Got a batch of {batch_size} rows (input rows x "
                "`num_return_sequences`): generate one row per call with this processor, or remove the "
                "`lookahead_*` settings."
            )


def processors_for_row(logits_processor: LogitsProcessorList, row: int, rows: int) -> LogitsProcessorList:
    """
    The batch's processors as they apply to `row` of `rows` called alone: those holding per-row data or state get a
    copy for the row (the prefix function its index, per-row inputs cut to the row's, SynthID its own state).
    """
    adapted = LogitsProcessorList()
    for processor in logits_processor:
        if isinstance(processor, PrefixConstrainedLogitsProcessor):
            allowed = prefix_function(processor)
            processor = with_prefix_function(processor, lambda _, ids, allowed=allowed: allowed(row, ids))
        elif isinstance(processor, RepetitionPenaltyLogitsProcessor) and isinstance(
            processor.prompt_ignore_length, torch.Tensor
        ):
            processor = copy.copy(processor)
            processor.prompt_ignore_length = processor.prompt_ignore_length[row : row + 1]
        elif isinstance(processor, EncoderRepetitionPenaltyLogitsProcessor):
            source = row // max(rows // processor.encoder_input_ids.shape[0], 1)
            processor = copy.copy(processor)
            processor.encoder_input_ids = processor.encoder_input_ids[source : source + 1]
        elif isinstance(processor, EncoderNoRepeatNGramLogitsProcessor):
            source = row // max(rows // processor.batch_size, 1)
            processor = copy.copy(processor)
            processor.generated_ngrams = processor.generated_ngrams[source : source + 1]
            processor.batch_size = 1
        elif isinstance(processor, SynthIDTextWatermarkLogitsProcessor):
            processor = copy.copy(processor)
            processor.state = None
        adapted.append(processor)
    return adapted
