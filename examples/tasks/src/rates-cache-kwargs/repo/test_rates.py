import unittest

from rates import convert


class ConvertTest(unittest.TestCase):
    def setUp(self):
        convert.cache_clear()

    def test_positional(self):
        self.assertEqual(convert(100), 100.0)
        self.assertEqual(convert(100, "EUR"), 90.0)


if __name__ == "__main__":
    unittest.main()
