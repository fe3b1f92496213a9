import unittest

from profiles import clean_nickname


class NicknameTest(unittest.TestCase):
    def test_whitespace(self):
        self.assertEqual(clean_nickname("  ann   lee "), "ann lee")

    def test_ascii_truncated(self):
        self.assertEqual(clean_nickname("abcdefghijklmnopqrstuvwxyz"), "abcdefghijklmnop")


if __name__ == "__main__":
    unittest.main()
