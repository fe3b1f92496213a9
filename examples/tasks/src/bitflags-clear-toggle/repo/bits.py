"""Bit helpers for non-negative integers; bit 0 is the least significant."""


def set_bit(value, index):
    return value | (1 << index)


def clear_bit(value, index):
    return value & ~1 << index


def toggle_bit(value, index):
    """Flips bit `index`: a set bit becomes clear and a clear bit becomes set."""
    return value | (1 << index)


def get_bit(value, index):
    return bool((value >> index) & 1)


def popcount(value):
    count = 0
    while value:
        value &= value - 1
        count += 1
    return count


def is_power_of_two(value):
    """True when exactly one bit of `value` is set."""
    return value > 0 and value & (value - 1) == 0
