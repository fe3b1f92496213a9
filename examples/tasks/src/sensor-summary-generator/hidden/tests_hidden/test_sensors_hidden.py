import unittest

from sensors import summarize


class SummarizeTest(unittest.TestCase):
    def test_summary(self):
        result = summarize(["20.5", "# comment", "22.0", "21.0"])
        self.assertEqual(result["count"], 3)
        self.assertEqual(result["min"], 20.5)
        self.assertEqual(result["max"], 22.0)
        self.assertAlmostEqual(result["mean"], 21.1666666, places=5)

    def test_single_reading(self):
        self.assertEqual(summarize(["-3"]), {"count": 1, "min": -3.0, "max": -3.0, "mean": -3.0})

    def test_accepts_a_file_like_iterator(self):
        result = summarize(iter(["1", "2", "3", "4"]))
        self.assertEqual((result["count"], result["mean"]), (4, 2.5))
