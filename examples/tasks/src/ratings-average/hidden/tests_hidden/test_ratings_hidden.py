import unittest

from ratings import summarize
from stats import mean, percent


class FractionalResultsTest(unittest.TestCase):
    def test_mean_keeps_fraction(self):
        self.assertEqual(mean([4, 5]), 4.5)

    def test_percent_one_decimal(self):
        self.assertEqual(percent(1, 3), 33.3)
        self.assertEqual(percent(2, 3), 66.7)

    def test_summary(self):
        self.assertEqual(summarize([5, 4, 3, 5]), {"count": 4, "mean": 4.25, "five_star_percent": 50.0})
        self.assertEqual(summarize([5, 1, 1])["mean"], 2.33)
