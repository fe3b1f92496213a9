import unittest

from semver import latest, parse


class StrictParseTest(unittest.TestCase):
    def test_valid_with_whitespace(self):
        self.assertEqual(parse(" 3.14.159\n"), (3, 14, 159))

    def test_four_parts_rejected(self):
        with self.assertRaises(ValueError):
            parse("1.2.3.4")

    def test_other_separators_rejected(self):
        with self.assertRaises(ValueError):
            parse("1-2-3")

    def test_digits_only_rejected(self):
        with self.assertRaises(ValueError):
            parse("12345")

    def test_suffix_rejected(self):
        with self.assertRaises(ValueError):
            parse("1.2.3beta")

    def test_latest(self):
        self.assertEqual(latest(["0.9.12", "0.10.1", "0.10.0"]), "0.10.1")
