"""HostProcess collects a command's exit status as the kernel gives it."""

from __future__ import annotations

import asyncio
import os

from corral.daemon import process


def test_an_exit_the_pidfd_reports_early_is_still_collected(monkeypatch):
    """The pidfd can say a process ended a moment before waitpid may collect it: the status must
    be looked for again, not taken for a process stuck in the kernel (exit 137, SIGKILL)."""
    real_waitpid = os.waitpid
    early = {"answers": 3}

    def waitpid(pid: int, options: int):
        if options & os.WNOHANG and early["answers"]:
            early["answers"] -= 1
            return 0, 0  # the kernel's window: not yet collectable
        return real_waitpid(pid, options)

    monkeypatch.setattr(process.os, "waitpid", waitpid)

    async def main() -> process.ProcessExit:
        proc = process.HostProcess(["sh", "-c", "echo out; exit 3"], env={"PATH": "/usr/bin:/bin"}, stdin=None)
        output: list[bytes] = []
        exit = await proc.run(lambda stream, data: output.append(data), timeout=10)
        assert b"".join(output) == b"out\n"
        return exit

    exit = asyncio.run(main())
    assert (exit.exit_code, exit.signal, exit.timed_out) == (3, 0, False)
    assert early["answers"] == 0
