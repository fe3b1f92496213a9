"""Normalization of user-profile fields."""

MAX_NICK_BYTES = 16


def truncate_utf8(text, max_bytes):
    """The longest prefix of `text` whose UTF-8 encoding is at most `max_bytes` bytes long."""
    return text[:max_bytes]


def clean_nickname(raw):
    """Collapses runs of whitespace, strips the ends, and truncates to MAX_NICK_BYTES."""
    text = " ".join(raw.split())
    return truncate_utf8(text, MAX_NICK_BYTES)
