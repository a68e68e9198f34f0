import unittest

from transformers_lookahead.token_tree import TokenTree


class TokenTreeChainTest(unittest.TestCase):
    def test_the_chain_follows_the_most_travelled_child(self):
        tree = TokenTree()
        # 7 -> {8 -> 9, 8 -> 10, 5}: 8 is below the key twice, 5 once; below 8, 9 and 10 once each.
        for path in ([8, 9], [8, 10], [5]):
            node = -1
            for depth, token in enumerate(path, start=1):
                node = tree.ensure_child(node, token, depth)
                tree.counts[node] += 1
        self.assertEqual([tree.tokens[node] for node in tree.chain()], [8, 9], "the first added wins a tie")
        tree.add_path([5, 6, 4])
        tree.counts[tree.child(-1, 5)] += 1
        self.assertEqual([tree.tokens[node] for node in tree.chain()], [5, 6, 4], "copied from the context")

    def test_a_chain_is_a_path_and_empty_for_an_empty_tree(self):
        self.assertEqual(TokenTree().chain(), [])
        tree = TokenTree()
        tree.add_path([1, 2, 3])
        chain = tree.subtree(tree.chain())
        self.assertEqual(chain.parents, [-1, 0, 1])
        self.assertEqual(chain.depths, [1, 2, 3])
