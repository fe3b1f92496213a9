"""ANSI escape removal: what `RunInShell(strip_ansi=True)` returns as `output_plain`, for callers
that clean terminal output themselves (the rollout engine's tool observations)."""

from __future__ import annotations

import re

# CSI sequences (colours, cursor moves), OSC sequences (window titles, hyperlinks) ended by BEL or
# ST, and the two-byte escapes.
ANSI_RE = re.compile(rb"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")


def strip_ansi(data: bytes) -> bytes:
    """`data` without ANSI escape sequences."""
    return ANSI_RE.sub(b"", data)
