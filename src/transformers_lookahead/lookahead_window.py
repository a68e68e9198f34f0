"""The Jacobi lookahead window: W columns x (N - 1) levels of guessed future tokens."""

from __future__ import annotations

import torch

# The window's own generator: the same first guesses every run, and the user's random state untouched.
WINDOW_SEED = 0


class LookaheadWindow:
    """
    The lookahead branch, on the host: level `l` column `i` guesses position `p + 1 + l + i`. Each step's top-level
    outputs become the new top level and the others shift down (one Jacobi iteration), so each column yields the
    n-gram `(level 0, ..., level N-2, new top)`. The levels start as tokens drawn from the prompt.

    Args:
        window (`int`): W, the number of columns.
        levels (`int`): N - 1, the number of levels.
        prompt_ids (`list[int]`): the prompt the initial guesses are drawn from.
    """

    def __init__(self, window: int, levels: int, prompt_ids: list[int]):
        generator = torch.Generator().manual_seed(WINDOW_SEED)
        picks = torch.randint(len(prompt_ids), (levels, window), generator=generator, device="cpu").tolist()
        self.tokens = [[prompt_ids[pick] for pick in level] for level in picks]
        self.window = window
        self.levels = levels
        # Until N - 2 updates, some levels are still the initial draw: their n-grams would pollute the pool.
        self._updates_until_ngrams = levels - 1

    def __len__(self) -> int:
        return self.window * self.levels

    def flat(self) -> list[int]:
        """All guesses, level by level: the window part of the step's input ids."""
        return [token for level in self.tokens for token in level]

    def update(self, top: list[int]) -> list[list[int]]:
        """One Jacobi iteration with the model's choices at the top level; returns the n-grams the columns completed."""
        ngrams = []
        if self._updates_until_ngrams > 0:
            self._updates_until_ngrams -= 1
        else:
            ngrams = [list(column) for column in zip(*self.tokens, top)]
        self.tokens = self.tokens[1:] + [list(top)]
        return ngrams
