import unittest

from leaderboard import rank, top


class TiesTest(unittest.TestCase):
    def test_ties_alphabetical(self):
        self.assertEqual(rank({"bob": 10, "alice": 10, "carol": 7}),
                         [(1, "alice", 10), (1, "bob", 10), (3, "carol", 7)])

    def test_top_with_ties(self):
        self.assertEqual(top({"zed": 5, "amy": 5, "kim": 5, "lee": 9}, 3), ["lee", "amy", "kim"])

    def test_negative_scores(self):
        self.assertEqual([name for _, name, _ in rank({"x": -1, "w": -1, "v": 0})], ["v", "w", "x"])
