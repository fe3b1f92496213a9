import unittest

from search import contains, count_between, lower_bound


class SearchTest(unittest.TestCase):
    def test_lower_bound_inside(self):
        self.assertEqual(lower_bound([10, 20, 20, 30], 20), 1)

    def test_contains(self):
        self.assertTrue(contains([1, 3, 5], 3))
        self.assertFalse(contains([1, 3, 5], 4))

    def test_count_middle(self):
        self.assertEqual(count_between([1, 2, 3, 4, 5], 2, 3), 2)


if __name__ == "__main__":
    unittest.main()
