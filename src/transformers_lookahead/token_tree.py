"""
The token tree a step verifies: candidate continuations of one key, merged so that candidates sharing a prefix
share nodes. Every candidate source (the n-gram pool, the context index, the suffix memory) offers one; the policy
prices it, the layout lays it out, verification walks it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class TokenTree:
    """
    Candidate continuations of one token, merged on shared prefixes: the verification branch of a step.

    Nodes are listed parents first. Node `i` holds `tokens[i]` at depth `depths[i]` (1 = the token right after the
    key), below node `parents[i]` (-1 = directly below the key).

    Args:
        tokens (`list[int]`): the token of each node.
        parents (`list[int]`): the parent node of each node, -1 for the children of the key.
        depths (`list[int]`): the depth of each node, >= 1.
        children (`list[dict[int, int]]`): for each node, its children by token; entry 0 is the key itself, node
            `i` is at entry `i + 1`.
        counts (`list[int]`): how many pooled continuations pass through each node.
        in_context (`list[bool]`): whether each node lies on the continuation copied from the context (see
            `ContextIndex`), as opposed to only on pooled n-grams.
        memory_counts (`list[int]`): how many continuations from the suffix memory (see `SuffixMemory`) pass
            through each node.
        memory_total (`int`): how many continuations the memory proposed (what passes through the key).
        memory_match (`int`): how many tokens of the sequence the memory matched to propose them (0: none).
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
        """The tree restricted to `nodes` (in any order), which must include the parent of each of its nodes."""
        tree = TokenTree(memory_total=self.memory_total, memory_match=self.memory_match)
        renumber = {-1: -1}
        for old in sorted(nodes):
            new = renumber[old] = tree.ensure_child(renumber[self.parents[old]], self.tokens[old], self.depths[old])
            tree.counts[new], tree.in_context[new] = self.counts[old], self.in_context[old]
            tree.memory_counts[new] = self.memory_counts[old]
        return tree

    def add_path(self, tokens: Sequence[int]) -> None:
        """Merges `tokens`, a continuation copied from the context, into the tree as one path flagged `in_context`."""
        node = -1
        for depth, token in enumerate(tokens, start=1):
            node = self.ensure_child(node, token, depth)
            self.in_context[node] = True

    def add_memory(self, match_length: int, continuations: Sequence[Sequence[int]], max_nodes: int) -> None:
        """
        Merges the continuations the suffix memory proposed after matching `match_length` tokens of the text, most
        recent first, while the tree gains at most `max_nodes` nodes, counting how many pass through each node.
        """
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
        """The child of `node` that holds `token`, created (from no source yet) if missing."""
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
        """
        One path down from the key, top down: at each node the child the most continuations pass through (pooled,
        remembered, or copied from the context), the first added on a tie. What a chain step verifies.
        """
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
