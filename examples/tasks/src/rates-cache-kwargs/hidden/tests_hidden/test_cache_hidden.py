import unittest

from cache import memoize
from rates import convert


class KeywordKeyTest(unittest.TestCase):
    def setUp(self):
        convert.cache_clear()

    def test_keyword_currency(self):
        self.assertEqual(convert(100), 100.0)
        self.assertEqual(convert(100, currency="EUR"), 90.0)
        self.assertEqual(convert(100, currency="GBP"), 80.0)

    def test_still_cached(self):
        calls = []

        @memoize
        def slow(x, scale=1):
            calls.append((x, scale))
            return x * scale

        self.assertEqual([slow(2), slow(2), slow(2, scale=3), slow(2, scale=3)], [2, 2, 6, 6])
        self.assertEqual(calls, [(2, 1), (2, 3)])

    def test_keyword_order_irrelevant(self):
        @memoize
        def pair(a=0, b=0):
            return (a, b)

        self.assertEqual(pair(a=1, b=2), (1, 2))
        self.assertEqual(pair(b=2, a=1), (1, 2))
        self.assertEqual(pair(a=2, b=1), (2, 1))
