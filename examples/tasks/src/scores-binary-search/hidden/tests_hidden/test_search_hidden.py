import bisect
import unittest

from search import contains, count_between, lower_bound, upper_bound


class BoundsTest(unittest.TestCase):
    def test_past_the_end(self):
        self.assertEqual(lower_bound([1, 2, 3], 5), 3)
        self.assertEqual(upper_bound([1, 2, 3], 3), 3)

    def test_empty(self):
        self.assertEqual(lower_bound([], 1), 0)
        self.assertFalse(contains([], 1))

    def test_count_top_of_range(self):
        self.assertEqual(count_between([50, 70, 90, 100], 90, 100), 2)
        self.assertEqual(count_between([50, 70, 90, 100], 0, 1000), 4)

    def test_matches_bisect(self):
        values = [1, 1, 2, 4, 4, 4, 7, 9]
        for target in range(0, 11):
            self.assertEqual(lower_bound(values, target), bisect.bisect_left(values, target), target)
            self.assertEqual(upper_bound(values, target), bisect.bisect_right(values, target), target)
