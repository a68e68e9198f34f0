"""The token tree a step verifies: candidate continuations of one key, merged on shared prefixes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class TokenTree:
    """
    Candidate continuations of one token: the verification branch of a step. Nodes are listed parents first; node
    `i` holds `tokens[i]` at depth `depths[i]` (1: right after the key) below `parents[i]` (-1: the key).

    Args:
        tokens (`list[int]`), parents (`list[int]`), depths (`list[int]`): per node.
        children (`list[dict[int, int]]`): children by token, the key's at entry 0 and node `i`'s at `i + 1`.
        counts (`list[int]`): pooled continuations through each node.
        in_context (`list[bool]`): whether each node lies on the continuation copied from the context.
        memory_counts (`list[int]`): suffix-memory continuations through each node.
        memory_total (`int`): continuations the memory proposed.
        memory_match (`int`): tokens of the text the memory matched to propose them (0: none).
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    children: list[dict[int, int]] = field(default_factory=lambda: [{}])
    counts: list[int] = field(default_factory=list)
    in_context: list[bool] = field(default_factory=list)
    memory_counts: list[int] = field(default_factory=list)
    memory_total: int = 0
    memory_match: int = 0

    def __len__(self) -> int:
        return len(self.tokens)

    def child(self, node: int, token: int) -> int | None:
        """The child of `node` (-1 = the key) that holds `token`, or None."""
        return self.children[node + 1].get(token)

    def subtree(self, nodes: list[int]) -> TokenTree:
        """The tree restricted to `nodes`, which must hold each of their parents."""
        tree = TokenTree(memory_total=self.memory_total, memory_match=self.memory_match)
        renumber = {-1: -1}
        for old in sorted(nodes):
            new = renumber[old] = tree.ensure_child(renumber[self.parents[old]], self.tokens[old], self.depths[old])
            tree.counts[new], tree.in_context[new] = self.counts[old], self.in_context[old]
            tree.memory_counts[new] = self.memory_counts[old]
        return tree

    def add_path(self, tokens: Sequence[int]) -> None:
        """Merges a continuation copied from the context as one path flagged `in_context`."""
        node = -1
        for depth, token in enumerate(tokens, start=1):
            node = self.ensure_child(node, token, depth)
            self.in_context[node] = True

    def add_memory(self, match_length: int, continuations: Sequence[Sequence[int]], max_nodes: int) -> None:
        """Merges the memory's `continuations` (most recent first, matched on `match_length` tokens), `max_nodes` at most."""
        added = 0
        self.memory_match = match_length
        for continuation in continuations:
            node, path = -1, []
            for depth, token in enumerate(continuation, start=1):
                child = self.child(node, token)
                if child is None:
                    if added == max_nodes:
                        break
                    added += 1
                    child = self.ensure_child(node, token, depth)
                node = child
                path.append(node)
            if not path:
                break
            self.memory_total += 1
            for child in path:
                self.memory_counts[child] += 1

    def ensure_child(self, node: int, token: int, depth: int) -> int:
        """The child of `node` holding `token`, created if missing."""
        child = self.child(node, token)
        if child is None:
            child = len(self.tokens)
            self.tokens.append(token)
            self.parents.append(node)
            self.depths.append(depth)
            self.counts.append(0)
            self.in_context.append(False)
            self.memory_counts.append(0)
            self.children.append({})
            self.children[node + 1][token] = child
        return child

    def chain(self) -> list[int]:
        """The path a chain step verifies: at each node the child most continuations pass through (first on a tie)."""
        path, node = [], -1
        while self.children[node + 1]:
            node = max(
                self.children[node + 1].values(),
                key=lambda child: (self.counts[child] + self.memory_counts[child] + self.in_context[child], -child),
            )
            path.append(node)
        return path

    def context_path(self) -> list[int]:
        """The nodes flagged `in_context`, from the top down."""
        return [node for node, flagged in enumerate(self.in_context) if flagged]

    def ancestors(self, node: int) -> list[int]:
        """`node` and every node above it, deepest first."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path
