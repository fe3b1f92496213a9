import unittest

from textstats import top_words, word_count


class TextStatsTest(unittest.TestCase):
    def test_count(self):
        self.assertEqual(word_count("Hello,  world!"), 2)

    def test_top(self):
        self.assertEqual(top_words("b a b c a b", 2), [("b", 3), ("a", 2)])


if __name__ == "__main__":
    unittest.main()
