import unittest

from calc import evaluate


class AssociativityTest(unittest.TestCase):
    def test_subtraction_chain(self):
        self.assertEqual(evaluate("10 - 4 - 3"), 3)

    def test_division_chain(self):
        self.assertEqual(evaluate("100 / 10 / 2"), 5.0)

    def test_mixed_additive(self):
        self.assertEqual(evaluate("8 - 2 + 1"), 7)

    def test_mixed_multiplicative(self):
        self.assertEqual(evaluate("12 / 3 * 2"), 8.0)

    def test_unary_and_parentheses(self):
        self.assertEqual(evaluate("-3 + 5"), 2)
        self.assertEqual(evaluate("2 * (10 - (4 - 3))"), 18)

    def test_precedence_kept(self):
        self.assertEqual(evaluate("1 + 2 * 3 - 4 / 2"), 5.0)
