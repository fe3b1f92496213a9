"""Splits a list of items into numbered pages (page numbers start at 1)."""

import math


def page_count(total, per_page):
    """Number of pages needed to show `total` items, `per_page` on each (always at least 1)."""
    if per_page <= 0:
        raise ValueError("per_page must be positive")
    return max(1, math.ceil(total / per_page))


def paginate(items, page, per_page=10):
    """The items on page `page` (1-based). Raises ValueError for a page out of range."""
    pages = page_count(len(items), per_page)
    if page < 1 or page > pages:
        raise ValueError(f"page {page} out of range 1..{pages}")
    start = page * per_page
    return items[start:start + per_page]
