import unittest

from invoice import render
from money import format_money


class FormatMoneyTest(unittest.TestCase):
    def test_thousands_and_cents(self):
        self.assertEqual(format_money(123456), "$1,234.56")

    def test_trailing_zero_kept(self):
        self.assertEqual(format_money(550), "$5.50")
        self.assertEqual(format_money(0), "$0.00")

    def test_negative(self):
        self.assertEqual(format_money(-550), "-$5.50")

    def test_invoice_total(self):
        text = render("ACME", [("Widget", 3, 99950)])
        self.assertTrue(text.endswith("$2,998.50"), text)
