import unittest

from leaderboard import rank, top


class RankTest(unittest.TestCase):
    def test_distinct_scores(self):
        self.assertEqual(rank({"a": 1, "b": 3, "c": 2}), [(1, "b", 3), (2, "c", 2), (3, "a", 1)])

    def test_top(self):
        self.assertEqual(top({"a": 1, "b": 3, "c": 2}, 2), ["b", "c"])


if __name__ == "__main__":
    unittest.main()
