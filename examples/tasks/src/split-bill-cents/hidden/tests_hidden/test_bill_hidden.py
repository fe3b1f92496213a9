import unittest

from bill import split, split_named


class ExactSplitTest(unittest.TestCase):
    def test_remainder_one(self):
        self.assertEqual(split(1000, 3), [334, 333, 333])

    def test_remainder_two(self):
        self.assertEqual(split(500, 3), [167, 167, 166])

    def test_invariants(self):
        for total in (1, 99, 1001, 12345):
            for people in range(1, 8):
                shares = split(total, people)
                self.assertEqual(sum(shares), total, (total, people))
                self.assertLessEqual(max(shares) - min(shares), 1)
                self.assertEqual(shares, sorted(shares, reverse=True))

    def test_named(self):
        self.assertEqual(split_named(10, ["ann", "bob", "cy"]), {"ann": 4, "bob": 3, "cy": 3})
