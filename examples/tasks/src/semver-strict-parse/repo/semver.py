"""MAJOR.MINOR.PATCH version strings."""

import re

_VERSION = re.compile(r"(\d+).(\d+).(\d+)")


def parse(text):
    """'1.2.3' -> (1, 2, 3). Raises ValueError unless the text (stripped) is exactly three
    dot-separated non-negative integers."""
    match = _VERSION.match(text.strip())
    if not match:
        raise ValueError(f"not a version: {text!r}")
    return tuple(int(part) for part in match.groups())


def is_newer(candidate, current):
    return parse(candidate) > parse(current)


def latest(versions):
    """The highest version of `versions` (as written)."""
    return max(versions, key=parse)
