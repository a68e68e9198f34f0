"""Verification: which candidate tokens of a step the model confirms, with each row's own logits processors."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch
from transformers import (
    EncoderNoRepeatNGramLogitsProcessor,
    EncoderRepetitionPenaltyLogitsProcessor,
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
    The argmax of each row of `logits` (shape `(..., vocab)`), taken in float32 as plain greedy decoding takes it,
    the first maximum winning a tie as with `torch.argmax` (a NaN counting as the maximum). On the CPU numpy takes
    it, several times faster than torch's CPU argmax over a large vocabulary (see the changelog).
    """
    if logits.device.type != "cpu":
        return logits.detach().to(torch.float32).argmax(-1)
    return torch.from_numpy(np.asarray(_cpu_argmax(logits)))


def read_choices(logits: torch.Tensor) -> list:
    """
    `greedy_tokens(logits)` as (nested) host integers, in one device-to-host transfer: a step reads every row it
    verifies and every window row at once, after its forward pass, and nothing else of the device.
    """
    if logits.device.type != "cpu":
        return logits.detach().to(torch.float32).argmax(-1).tolist()
    return np.asarray(_cpu_argmax(logits)).tolist()


def _cpu_argmax(logits: torch.Tensor) -> np.ndarray:
    """`greedy_tokens` of CPU logits, as numpy integers."""
    if logits.dtype in _POSITIVE_INFINITY_BITS and logits.is_contiguous():
        choices = _half_precision_argmax(logits.detach())
        if choices is not None:
            return choices
    return np.argmax(logits.detach().to(torch.float32).numpy(), axis=-1)


def _half_precision_argmax(logits: torch.Tensor) -> np.ndarray | None:
    """
    The argmax of half-precision CPU rows read as 16-bit integers, or `None` where that could differ from the
    float32 argmax.

    Positive floats order as their bit patterns do, and every negative float reads as a negative integer, so a row
    whose maximum is a finite positive number has the same first maximum either way (equal values have equal bits
    once zero is not the maximum). The rest (a maximum of zero or below, an infinity or a NaN) returns `None` for
    the float32 route. Reading the bits skips the conversion.
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
    The tokens a step accepts.

    Args:
        tokens (`list[int]`): the accepted tokens in order: the matched tree path, then one token from the model.
        nodes (`list[int]`): the tree node holding each matched token (one fewer than `tokens`).
        logits (`list[torch.Tensor]`): the raw logits that chose each token, each of shape `(1, vocab)`.
        scores (`list[torch.Tensor]`): the processed scores that chose each token, each of shape `(1, vocab)`.
    """

    tokens: list[int]
    nodes: list[int]
    logits: list[torch.Tensor]
    scores: list[torch.Tensor]

    def truncated(self, length: int) -> Verdict:
        """The first `length` (>= 1) tokens: every accepted token is plain decoding's, so any prefix is too."""
        return Verdict(self.tokens[:length], self.nodes[: length - 1], self.logits[:length], self.scores[:length])


class GreedyVerifier:
    """
    Greedy verification of a token tree: from the last accepted token, the model's choice at each node is accepted,
    and the walk goes on at the child holding that token, if any. Every accepted token is plain greedy's at that
    position, and logits processors are called once per accepted token, on the sequence up to it, as in plain
    decoding. Subclasses change how a node's token is chosen (`choose`), not the walk.

    Args:
        logits_processor (`LogitsProcessorList`): the processors `generate` built for the call.
    """

    # Whether the choice is the argmax of the raw logits when there are no processors (the fast path).
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
            logits (`torch.Tensor` of shape `(rows, vocab)`): row 0 follows the last accepted token; tree node `i`
                is row `tree_row + i`.
            tree (`TokenTree`): the verified candidates.
            tree_row (`int`): the row of the first tree node in `logits`.
            input_ids (`torch.LongTensor` of shape `(1, length)`): the sequence so far.
            max_tokens (`int`): the most tokens to accept (what the length budget still allows).
            choices (`list[int]`, *optional*): `read_choices(logits)`, where the step already read them; read here
                otherwise.

        Returns:
            `Verdict`.
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
        """Whether verifying reads the sequence's text (`input_ids`): processors read it, sampling its length."""
        return bool(self.logits_processor) or not self.argmax_of_raw_logits

    def choose(self, scores: torch.Tensor, position: int) -> int:
        """
        The token at a node, from its processed scores (shape `(vocab,)`), to be placed at index `position` of the
        sequence. The walk continues at the candidate holding the returned token, if any.
        """
        return int(greedy_tokens(scores))


class PositionNoise:
    """
    Gumbel noise for every position of one sequence, drawn from the sequence's seed and the position alone:
    `argmax(scores + noise(position))` samples `softmax(scores)` (the Gumbel-max trick), and the sampled text is the
    same whatever candidates a step verified.

    Args:
        seed (`int`): the sequence's seed (drawn from torch's global generator, so `torch.manual_seed` fixes it).
    """

    def __init__(self, seed: int):
        self.seed = seed

    def __call__(self, position: int, size: int) -> torch.Tensor:
        """The noise of `position`: `size` independent standard Gumbel values (on the CPU), shape `(size,)`."""
        generator = torch.Generator().manual_seed(_mix(self.seed, position))
        # Uniform in (0, 1]: -log(-log(u)) is finite except at u = 1 (+inf, probability 2^-53 per value).
        uniform = 1.0 - torch.rand(size, generator=generator, dtype=torch.float64, device="cpu")
        return -torch.log(-torch.log(uniform))

    def sample(self, scores: torch.Tensor, position: int) -> int:
        """
        The token sampled from `softmax(scores)` at index `position` of the sequence.

        Args:
            scores (`torch.Tensor` of shape `(vocab,)`): processed scores (`-inf` for tokens ruled out).
            position (`int`): where the token goes in the sequence.
        """
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
    Verification that keeps plain sampling's distribution: each position's token is `argmax(scores + noise)`, the
    processed and warped scores plus the position's Gumbel noise (`PositionNoise`), a sample of `softmax(scores)`.
    It is the greedy walk on perturbed scores, so the text depends on the seed and the model, never the candidates.

    Args:
        logits_processor (`LogitsProcessorList`): the processors and warpers `generate` built for the call.
        noise (`PositionNoise`): the sequence's noise.
    """

    argmax_of_raw_logits = False

    def __init__(self, logits_processor: LogitsProcessorList, noise: PositionNoise):
        super().__init__(logits_processor)
        self.noise = noise

    def choose(self, scores: torch.Tensor, position: int) -> int:
        return self.noise.sample(scores, position)


def processors_for_row(logits_processor: LogitsProcessorList, row: int, rows: int) -> LogitsProcessorList:
    """
    The processors `generate` built for the whole batch, as they apply to one row called alone (a step verifies
    every row on its own). Those holding per-row data or state get a copy for the row: the prefix function gets the
    row's index, a per-row `prompt_ignore_length` and the encoder processors' inputs are cut to the row's (rows of
    one input consecutive, as with `num_return_sequences`), and the SynthID watermark starts its own state.

    Args:
        logits_processor (`LogitsProcessorList`): the processors of the call.
        row (`int`): the row.
        rows (`int`): the rows of the batch (inputs x `num_return_sequences`).
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
