import unittest

from transformers_lookahead.adaptive_planner import ContextIndex
from transformers_lookahead.ngram_pool import NGramPool
from transformers_lookahead.token_tree import TokenTree


class NGramPoolTest(unittest.TestCase):
    def test_lookup_and_lru(self):
        pool = NGramPool(continuation_length=2, max_per_key=2)
        pool.add(5, [1, 2])
        pool.add(5, [1, 3])
        pool.add(5, [1, 2])  # refreshes [1, 2]
        pool.add(5, [4, 4])  # evicts the least recently used: [1, 3]
        self.assertEqual(pool.continuations(5), [(4, 4), (1, 2)])
        self.assertNotIn([5, 1, 3], pool)
        self.assertIn([5, 1, 2], pool)
        self.assertEqual(pool.continuations(6), [])
        self.assertEqual(len(pool), 2)

    def test_zero_capacity_keeps_nothing(self):
        pool = NGramPool(continuation_length=2, max_per_key=0)
        pool.add(1, [2, 3])
        self.assertEqual(len(pool), 0)
        self.assertEqual(len(pool.tree(1, 2)), 0)

    def test_tree_merges_shared_prefixes(self):
        pool = NGramPool(continuation_length=3, max_per_key=4)
        pool.add(9, [1, 2, 3])
        pool.add(9, [1, 2, 4])
        pool.add(9, [5, 6, 7])
        tree = pool.tree(9, max_depth=3)
        # 1 -> 2 -> {3, 4} and 5 -> 6 -> 7: 7 nodes instead of 9 tokens
        self.assertEqual(len(tree), 7)
        self.assertEqual(tree.depths, sorted(tree.depths))
        for node, parent in enumerate(tree.parents):
            self.assertLess(parent, node)
        one = tree.child(-1, 1)
        two = tree.child(one, 2)
        self.assertEqual(tree.counts[one], 2)
        self.assertEqual({tree.tokens[c] for c in tree.children[two + 1].values()}, {3, 4})
        self.assertIsNone(tree.child(-1, 2))
        self.assertEqual(len(pool.tree(9, max_depth=1)), 2)

    def test_eviction_prunes_the_trie(self):
        pool = NGramPool(continuation_length=2, max_per_key=1)
        pool.add(0, [1, 2])
        pool.add(0, [1, 3])
        tree = pool.tree(0, 2)
        self.assertEqual(tree.tokens, [1, 3])
        self.assertEqual(tree.counts, [1, 1])

    def test_add_sequence(self):
        pool = NGramPool(continuation_length=2, max_per_key=4)
        tokens = [1, 2, 3, 4, 5]
        pool.add_sequence(tokens)
        self.assertEqual(len(pool), 3)  # keys 1, 2, 3: the last two tokens start no complete 3-gram
        tokens.append(6)
        pool.add_sequence(tokens, first_key=len(tokens) - 1 - 2)
        self.assertIn([4, 5, 6], pool)
        self.assertEqual(len(pool), 4)

    def test_found_by_window(self):
        pool = NGramPool(continuation_length=2, max_per_key=4)
        pool.add(1, [2, 3], from_window=True)
        pool.add(1, [4, 5])
        self.assertTrue(pool.found_by_window(1, [2]))
        self.assertFalse(pool.found_by_window(1, [4, 5]))
        pool.add(1, [2, 7])
        self.assertFalse(pool.found_by_window(1, [2]))
        self.assertFalse(pool.found_by_window(1, []))

    def test_subtree_keeps_structure(self):
        pool = NGramPool(continuation_length=2, max_per_key=4)
        pool.add(0, [1, 2])
        pool.add(0, [3, 4])
        tree = pool.tree(0, 2)
        keep = [tree.child(-1, 3), tree.child(tree.child(-1, 3), 4)]
        sub = tree.subtree(keep)
        self.assertIsInstance(sub, TokenTree)
        self.assertEqual(sub.tokens, [3, 4])
        self.assertEqual(sub.parents, [-1, 0])
        self.assertEqual(sub.child(0, 4), 1)
        self.assertEqual(sub.ancestors(1), [1, 0])


class ContextIndexTest(unittest.TestCase):
    def test_longest_recent_suffix_proposes_what_followed(self):
        index = ContextIndex(max_match=3)
        tokens = [1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 2, 3]
        index.update(tokens)
        # "2 3" last occurred at 5-6, followed by 5 6 7 ...
        self.assertEqual(index.continuation(tokens, 3), [5, 6, 7])
        tokens += [5]
        index.update(tokens)
        # "2 3 5" occurred at 5-7, followed by 6 7 2
        self.assertEqual(index.continuation(tokens, 3), [6, 7, 2])
        self.assertEqual(index.continuation([8], 3), [])
        self.assertEqual(index.continuation(tokens, 0), [])

    def test_continuation_merges_into_the_tree(self):
        pool = NGramPool(continuation_length=2, max_per_key=2)
        pool.add(0, [1, 2])
        tree = pool.tree(0, 2)
        tree.add_path([1, 5, 6])
        self.assertEqual(len(tree), 4)  # 1 is shared, 5 and 6 are new
        self.assertEqual([tree.tokens[n] for n in tree.context_path()], [1, 5, 6])
        self.assertEqual(tree.counts[tree.child(-1, 1)], 1)
        self.assertEqual(tree.depths[tree.context_path()[-1]], 3)

    def test_memory_merges_into_the_tree_with_counts(self):
        pool = NGramPool(continuation_length=2, max_per_key=2)
        pool.add(0, [1, 2])
        tree = pool.tree(0, 2)
        tree.add_memory(3, ((1, 2, 7), (1, 5), (8,)), max_nodes=10)
        self.assertEqual((tree.memory_total, tree.memory_match), (3, 3))
        one = tree.child(-1, 1)
        self.assertEqual(tree.memory_counts[one], 2)
        self.assertEqual(tree.counts[one], 1, "the pool's count is kept apart")
        self.assertEqual(tree.memory_counts[tree.child(tree.child(one, 2), 7)], 1)
        self.assertEqual(len(tree), 5)
        kept = tree.subtree([one, tree.child(one, 5)])
        self.assertEqual((kept.memory_counts, kept.memory_total, kept.memory_match), ([2, 1], 3, 3))

    def test_memory_adds_at_most_max_nodes(self):
        tree = TokenTree()
        tree.add_memory(1, ((1, 2, 3), (4, 5, 6)), max_nodes=4)
        self.assertEqual(tree.tokens, [1, 2, 3, 4])
        self.assertEqual(tree.memory_total, 2)
