"""cgroup detection and per-sandbox groups, for cgroup v1, v2 and hybrid hosts.

A controller can be attached to one hierarchy only, so each of memory, pids and cpu is taken from
wherever the host mounts it: a v1 hierarchy of its own, or the v2 unified hierarchy when it lists
the controller. Process tracking (finding every process of a sandbox or of one command, to kill the
whole tree) uses the v2 hierarchy where it is writable, else the first v1 hierarchy we use.

Layout under the daemon's own cgroup in each hierarchy:
    corral-<daemon_id>/<sandbox_id>/            limits live here
    corral-<daemon_id>/<sandbox_id>/<leaf>/     processes live here (init, a leaf per command)
Processes only ever sit in leaves, which keeps v2's "no internal processes" rule.

Every directory is a cgroup the kernel counts node-wide (at most 65,535 memory cgroups), so the
driver tallies what it holds (`held`, the corral_cgroups_held metric) and short commands reuse
their sandbox's leaves (`LeafPool`) instead of leaving one behind per command.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

CONTROLLERS = ("memory", "pids", "cpu")
CPU_PERIOD_US = 100_000
# cgroup v2's cpu.weight scale (its default is 100); v1's cpu.shares is 1024 for the same weight.
CPU_WEIGHT_DEFAULT = 100
V1_SHARES_PER_WEIGHT = 1024 / CPU_WEIGHT_DEFAULT


def cpu_weight_file(version: int, weight: int) -> tuple[str, str]:
    """The file and value that give a group `weight` (v2's scale) in a hierarchy of `version`."""
    if version == 1:
        return "cpu.shares", str(v1_cpu_shares(weight))
    return "cpu.weight", str(weight)


def v1_cpu_shares(weight: int) -> int:
    """cgroup v1's cpu.shares (and Docker's cpu_shares) for a weight on v2's scale."""
    return max(2, round(weight * V1_SHARES_PER_WEIGHT))


def _write_cpu_weight(version: int, path: Path, weight: int) -> None:
    name, value = cpu_weight_file(version, weight)
    _write(path / name, value)


class DirTally:
    """How many cgroup directories the daemon made in one hierarchy and has not removed yet.
    Counted as they are made and removed (from the event loop and from worker threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0

    def add(self, n: int) -> None:
        with self._lock:
            self.count += n


@dataclass(frozen=True)
class Hierarchy:
    """One mounted cgroup hierarchy and the directory we create our groups in."""

    version: int  # 1 or 2
    base: Path  # corral-<daemon_id> under the daemon's own cgroup
    controllers: frozenset[str]
    mount_root: str = "/"  # the cgroup path the mount shows at its mount point
    mount_point: str = ""
    key: str = ""  # how /proc/PID/cgroup names this hierarchy: a v1 controller, "" for v2
    # Shared by every group in this hierarchy, so that whichever code makes or removes a
    # directory keeps the count true.
    held: DirTally = field(default_factory=DirTally, compare=False, repr=False)

    @property
    def label(self) -> str:
        """How metrics name the hierarchy: "v2", or "v1:" and its controllers."""
        return "v2" if self.version == 2 else "v1:" + ",".join(sorted(self.controllers))


@dataclass(frozen=True)
class LimitSupport:
    """Whether one kind of limit holds: enforced (`mechanism` says how), approximated (not
    enforced, but a weaker stand-in holds something like it: an rlimit per process, which
    `mechanism` names with what it misses; `reason` says why not the real thing), or absent
    (`reason` says why)."""

    enforced: bool
    mechanism: str = ""
    reason: str = ""
    approximated: bool = False


def _mountinfo() -> list[tuple[str, str, str, str]]:
    """(mount root, mount point, fstype, super options) for every cgroup mount."""
    mounts = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if rfields and rfields[0] in ("cgroup", "cgroup2"):
                mounts.append((fields[3], fields[4], rfields[0], rfields[2] if len(rfields) > 2 else ""))
    return mounts


def _self_cgroups() -> dict[str, str]:
    """Maps a v1 controller name (or "" for v2) to this process's cgroup path."""
    return _cgroup_paths("/proc/self/cgroup")


def _cgroup_paths(proc_file: str) -> dict[str, str]:
    paths: dict[str, str] = {}
    with open(proc_file) as fh:
        for line in fh:
            _, names, path = line.rstrip("\n").split(":", 2)
            for name in names.split(",") if names else [""]:
                paths[name] = path
    return paths


def _join(mount_root: str, mount_point: str, cgroup_path: str) -> Path:
    rel = os.path.relpath(cgroup_path, mount_root) if cgroup_path.startswith(mount_root) else "."
    return Path(mount_point, rel).resolve()


def _writable_dir(path: Path) -> bool:
    probe = path / f".corral-probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
        return True
    except OSError:
        return False


def _write(path: Path, value: str) -> None:
    with open(path, "w") as fh:
        fh.write(value)


class CgroupDriver:
    """Detects what this host offers once, at daemon start, and creates sandbox groups."""

    def __init__(
        self,
        daemon_id: str,
        create: bool = True,
        *,
        sandboxes_cpu_weight: int = 0,
        sandbox_cpu_weight: int = 0,
        oom_score_adj: int = 0,
    ) -> None:
        """create=False only looks (for `corral doctor`): no directories are left behind.

        sandboxes_cpu_weight: the CPU weight of the base group that holds every sandbox, against
        the node's other work (the daemon's own threads among it); sandbox_cpu_weight: each
        sandbox's, among the others (0: the kernel's default for either). oom_score_adj: what
        every process that joins a sandbox group gets (see process.in_cgroup)."""
        self.daemon_id = daemon_id
        self._create = create
        self.sandboxes_cpu_weight = sandboxes_cpu_weight
        self.sandbox_cpu_weight = sandbox_cpu_weight
        self.oom_score_adj = oom_score_adj
        self.hierarchies: list[Hierarchy] = []
        self.reasons: dict[str, str] = {}
        self.mode = "none"
        # Not root: only a subtree delegated to the daemon's user (systemd's Delegate=yes, a Slurm
        # job's or a pod's cgroup) is writable, and detection finds it by trying, as for root.
        self._detect()
        if os.geteuid() != 0:
            for c in CONTROLLERS:
                if c in self.reasons:
                    self.reasons[c] = f"the daemon is not root and has no delegated cgroup with it ({self.reasons[c]})"

    def _detect(self) -> None:
        mounts = _mountinfo()
        selfs = _self_cgroups()
        has_v1 = any(fs == "cgroup" for _, _, fs, _ in mounts)
        has_v2 = any(fs == "cgroup2" for _, _, fs, _ in mounts)
        self.mode = "hybrid" if has_v1 and has_v2 else "v1" if has_v1 else "v2" if has_v2 else "none"
        taken: set[str] = set()
        name = f"corral-{self.daemon_id}"
        for root, point, fs, opts in mounts:
            if fs != "cgroup":
                continue
            ctrls = set(opts.split(",")) & set(CONTROLLERS)
            if not ctrls or ctrls & taken:
                continue
            own = selfs.get(next(iter(ctrls)), "/")
            own_dir = _join(root, point, own)
            if _writable_dir(own_dir):
                key = next(iter(sorted(ctrls)))
                self.hierarchies.append(Hierarchy(1, own_dir / name, frozenset(ctrls), root, point, key))
                taken |= ctrls
            else:
                for c in ctrls:
                    self.reasons[c] = f"cgroup v1 {c} hierarchy at {own_dir} is not writable"
        for root, point, fs, _ in mounts:
            if fs != "cgroup2":
                continue
            own_dir = _join(root, point, selfs.get("", "/"))
            if not _writable_dir(own_dir):
                self.reasons.setdefault("tracking", f"cgroup v2 at {own_dir} is not writable")
                break
            available = set(_read(own_dir / "cgroup.controllers").split())
            wanted = (available & set(CONTROLLERS)) - taken
            if wanted and self._create:
                wanted = self._delegate_v2(own_dir, wanted)
            self.hierarchies.insert(0, Hierarchy(2, own_dir / name, frozenset(wanted), root, point, ""))
            taken |= wanted
            break
        for c in CONTROLLERS:
            if c not in taken:
                self.reasons.setdefault(c, f"no writable cgroup hierarchy offers the {c} controller")
        for h in self.hierarchies if self._create else ():
            h.base.mkdir(exist_ok=True)
            # Directories an earlier run left (reaped at start) count until they are removed.
            h.held.add(sum(len(dirs) for _, dirs, _ in os.walk(h.base)))
            if h.version == 2 and h.controllers:
                _write(h.base / "cgroup.subtree_control", " ".join(f"+{c}" for c in sorted(h.controllers)))
            if "cpu" in h.controllers and self.sandboxes_cpu_weight:
                _write_cpu_weight(h.version, h.base, self.sandboxes_cpu_weight)

    def _delegate_v2(self, own_dir: Path, wanted: set[str]) -> set[str]:
        """Enables controllers for our subtree; v2 requires the daemon itself to leave a non-root
        cgroup first ("no internal processes"), so it moves into a `daemon` leaf. Only the
        hierarchy's real root is exempt, and only it lacks `cgroup.events`: the root of a cgroup
        namespace (a container's group, seen at /sys/fs/cgroup) is not."""
        try:
            if (own_dir / "cgroup.events").exists() and _read(own_dir / "cgroup.procs").strip():
                leaf = own_dir / "daemon"
                leaf.mkdir(exist_ok=True)
                for pid in _read(own_dir / "cgroup.procs").split():
                    try:
                        _write(leaf / "cgroup.procs", pid)
                    except OSError:
                        pass
            _write(own_dir / "cgroup.subtree_control", " ".join(f"+{c}" for c in sorted(wanted)))
            return wanted
        except OSError as err:
            for c in wanted:
                self.reasons[c] = f"cannot enable the {c} controller in {own_dir}: {err.strerror}"
            return set()

    # -- what is enforced --------------------------------------------------------------------------

    def support(self, controller: str) -> LimitSupport:
        for h in self.hierarchies:
            if controller in h.controllers:
                return LimitSupport(True, f"cgroup v{h.version} {controller}")
        return LimitSupport(False, reason=self.reasons.get(controller, "not available"))

    @property
    def can_track(self) -> bool:
        return bool(self.hierarchies)

    def held(self) -> dict[str, int]:
        """Cgroup directories this daemon holds now, per hierarchy (see Hierarchy.label)."""
        return {h.label: h.held.count for h in self.hierarchies}

    def create(self, name: str, memory_bytes: int = 0, pids: int = 0, cpu_millicores: int = 0) -> CgroupGroup:
        """A sandbox group with its limits and the node's CPU weight for sandboxes; an OSError (a
        limit the kernel refuses) leaves nothing."""
        group = self._group([h.base / name for h in self.hierarchies])
        group.make()
        try:
            self._apply_limits(group, memory_bytes, pids, cpu_millicores, self.sandbox_cpu_weight)
        except BaseException:
            group.remove()
            raise
        return group

    def _group(self, paths: list[Path]) -> CgroupGroup:
        return CgroupGroup(paths, self.hierarchies, self.oom_score_adj)

    def _apply_limits(
        self, group: CgroupGroup, memory_bytes: int, pids: int, cpu_millicores: int, cpu_weight: int
    ) -> None:
        for h, path in zip(self.hierarchies, group.paths):
            if "memory" in h.controllers and memory_bytes:
                if h.version == 1:
                    _write(path / "memory.limit_in_bytes", str(memory_bytes))
                    if (path / "memory.memsw.limit_in_bytes").exists():
                        _write(path / "memory.memsw.limit_in_bytes", str(memory_bytes))
                else:
                    _write(path / "memory.max", str(memory_bytes))
                    if (path / "memory.swap.max").exists():
                        _write(path / "memory.swap.max", "0")
            if "pids" in h.controllers and pids:
                _write(path / "pids.max", str(pids))
            if "cpu" in h.controllers and cpu_millicores:
                quota = max(1000, cpu_millicores * CPU_PERIOD_US // 1000)
                if h.version == 1:
                    _write(path / "cpu.cfs_period_us", str(CPU_PERIOD_US))
                    _write(path / "cpu.cfs_quota_us", str(quota))
                else:
                    _write(path / "cpu.max", f"{quota} {CPU_PERIOD_US}")
            if "cpu" in h.controllers and cpu_weight:
                _write_cpu_weight(h.version, path, cpu_weight)
            if h.version == 2 and h.controllers:
                _write(path / "cgroup.subtree_control", " ".join(f"+{c}" for c in sorted(h.controllers)))

    def remove_base(self) -> None:
        """Removes our (empty) base directories at shutdown."""
        for h in self.hierarchies:
            try:
                h.base.rmdir()
            except OSError:
                pass

    def group_of(self, pid: int) -> CgroupGroup | None:
        """The cgroup a process lives in (e.g. a container's, made by its engine), in every
        hierarchy we use: leaves created under it inherit its limits."""
        try:
            paths = _cgroup_paths(f"/proc/{pid}/cgroup")
        except OSError:
            return None
        dirs = [_join(h.mount_root, h.mount_point, paths.get(h.key, "/")) for h in self.hierarchies]
        return self._group(dirs) if dirs else None

    async def remove_group(self, name: str) -> None:
        """Kills and removes the sandbox group `name` left from an earlier run, if there is one."""
        for group in self.existing_groups():
            if group.paths and group.paths[0].name == name:
                await asyncio.to_thread(group.kill)
                await asyncio.to_thread(group.remove)

    def existing_groups(self) -> list[CgroupGroup]:
        """Sandbox groups left in our base directories (after a crash)."""
        names: set[str] = set()
        for h in self.hierarchies:
            if h.base.is_dir():
                names |= {p.name for p in h.base.iterdir() if p.is_dir()}
        return [self._group([h.base / n for h in self.hierarchies]) for n in sorted(names)]


def _read(path: Path) -> str:
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return ""


@dataclass
class CgroupGroup:
    """One group (a sandbox, or a leaf within it), present in every hierarchy we use."""

    paths: list[Path]
    hierarchies: list[Hierarchy] = field(repr=False)
    # The oom_score_adj every process gets as it joins the group (0: left as inherited), so that
    # the kernel's OOM killer picks sandbox processes before the daemon.
    oom_score_adj: int = 0

    def make(self) -> None:
        """Creates the group's directories that do not exist yet; when one cannot be made, removes
        those it made and raises."""
        made = []
        try:
            for h, path in zip(self.hierarchies, self.paths):
                try:
                    path.mkdir()
                except FileExistsError:
                    if path.is_dir():
                        continue  # a leaf reused, or a group an earlier run left
                    raise
                h.held.add(1)
                made.append(path)
        except BaseException:
            for path in reversed(made):
                _rmdir_counted(path, self._hierarchy_of(path))
            raise

    def _hierarchy_of(self, path: Path) -> Hierarchy:
        return self.hierarchies[self.paths.index(path)]

    def leaf(self, name: str) -> CgroupGroup:
        child = CgroupGroup([p / name for p in self.paths], self.hierarchies, self.oom_score_adj)
        child.make()
        return child

    def is_empty(self) -> bool:
        """No process left in the group (in any hierarchy), so it can be reused or removed."""
        return not any(_read(p / "cgroup.procs").split() for p in self.paths if p.is_dir())

    @property
    def procs_files(self) -> list[str]:
        """cgroup.procs files a new process writes "0" into to join this group everywhere."""
        return [str(p / "cgroup.procs") for p in self.paths]

    def pids(self) -> set[int]:
        """Every process in this group and below it."""
        found: set[int] = set()
        if not self.paths:
            return found
        for dirpath, _, files in os.walk(self.paths[0]):
            if "cgroup.procs" in files:
                found |= {int(p) for p in _read(Path(dirpath, "cgroup.procs")).split()}
        return found

    def kill(self, timeout: float = 5.0) -> bool:
        """SIGKILLs every process in the group and below; True once none is left."""
        if not self.paths:
            return True
        first, h = self.paths[0], self.hierarchies[0]
        deadline = time.monotonic() + timeout
        while True:
            if h.version == 2 and (first / "cgroup.kill").exists():
                try:
                    _write(first / "cgroup.kill", "1")
                except OSError:
                    pass
            pids = self.pids()
            if not pids:
                return True
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                log.warning("processes survive in %s: %s", first, sorted(pids))
                return False
            time.sleep(0.002)

    def freeze(self, frozen: bool, timeout: float = 1.0) -> bool:
        """Pauses (frozen) or resumes every process of the group and below, through cgroup v2's
        cgroup.freeze: True once they are (a pause waits up to `timeout` for the kernel to say so),
        False where no v2 hierarchy holds the group (nothing is paused)."""
        for h, path in zip(self.hierarchies, self.paths):
            if h.version != 2 or not (path / "cgroup.freeze").exists():
                continue
            _write(path / "cgroup.freeze", "1" if frozen else "0")
            if not frozen:
                return True
            deadline = time.monotonic() + timeout
            while "frozen 1" not in _read(path / "cgroup.events"):
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.0005)
            return True
        return False

    def oom_kills(self) -> int:
        """How many processes the kernel's OOM killer has killed in this group."""
        total = 0
        for h, path in zip(self.hierarchies, self.paths):
            if "memory" not in h.controllers:
                continue
            text = _read(path / ("memory.oom_control" if h.version == 1 else "memory.events"))
            for line in text.splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    total += int(value)
        return total

    def remove(self, timeout: float = 2.0) -> None:
        """Removes the group and its leaves, deepest first. Killed processes take a moment to
        leave their cgroup, so EBUSY is retried until `timeout`."""
        deadline = time.monotonic() + timeout
        for h, path in zip(self.hierarchies, self.paths):
            if not path.is_dir():
                continue
            # os.walk needs a descriptor per directory and says nothing when there is none left
            # (EMFILE): the group itself is still removed then, which rmdir does without one.
            dirs = [Path(dirpath) for dirpath, _, _ in os.walk(path)] or [path]
            for dirpath in sorted(dirs, key=lambda d: -len(d.parts)):
                while not _rmdir_counted(dirpath, h, quiet=time.monotonic() < deadline):
                    time.sleep(0.01)


def _rmdir_counted(path: Path, hierarchy: Hierarchy, quiet: bool = False) -> bool:
    """Removes one cgroup directory, counting it off. False only for EBUSY when `quiet` (the
    caller retries); any other failure is logged and given up."""
    try:
        os.rmdir(path)
    except OSError as err:
        if err.errno == errno.EBUSY and quiet:
            return False
        if err.errno != errno.ENOENT:
            log.warning("cannot remove cgroup %s: %s", path, err)
        return True
    hierarchy.held.add(-1)
    return True


class LeafPool:
    """The leaves a sandbox's short commands run in, reused from one command to the next.

    A command takes an idle leaf (or a new name) and gives it back when it has ended: an empty
    leaf goes back to the pool, so a sandbox holds as many command leaves as it ran commands at
    once, not one per command ever run. A leaf that still holds processes (a command's background
    children) is set aside and reused or removed once they are gone (checked whenever a command
    starts or ends here); at most POOL_SIZE idle leaves are kept, the rest are removed.
    Destroying the sandbox removes them all with its group.
    """

    POOL_SIZE = 8

    def __init__(self, new_name: Callable[[], str]) -> None:
        self._new_name = new_name
        self._idle: list[str] = []
        self._busy: dict[str, CgroupGroup] = {}  # set aside: background processes still in them

    def take(self) -> str:
        self._sweep()
        return self._idle.pop() if self._idle else self._new_name()

    def give_back(self, name: str, group: CgroupGroup | None) -> None:
        """`group` is the leaf's cgroup (None where the sandbox has none, or it was never made)."""
        if group is None or group.is_empty():
            self._settle(name, group)
        else:
            self._busy[name] = group
        self._sweep()

    def _settle(self, name: str, group: CgroupGroup | None) -> None:
        if len(self._idle) < self.POOL_SIZE:
            self._idle.append(name)
        elif group is not None:
            group.remove(timeout=0)

    def _sweep(self) -> None:
        for name, group in list(self._busy.items()):
            if group.is_empty():
                del self._busy[name]
                self._settle(name, group)
