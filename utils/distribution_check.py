"""Two-sample chi-square tests, used to check that lookahead sampling keeps plain sampling's distribution."""

from __future__ import annotations

import torch


def chi_square_p_value(statistic: float, degrees_of_freedom: int) -> float:
    """Survival function of the chi-square distribution (the regularized upper incomplete gamma function)."""
    if degrees_of_freedom <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(degrees_of_freedom / 2.0), torch.tensor(statistic / 2.0)))


def homogeneity_p_value(first: torch.Tensor, second: torch.Tensor, min_count: int = 10) -> float:
    """
    Chi-square test that two count vectors over the same outcomes come from one distribution.

    Args:
        first (`torch.Tensor`): counts of each outcome in the first sample.
        second (`torch.Tensor`): counts of the same outcomes in the second sample.
        min_count (`int`): outcomes seen fewer times than this in both samples together are pooled into one bin,
            because the chi-square approximation needs a handful of expected counts per bin.

    Returns:
        `float`: the p-value; 1.0 when fewer than two bins remain.
    """
    first, second = first.double().flatten(), second.double().flatten()
    total = first + second
    common = total >= min_count
    rare = (total > 0) & ~common
    first = torch.cat([first[common], first[rare].sum()[None]]) if rare.any() else first[common]
    second = torch.cat([second[common], second[rare].sum()[None]]) if rare.any() else second[common]
    together = first + second
    keep = together > 0
    first, second, together = first[keep], second[keep], together[keep]
    grand_total = together.sum()
    expected_first = together * first.sum() / grand_total
    expected_second = together * second.sum() / grand_total
    statistic = (
        ((first - expected_first) ** 2) / expected_first + ((second - expected_second) ** 2) / expected_second
    ).sum()
    return chi_square_p_value(float(statistic), int(keep.sum()) - 1)


def token_counts(sequences: torch.LongTensor, vocab_size: int) -> torch.Tensor:
    """
    Args:
        sequences (`torch.LongTensor` of shape `(runs, k)`): the first k generated tokens of each run.
        vocab_size (`int`): the number of possible tokens.

    Returns:
        `torch.Tensor` of shape `(k, vocab_size)`: how often each token appeared at each position.
    """
    counts = torch.zeros(sequences.shape[1], vocab_size, dtype=torch.long)
    for position in range(sequences.shape[1]):
        counts[position] += torch.bincount(sequences[:, position].cpu(), minlength=vocab_size)
    return counts
