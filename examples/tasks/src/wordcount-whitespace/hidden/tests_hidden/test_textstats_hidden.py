import unittest

from textstats import top_words, word_count, words


class WhitespaceTest(unittest.TestCase):
    def test_newlines(self):
        self.assertEqual(word_count("one two\nthree"), 3)

    def test_tabs_and_crlf(self):
        self.assertEqual(words("Alpha\tbeta,\r\nGamma."), ["alpha", "beta", "gamma"])

    def test_top_across_lines(self):
        self.assertEqual(top_words("to be\nor not\nto be", 2), [("be", 2), ("to", 2)])
