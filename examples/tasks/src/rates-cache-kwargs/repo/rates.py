"""Conversion from US dollars."""

from cache import memoize

RATES = {"USD": 1.0, "EUR": 0.9, "GBP": 0.8, "JPY": 150.0}


@memoize
def convert(amount, currency="USD"):
    """`amount` US dollars in `currency`, rounded to two decimals."""
    return round(amount * RATES[currency], 2)
