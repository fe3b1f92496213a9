import unittest

from bill import split, split_named


class SplitTest(unittest.TestCase):
    def test_even(self):
        self.assertEqual(split(900, 3), [300, 300, 300])

    def test_named(self):
        self.assertEqual(split_named(1000, ["a", "b"]), {"a": 500, "b": 500})

    def test_nobody(self):
        with self.assertRaises(ValueError):
            split(100, 0)


if __name__ == "__main__":
    unittest.main()
