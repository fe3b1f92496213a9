import unittest

from sensors import parse_readings, summarize


class SensorsTest(unittest.TestCase):
    def test_parse(self):
        self.assertEqual(list(parse_readings(["1.5", "", "# x", " 2 "])), [1.5, 2.0])

    def test_no_readings(self):
        with self.assertRaises(ValueError):
            summarize(["# only a comment"])


if __name__ == "__main__":
    unittest.main()
