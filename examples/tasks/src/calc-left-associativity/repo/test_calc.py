import unittest

from calc import CalcError, evaluate, tokenize


class CalcTest(unittest.TestCase):
    def test_tokenize(self):
        self.assertEqual(tokenize("2*(3.5+4)"), [2, "*", "(", 3.5, "+", 4, ")"])

    def test_precedence(self):
        self.assertEqual(evaluate("2 + 3 * 4"), 14)
        self.assertEqual(evaluate("2 * (3 + 4)"), 14)

    def test_errors(self):
        for text in ("2 +", "(1", "1 2", "3 $ 4"):
            with self.assertRaises(CalcError, msg=text):
                evaluate(text)


if __name__ == "__main__":
    unittest.main()
