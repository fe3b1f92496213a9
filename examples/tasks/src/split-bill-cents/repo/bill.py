"""Splitting bills given in integer cents."""


def split(total_cents, people):
    """`people` shares of `total_cents` that add up to it exactly and differ by at most one
    cent; the first shares are the larger ones."""
    if people < 1:
        raise ValueError("need at least one person")
    share = round(total_cents / people)
    return [share] * people


def split_named(total_cents, names):
    """{name: share} in the order of `names`."""
    return dict(zip(names, split(total_cents, len(names))))
