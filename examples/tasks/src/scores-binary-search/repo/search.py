"""Binary searches over sorted lists."""


def _first_true(values, predicate):
    """The smallest index i with predicate(values[i]) true, for a predicate that is false and
    then true along the list; len(values) when it is never true."""
    lo, hi = 0, len(values) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if predicate(values[mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo


def lower_bound(values, target):
    """Index of the first element >= target (len(values) if there is none)."""
    return _first_true(values, lambda v: v >= target)


def upper_bound(values, target):
    """Index of the first element > target (len(values) if there is none)."""
    return _first_true(values, lambda v: v > target)


def count_between(values, low, high):
    """How many values v satisfy low <= v <= high."""
    return upper_bound(values, high) - lower_bound(values, low)


def contains(values, target):
    i = lower_bound(values, target)
    return i < len(values) and values[i] == target
