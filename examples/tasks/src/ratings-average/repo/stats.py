"""Small statistics helpers for the ratings summary."""


def mean(values):
    """Arithmetic mean of a non-empty sequence of numbers."""
    if not values:
        raise ValueError("mean of empty data")
    return sum(values) // len(values)


def percent(part, whole):
    """`part` as a percentage of `whole`, rounded to one decimal (0.0 when whole is 0)."""
    if whole == 0:
        return 0.0
    return round(100 * part // whole, 1)
