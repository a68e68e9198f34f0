"""Verification: which candidate tokens of a step the model confirms."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList

from .ngram_pool import TokenTree


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


class GreedyVerifier:
    """
    Greedy verification of a token tree.

    Starting from the last accepted token, the model's choice at each node is accepted; if a child of the node holds
    that token, its logits (computed in the same forward pass) give the next choice, otherwise the walk ends. Every
    accepted token is thus the token plain greedy decoding picks at that position, and logits processors see exactly
    the inputs they see in plain decoding: they are called once per accepted token, on the sequence up to it.

    Subclasses change how a node's token is chosen (`choose`); the walk stays the same.

    Args:
        logits_processor (`LogitsProcessorList`): the processors `generate` built for the call.
    """

    # Whether the choice is the argmax of the raw logits when there are no processors (the fast path).
    argmax_of_raw_logits = True

    def __init__(self, logits_processor: LogitsProcessorList):
        self.logits_processor = logits_processor

    def verify(
        self, logits: torch.Tensor, tree: TokenTree, tree_row: int, input_ids: torch.LongTensor, max_tokens: int
    ) -> Verdict:
        """
        Args:
            logits (`torch.Tensor` of shape `(rows, vocab)`): row 0 follows the last accepted token; tree node `i`
                is row `tree_row + i`.
            tree (`TokenTree`): the verified candidates.
            tree_row (`int`): the row of the first tree node in `logits`.
            input_ids (`torch.LongTensor` of shape `(1, length)`): the sequence so far.
            max_tokens (`int`): the most tokens to accept (what the length budget still allows).

        Returns:
            `Verdict`.
        """
        # Greedy without processors chooses the raw argmax: one reduction and one host transfer for all rows.
        choices = logits.argmax(-1).tolist() if self.argmax_of_raw_logits and not self.logits_processor else None
        verdict = Verdict([], [], [], [])
        row, node = 0, -1
        while True:
            raw = logits[row : row + 1].to(dtype=torch.float32, copy=True)
            if choices is not None:
                scores, token = raw, choices[row]
            else:
                sequence = torch.cat([input_ids, input_ids.new_tensor([verdict.tokens])], dim=-1)
                scores = self.logits_processor(sequence, raw)
                token = self.choose(scores[0], tree.children[node + 1])
            verdict.tokens.append(token)
            verdict.logits.append(raw)
            verdict.scores.append(scores)
            child = tree.child(node, token)
            if child is None or len(verdict.tokens) >= max_tokens:
                return verdict
            verdict.nodes.append(child)
            row, node = tree_row + child, child

    def choose(self, scores: torch.Tensor, candidates: dict[int, int]) -> int:
        """
        The token at a node, from its processed scores (shape `(vocab,)`) and the candidates below it (token ->
        node). The walk continues at the candidate holding the returned token, if any.
        """
        return int(scores.argmax(-1))


class SamplingVerifier(GreedyVerifier):
    """
    Verification of a token tree that keeps the output distribution of plain sampling.

    At each node the model's distribution p (logits processors and warpers applied, as in plain sampling) is
    computed. The candidates below the node are deterministic drafts, so the multi-draft rejection rule reduces to:
    accept candidate x with probability p(x); on rejection set p(x) = 0, renormalise, and try the next candidate;
    if every candidate is rejected, sample the token from what is left of p. Whatever the candidates, the token
    is then distributed exactly as p: a candidate x is chosen with probability p(x) overall (the chance of reaching
    it times its renormalised probability), and any other token with its share of the remaining mass. An accepted
    candidate continues the walk at its node, whose logits are conditioned on it; a sampled token ends the step.
    The candidates depend only on text already generated, never on the random draws still to come.

    Args:
        logits_processor (`LogitsProcessorList`): the processors and warpers `generate` built for the call.
    """

    argmax_of_raw_logits = False

    def choose(self, scores: torch.Tensor, candidates: dict[int, int]) -> int:
        probs = torch.softmax(scores, dim=-1)
        for candidate in candidates:
            if float(torch.rand((), device=probs.device)) < float(probs[candidate]):
                return candidate
            probs[candidate] = 0.0
            probs = probs / probs.sum()
        # Every candidate now has probability 0, so the walk ends here.
        return int(torch.multinomial(probs, 1))
