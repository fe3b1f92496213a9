"""Formatting of amounts given in integer cents."""


def format_money(cents, currency="$"):
    """123456 -> '$1,234.56'; -550 -> '-$5.50'; 0 -> '$0.00'."""
    sign = "-" if cents < 0 else ""
    amount = abs(cents) / 100
    return f"{sign}{currency}{amount:,.2}"
