"""Memoization of pure functions."""

import functools


def memoize(func):
    """Caches `func`'s results by its arguments, positional and keyword (which must be hashable).
    `wrapper.cache_clear()` empties the cache."""
    cache = {}

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        key = args
        if key not in cache:
            cache[key] = func(*args, **kwargs)
        return cache[key]

    wrapper.cache = cache
    wrapper.cache_clear = cache.clear
    return wrapper
