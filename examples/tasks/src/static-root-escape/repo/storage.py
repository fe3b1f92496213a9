"""Mapping request paths to files under a served root directory."""

import os


class UnsafePathError(ValueError):
    """The requested path points outside the served root."""


def resolve(root, relative):
    """The absolute, normalized path of `relative` inside the directory `root`. Raises
    UnsafePathError if it would point outside root (through '..' or an absolute path)."""
    root = os.path.abspath(root)
    target = os.path.normpath(os.path.join(root, relative))
    if not target.startswith(root):
        raise UnsafePathError(relative)
    return target
