import unittest

from ratings import summarize


class SummarizeTest(unittest.TestCase):
    def test_uniform_ratings(self):
        self.assertEqual(summarize([4, 4, 4]), {"count": 3, "mean": 4, "five_star_percent": 0.0})

    def test_empty(self):
        self.assertEqual(summarize([]), {"count": 0, "mean": None, "five_star_percent": 0.0})

    def test_out_of_range(self):
        with self.assertRaises(ValueError):
            summarize([0, 3])


if __name__ == "__main__":
    unittest.main()
