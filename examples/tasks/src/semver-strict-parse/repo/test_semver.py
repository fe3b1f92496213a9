import unittest

from semver import is_newer, latest, parse


class SemverTest(unittest.TestCase):
    def test_parse(self):
        self.assertEqual(parse("0.1.22"), (0, 1, 22))

    def test_numeric_order(self):
        self.assertTrue(is_newer("1.10.0", "1.9.9"))
        self.assertEqual(latest(["2.0.0", "10.0.0", "9.9.9"]), "10.0.0")

    def test_garbage(self):
        with self.assertRaises(ValueError):
            parse("v1")


if __name__ == "__main__":
    unittest.main()
