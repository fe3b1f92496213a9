"""The processes of a rootless sandbox that no cgroup holds, found by their pid namespace: paused
around a fork's copy (no cgroup freezer) and killed by the disk watcher (diskwatch.py).

Every process of the sandbox is in the pid namespace of its init (bubblewrap's pid 1, `init_pid`
on the host), commands included: nsenter forks them into it. The daemon's user may read each
one's namespace links (same uid; it owns the sandbox's user namespace besides). Pids 1 and 2
inside are bubblewrap's init and the sandbox's init script, whose end would end the sandbox.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

# The inside pids of the processes that keep the sandbox alive: bubblewrap's init and its child.
KEEPERS = ("1", "2")
# Rounds of the walk that stops processes: a process may fork while the walk runs, and its
# child is found by the next round.
ROUNDS = 8


def _namespace(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/pid").st_ino


def _inside_pid_and_state(pid: str) -> tuple[str, str]:
    """(the process's pid in its own namespace, its state letter), ("", "") when it is gone."""
    inside = state = ""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("State:"):
                state = line.split()[1]
            elif line.startswith("NSpid:"):
                inside = line.split()[-1]
    return inside, state


def members(init_pid: int) -> dict[int, str]:
    """Host pid -> state letter of every process in the sandbox's pid namespace but its keepers."""
    try:
        ns = _namespace(init_pid)
    except OSError:
        return {}
    found: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if _namespace(int(entry)) != ns:
                continue
        except OSError:
            continue
        inside, state = _inside_pid_and_state(entry)
        if inside and inside not in KEEPERS and state not in ("Z", "X"):  # (the dead wait to be reaped)
            found[int(entry)] = state
    return found


def stop_all(init_pid: int) -> list[int]:
    """SIGSTOPs every process of the sandbox but its keepers, walking again until no new one
    appears, and returns those it stopped: not the ones that were stopped already (a shell's
    suspended job stays suspended when they are resumed)."""
    stopped: list[int] = []
    seen: set[int] = set()
    for _ in range(ROUNDS):
        new = {pid: state for pid, state in members(init_pid).items() if pid not in seen}
        if not new:
            break
        seen.update(new)
        for pid, state in new.items():
            if state in ("T", "t"):
                continue
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
    return stopped


def resume(stopped: list[int]) -> None:
    """SIGCONTs what stop_all stopped, and each one's parent outside the sandbox: nsenter, which
    stops itself when its child stops and resumes it only once continued itself."""
    for pid in stopped:
        parent = _parent(pid)
        for target in (parent, pid) if parent and _outside(parent, pid) else (pid,):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(target, signal.SIGCONT)


def kill_all(init_pid: int) -> int:
    """SIGKILLs every process of the sandbox but its keepers (stopped first, so that none forks
    past the walk); returns how many."""
    stopped = stop_all(init_pid)
    # (Those stopped before the walk too: SIGKILL reaches a stopped process.)
    killed = {*stopped, *members(init_pid)}
    for pid in killed:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    # An nsenter whose child the walk stopped stopped itself too: continued, it reaps the child
    # and ends as it did (the command's caller sees it killed).
    resume(stopped)
    return len(killed)


def _parent(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat.rsplit(")", 1)[1].split()[1])


def _outside(parent: int, pid: int) -> bool:
    try:
        return _namespace(parent) != _namespace(pid)
    except OSError:
        return False
