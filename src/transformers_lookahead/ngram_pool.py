"""The n-gram pool: recent n-grams keyed by their first token, stored as one trie per key."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from .token_tree import TokenTree


class NGramPool:
    """
    Recently seen n-grams by their first token: each key keeps its `max_per_key` most recently used continuations in
    a trie, so `tree(key)` is as large as their distinct prefixes.

    Args:
        continuation_length (`int`): tokens stored after each key (N - 1 for n-grams of size N).
        max_per_key (`int`): the most continuations kept per key (G). 0 keeps nothing.
    """

    def __init__(self, continuation_length: int, max_per_key: int):
        self.continuation_length = continuation_length
        self.max_per_key = max_per_key
        # Value: whether the continuation first entered the pool from the lookahead window (rather than from text).
        self._recent: dict[int, OrderedDict[tuple[int, ...], bool]] = {}
        # Trie node: token -> [number of continuations through it, children]
        self._tries: dict[int, dict[int, list]] = {}

    def __len__(self) -> int:
        return sum(len(recent) for recent in self._recent.values())

    def __contains__(self, ngram: Sequence[int]) -> bool:
        recent = self._recent.get(ngram[0])
        return recent is not None and tuple(ngram[1:]) in recent

    def add(self, key: int, continuation: Sequence[int], from_window: bool = False) -> None:
        """Records `continuation` after `key` as its most recent (`from_window`: guessed by the window, not read)."""
        if self.max_per_key == 0:
            return
        continuation = tuple(continuation)
        recent = self._recent.get(key)
        if recent is None:
            recent = self._recent[key] = OrderedDict()
            self._tries[key] = {}
        elif continuation in recent:
            recent.move_to_end(continuation)
            return
        recent[continuation] = from_window
        trie = self._tries[key]
        _trie_insert(trie, continuation)
        if len(recent) > self.max_per_key:
            evicted, _ = recent.popitem(last=False)
            _trie_remove(trie, evicted)

    def add_sequence(self, tokens: Sequence[int], first_key: int = 0) -> None:
        """Records every complete n-gram of `tokens` whose key is at index `first_key` or later."""
        length = self.continuation_length
        for start in range(max(first_key, 0), len(tokens) - length):
            self.add(tokens[start], tokens[start + 1 : start + 1 + length])

    def found_by_window(self, key: int, path: Sequence[int]) -> bool:
        """Whether every pooled continuation of `key` starting with `path` came from the window."""
        recent = self._recent.get(key)
        if not recent or not path:
            return False
        prefix = tuple(path)
        origins = [window for continuation, window in recent.items() if continuation[: len(prefix)] == prefix]
        return bool(origins) and all(origins)

    def continuations(self, key: int) -> list[tuple[int, ...]]:
        """The continuations kept for `key`, most recently used first."""
        return list(reversed(self._recent.get(key, ())))

    def tree(self, key: int, max_depth: int, tree: TokenTree | None = None) -> TokenTree:
        """The continuations of `key` as a token tree cut at `max_depth`, merged into `tree` where given."""
        tree = TokenTree() if tree is None else tree
        trie = self._tries.get(key)
        if not trie or max_depth < 1:
            return tree
        frontier = [(trie, -1)]
        for depth in range(1, max_depth + 1):
            next_frontier = []
            for children, parent in frontier:
                for token, (count, grandchildren) in children.items():
                    node = tree.ensure_child(parent, token, depth)
                    tree.counts[node] = count
                    if grandchildren:
                        next_frontier.append((grandchildren, node))
            frontier = next_frontier
        return tree


def _trie_insert(trie: dict[int, list], continuation: tuple[int, ...]) -> None:
    children = trie
    for token in continuation:
        node = children.get(token)
        if node is None:
            node = children[token] = [0, {}]
        node[0] += 1
        children = node[1]


def _trie_remove(trie: dict[int, list], continuation: tuple[int, ...]) -> None:
    children = trie
    for token in continuation:
        node = children[token]
        node[0] -= 1
        if node[0] == 0:
            # No other continuation passes through here: the whole subtree belonged to this one.
            del children[token]
            return
        children = node[1]
