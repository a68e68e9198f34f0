"""The Jacobi lookahead window: W columns x (N - 1) levels of guessed future tokens."""

from __future__ import annotations

import torch

# Seed of the window's private generator: the initial guesses are the same on every run, and the user's global
# random state is never touched (sampling with a fixed seed must stay reproducible with or without lookahead).
WINDOW_SEED = 0


class LookaheadWindow:
    """
    The lookahead branch of a step, on the host. Level `l` column `i` guesses the token at position `p + 1 + l + i`
    (`p`: the last accepted token's). Each step feeds every level; the top level's outputs become the new top level
    and the older levels shift down, so each column keeps N - 1 successive guesses (one Jacobi iteration per step)
    and yields the n-gram `(level 0, ..., level N-2, new top)`. The levels start as tokens drawn from the prompt,
    which converge to useful n-grams sooner than random ids.

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
        # The bottom level is the oldest; until N - 2 updates have happened, some of its levels are still the
        # initial draw rather than model outputs, and their n-grams would only pollute the pool.
        self._updates_until_ngrams = levels - 1

    def __len__(self) -> int:
        return self.window * self.levels

    def flat(self) -> list[int]:
        """All guesses, level by level: the window part of the step's input ids."""
        return [token for level in self.tokens for token in level]

    def update(self, top: list[int]) -> list[list[int]]:
        """
        Applies one Jacobi iteration with `top`, the model's choices at the top level, one per column; returns the
        n-grams the columns completed (N tokens each), none while the window still holds initial guesses.
        """
        ngrams = []
        if self._updates_until_ngrams > 0:
            self._updates_until_ngrams -= 1
        else:
            ngrams = [list(column) for column in zip(*self.tokens, top)]
        self.tokens = self.tokens[1:] + [list(top)]
        return ngrams
