import unittest

from combos import count_with_sum, subsets, subsets_of_size


class SubsetsTest(unittest.TestCase):
    def test_empty_input(self):
        self.assertEqual(subsets([]), [[]])

    def test_two_items(self):
        self.assertEqual(subsets(["a", "b"]), [[], ["b"], ["a"], ["a", "b"]])

    def test_sizes(self):
        self.assertEqual(len(subsets("abcd")), 16)
        self.assertEqual(len(subsets_of_size("abcd", 2)), 6)

    def test_count_with_sum(self):
        self.assertEqual(count_with_sum([1, 2, 3, 4], 5), 2)
        self.assertEqual(count_with_sum([1, 2], 0), 1)
