"""The disk cap of a rootless sandbox that has no capped tmpfs (its cap is above
local.rootless_tmpfs_max_bytes, or the node has no overlay over one): the daemon sums what the
sandbox's writable directories hold, again and again, and past the cap kills every process of the
sandbox but its init (docs/local-backend.md, "Limits without root").

Like the out-of-memory killer for memory, and unlike a filesystem's cap, it acts after the fact:
a write past the cap succeeds, and a sandbox may hold up to what it writes in one interval more
than its cap until the next sum. The command or shell turn whose processes were killed says so
(ExitStatus.disk_cap_killed, RunInShellResponse.disk_cap_killed); what the sandbox wrote stays, so that it may remove files (a
command run while it is still past the cap is killed at the next sum too).

The sum is du's (hard links once, holes not counted), run in the sandbox's user namespace, where
the daemon's uid is root: a directory the sandbox made unreadable (its own, so the daemon's uid's)
is still counted. It costs a walk of the sandbox's files; the pause between two walks is
at least INTERVAL_S and at least ten times the last walk, so watching takes at most a tenth of a
core per sandbox whatever it holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import time
from collections.abc import Callable, Sequence

from ...cgroups import LimitSupport
from . import nsprocs

log = logging.getLogger(__name__)

INTERVAL_S = 1.0
# A walk's share of the time: the pause after a walk is at least this many times as long.
PAUSE_PER_WALK = 10


def usage_bytes(in_userns: Sequence[str], paths: Sequence[str]) -> int:
    """The bytes the files under `paths` take on disk together (each hard-linked file once),
    summed by du run under `in_userns` (forkcopy.in_sandbox_userns, in_own_userns)."""
    done = subprocess.run(
        [*in_userns, "du", "-s", "-x", "-c", "-B1", "--", *paths],
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines or not lines[-1].split()[0].isdigit():
        raise OSError(f"du could not sum {', '.join(paths)}: {done.stderr.strip() or done.returncode}")
    return int(lines[-1].split()[0])


class DiskWatch:
    """Watches one sandbox: `paths()` its writable directories now, `in_userns` the prefix that
    runs du in its user namespace, `init_pid()` its init's host pid, `alive()` whether it still
    runs, `baseline` what they held when it started that the cap does not count (a copied
    image)."""

    def __init__(
        self,
        sandbox_id: str,
        cap_bytes: int,
        in_userns: Sequence[str],
        paths: Callable[[], Sequence[str]],
        init_pid: Callable[[], int],
        alive: Callable[[], bool],
        baseline: int = 0,
    ) -> None:
        self.sandbox_id = sandbox_id
        self.cap_bytes = cap_bytes
        self.in_userns = list(in_userns)
        self.paths = paths
        self.init_pid = init_pid
        self.alive = alive
        self.baseline = baseline
        # Times the sandbox's processes were killed for its disk (execs compare it before and after).
        self.kills = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def check(self) -> bool:
        """One sum; past the cap, the sandbox's processes killed. Whether they were."""
        used = await asyncio.to_thread(usage_bytes, self.in_userns, self.paths()) - self.baseline
        if used <= self.cap_bytes:
            return False
        # Counted before the kill: a command that sees its process die sees the count too.
        self.kills += 1
        killed = await asyncio.to_thread(nsprocs.kill_all, self.init_pid())
        log.warning(
            "sandbox %s holds %d bytes, past its disk cap of %d: killed its %d processes",
            self.sandbox_id,
            used,
            self.cap_bytes,
            killed,
        )
        return True

    async def _watch(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.check()
            except (OSError, subprocess.SubprocessError) as err:
                if not self.alive():
                    return  # (its init is gone: nothing left to sum until it is destroyed)
                log.warning("cannot sum the disk of sandbox %s: %s", self.sandbox_id, err)
            await asyncio.sleep(max(INTERVAL_S, PAUSE_PER_WALK * (time.monotonic() - started)))


def watcher_mechanism(per_file: LimitSupport) -> str:
    """The watcher as a limit's mechanism, with RLIMIT_FSIZE where `per_file` (the rlimits'
    report of the disk) says it is set."""
    fsize = "; RLIMIT_FSIZE caps each file" if per_file.approximated else ""
    return f"a watcher that sums the sandbox's writable directories and kills its processes past the cap{fsize}"


def rootless_disk_support(tmpfs_max_bytes: int, why_not_tmpfs: str, watcher: str) -> LimitSupport:
    """The disk cap of a daemon without root as the node reports it: enforced by a capped tmpfs
    for caps up to `tmpfs_max_bytes` (0: none), larger ones approximated by the `watcher`."""
    if tmpfs_max_bytes:
        return LimitSupport(
            True,
            f"a size-capped tmpfs in the sandbox's own mount namespace for caps up to {tmpfs_max_bytes} bytes "
            f"(what it holds is memory); larger caps approximated by {watcher}",
        )
    why = why_not_tmpfs or "local.rootless_tmpfs_max_bytes is 0"
    return LimitSupport(False, watcher, reason=f"no capped tmpfs: {why}", approximated=True)


def sandbox_disk_support(tmpfs_bytes: int, node: LimitSupport, watcher: str) -> LimitSupport:
    """One sandbox's disk cap: its capped tmpfs (`tmpfs_bytes`, 0: none), else the `watcher`."""
    if tmpfs_bytes:
        return LimitSupport(True, "a size-capped tmpfs in the sandbox's own mount namespace (what it holds is memory)")
    if not node.enforced:
        return node
    return LimitSupport(False, watcher, reason="its cap is above local.rootless_tmpfs_max_bytes", approximated=True)
