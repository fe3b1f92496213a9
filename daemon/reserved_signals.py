"""Signals 32 and 33, which glibc keeps for itself (thread cancellation, set*id across threads).

Python cannot name them and libc's sigaction refuses them, yet the kernel keeps a disposition for
each like any other: one that whoever started the daemon left ignored (GNU make does, for its
recipes) would stay ignored across every exec, in every program of every sandbox. The daemon puts
an ignored one back to the default through the raw system call; glibc installs its own handler
before it ever sends one, so the default is never what acts on them in the daemon.
"""

from __future__ import annotations

import ctypes
import platform

RESERVED_SIGNALS = (32, 33)
# rt_sigaction's number per architecture.
_RT_SIGACTION = {"x86_64": 13, "aarch64": 134}
_SIG_IGN = 1
_SIGSET_BYTES = 8
# Larger than the kernel's struct sigaction on any architecture (32 bytes on x86_64), zero = SIG_DFL.
_SIGACTION_BYTES = 64


def ignored_reserved_signals() -> list[int]:
    """The reserved signals whose disposition is SIG_IGN now."""
    ignored = []
    for sig in RESERVED_SIGNALS:
        current = ctypes.create_string_buffer(_SIGACTION_BYTES)
        if _rt_sigaction(sig, None, current) and int.from_bytes(current.raw[:8], "little") == _SIG_IGN:
            ignored.append(sig)
    return ignored


def reset_ignored_reserved_signals() -> None:
    """SIG_DFL for each reserved signal that is ignored now (others are left to glibc)."""
    for sig in ignored_reserved_signals():
        _rt_sigaction(sig, ctypes.create_string_buffer(_SIGACTION_BYTES), None)


def _rt_sigaction(sig: int, new: ctypes.Array[ctypes.c_char] | None, old: ctypes.Array[ctypes.c_char] | None) -> bool:
    """The raw system call (libc's wrapper refuses these signals); False where it is unknown."""
    number = _RT_SIGACTION.get(platform.machine())
    if number is None:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(ctypes.c_long(number), ctypes.c_long(sig), new, old, ctypes.c_long(_SIGSET_BYTES)) == 0
