"""Subsets of small collections."""


def subsets(items):
    """All subsets of `items` as lists, in a stable order: subsets without the first item first.

    subsets(["a", "b"]) == [[], ["b"], ["a"], ["a", "b"]]
    """
    items = list(items)
    if not items:
        return []
    first, rest = items[0], items[1:]
    without = subsets(rest)
    return without + [[first] + s for s in without]


def subsets_of_size(items, k):
    return [s for s in subsets(items) if len(s) == k]


def count_with_sum(numbers, target):
    """How many subsets of `numbers` add up to `target` (the empty subset sums to 0)."""
    return sum(1 for s in subsets(numbers) if sum(s) == target)
