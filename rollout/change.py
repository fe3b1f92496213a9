"""The agent's change: what of the agent's sandbox a clean evaluation takes (docs/rollouts.md,
"The agent's change").

The change is the difference, under the task's change root and extra paths, between the sandbox
as the setup left it (a manifest taken at INIT, before the agent ran) and as the agent left it:
files added or modified (content and permission bits), symlinks, and what was deleted. Both sides
are read through the daemon's file calls (ListDir, ReadFile: the daemon opens the files itself,
inside the sandbox's root), never by a program inside the agent's sandbox, which the agent could
have replaced. A file whose size, mode and modification time are those of the manifest is taken as
unchanged: an agent that keeps all three while changing the content only loses its own edit.

What cannot be the agent's work, because it would reach the test run rather than the code under
test, is left out of the change (dropped, and named in the evaluation's output), so the evaluation
runs with the task's own version of it: `DROPPED_NAMES` (pytest's configuration files and
conftest.py, .pth and site/usercustomize files, package entry points), bytecode and pytest's
cache, the protected paths (the evaluation files, the report, the tests a task names), and new
top-level Python modules or packages of the root, which would be imported instead of any module
of that name (pytest's own, the standard library's) when the tests run from the root. Dropping,
not a 0: an honest agent often leaves such files behind (a reproduction script, a rebuilt package
record), and a dropped file cannot change a test's outcome, only the task's version of it runs.

A change past the caps (`MAX_CHANGE_FILES`, `MAX_CHANGE_BYTES`, `MAX_WALK_ENTRIES`) scores 0: it
is the agent's doing, and a filter would let an agent dodge a 0 by making a huge change.
"""

from __future__ import annotations

import asyncio
import bisect
import posixpath
import secrets
import shlex
from collections.abc import Iterable
from dataclasses import dataclass, field

from corral.sdk import (
    AsyncSandbox,
    CorralError,
    FailedPrecondition,
    FileEntry,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from corral.v1 import rollout_pb2 as pb

# Most entries a walk of the change's trees may meet, files and directories of every kind, and
# most directories (one ListDir call each).
MAX_WALK_ENTRIES = 500_000
MAX_WALK_DIRECTORIES = 50_000
# Most files (and symlinks) one change may write, and their bytes in all; one file is read in one
# call, so it may hold up to the SDK's read cap.
MAX_CHANGE_FILES = 20_000
MAX_CHANGE_BYTES = 256 << 20
MAX_FILE_BYTES = 64 << 20
# ListDir and ReadFile calls in flight at once during a walk or a capture.
CONCURRENT_CALLS = 16
# Names never carried, wherever they are: what pytest reads as its configuration or plugins, and
# what Python runs at start-up or through package metadata.
DROPPED_NAMES = {
    "conftest.py": "a pytest conftest",
    "pytest.ini": "test configuration",
    ".pytest.ini": "test configuration",
    "tox.ini": "test configuration",
    "setup.cfg": "test configuration",
    "pyproject.toml": "test configuration",
    "sitecustomize.py": "run when Python starts",
    "usercustomize.py": "run when Python starts",
    "entry_points.txt": "package entry points (pytest plugins)",
    ".gitattributes": "git attributes (how the test patch is applied)",
}
DERIVED_DIRECTORIES = {"__pycache__": "bytecode", ".pytest_cache": "pytest's cache"}
DERIVED_SUFFIXES = {".pyc": "bytecode", ".pyo": "bytecode", ".pth": "a .pth file (run when Python starts)"}
# What makes a new top-level entry of the root importable as a module.
MODULE_SUFFIXES = (".py", ".pyw", ".so", ".pyd")
# Never walked: the repository's own metadata is not the agent's work.
SKIPPED_DIRECTORIES = frozenset({".git"})


class ChangeTooLarge(Exception):
    """The change is past the caps: reward 0, with this reason."""


class ChangeUnreadable(Exception):
    """The agent's sandbox could not be read (it is gone, or the daemon failed): infrastructure."""


@dataclass(frozen=True)
class ChangeSpec:
    """Where the agent's change is in one sandbox, in absolute paths: the root, the extra paths
    (its tops), and what is never carried.

    Manifests and changes name paths in a view of their own, the same for every sandbox of a task
    whatever its workdir: the n-th top is `/n` (the root `/0`), so `/0/pkg/x.py` is the root's
    `pkg/x.py`. `view()` is the spec in that view, `actual()` turns a path of the view back into
    this sandbox's."""

    root: str
    extra_paths: tuple[str, ...] = ()
    protected: frozenset[str] = frozenset()

    @property
    def tops(self) -> tuple[str, ...]:
        return (self.root, *self.extra_paths)

    def virtual(self, path: str) -> str | None:
        """`path` (absolute) in the view, or None outside every top."""
        for index, top in enumerate(self.tops):
            if _within(path, top):
                return f"/{index}{path[len(top.rstrip('/')) :]}"
        return None

    def actual(self, path: str) -> str:
        """A path of the view in this sandbox."""
        index, _, rest = path[1:].partition("/")
        return posixpath.join(self.tops[int(index)], rest) if rest else self.tops[int(index)]

    def view(self) -> ChangeSpec:
        tops = [f"/{index}" for index in range(len(self.tops))]
        protected = {virtual for path in self.protected if (virtual := self.virtual(path)) is not None}
        protected |= {view for view, top in zip(tops, self.tops) if any(_within(top, p) for p in self.protected)}
        return ChangeSpec(root=tops[0], extra_paths=tuple(tops[1:]), protected=frozenset(protected))


def change_spec(evaluation: pb.TaskEvaluation, workdir: str) -> ChangeSpec:
    """The task's change in a sandbox of `workdir`, its paths made absolute (relative paths: under
    the workdir; protected relative paths: under the root). The evaluation files and the JUnit
    report are protected. Extra paths inside the root (or inside another) are the root's."""
    root = _absolute(evaluation.change.root or ".", workdir)
    protected = {_absolute(path, root) for path in evaluation.change.protected_paths}
    protected |= {_absolute(file.path, workdir) for file in evaluation.files}
    if evaluation.WhichOneof("reward") == "junit" and evaluation.junit.report_path:
        protected.add(_absolute(evaluation.junit.report_path, workdir))
    extra: list[str] = []
    for path in dict.fromkeys(_absolute(path, workdir) for path in evaluation.change.extra_paths):
        if not any(_within(path, top) for top in (root, *extra)):
            extra.append(path)
    return ChangeSpec(root=root, extra_paths=tuple(extra), protected=frozenset(protected))


def spec_key(evaluation: pb.TaskEvaluation) -> bytes:
    """What change_spec reads of a task: tasks with the same key have the same change."""
    shape = pb.TaskEvaluation(change=evaluation.change, files=[pb.TaskFile(path=f.path) for f in evaluation.files])
    if evaluation.WhichOneof("reward") == "junit":
        shape.junit.report_path = evaluation.junit.report_path
    return shape.SerializeToString(deterministic=True)


def check_change(change: pb.TaskChange) -> str | None:
    """What is wrong with a task's change, or None."""
    if change.root.startswith("/") and posixpath.normpath(change.root) == "/":
        return "evaluation.change.root cannot be / (the whole file system)"
    for path in change.extra_paths:
        if not path.startswith("/") or posixpath.normpath(path) == "/":
            return f"evaluation.change.extra_paths must be absolute paths other than /, got {path!r}"
    for path in [change.root, *change.extra_paths, *change.protected_paths]:
        if "\0" in path or ".." in path.split("/"):
            return f"evaluation.change paths cannot hold NUL bytes or '..', got {path!r}"
    return None


def _absolute(path: str, base: str) -> str:
    return posixpath.normpath(posixpath.join(base, path))


@dataclass(frozen=True)
class Entry:
    """One path of a tree, as the daemon lists it."""

    kind: str  # file | directory | symlink | other
    size: int = 0
    mode: int = 0
    modified_ms: int = 0
    target: str = ""

    @classmethod
    def of(cls, entry: FileEntry) -> Entry:
        return cls(
            kind=entry.type,
            size=entry.size_bytes,
            mode=entry.mode,
            modified_ms=int(entry.modified_at.timestamp() * 1000),
            target=entry.symlink_target or "",
        )


@dataclass
class Manifest:
    """What the trees of a change held: every path under the change's tops (the tops included, a
    missing top absent), and the directories that could not be listed (their content unknown)."""

    entries: dict[str, Entry] = field(default_factory=dict)
    unreadable: set[str] = field(default_factory=set)

    def unknown(self, path: str) -> bool:
        """Whether `path` lies in a directory whose content could not be read."""
        parent = posixpath.dirname(path)
        while True:
            if parent in self.unreadable:
                return True
            if parent == "/" or not parent:
                return False
            parent = posixpath.dirname(parent)


# Errors of one path (missing, not a directory, not readable): the path is skipped, not the walk.
_PATH_ERRORS = (NotFound, InvalidArgument, PermissionDenied, FailedPrecondition)


async def take_manifest(sandbox: AsyncSandbox, spec: ChangeSpec) -> Manifest:
    """Walks the change's tops in `sandbox` through ListDir (symlinks are recorded, never
    followed; .git is skipped), naming paths in the spec's view. Raises ChangeTooLarge past
    MAX_WALK_ENTRIES, ChangeUnreadable when the sandbox cannot be read at all."""
    manifest = Manifest()
    calls = asyncio.Semaphore(CONCURRENT_CALLS)
    path_errors = 0
    directories = 0

    async def listing(path: str) -> list[FileEntry] | None:
        nonlocal path_errors
        async with calls:
            try:
                return await sandbox.list_dir(path)
            except _PATH_ERRORS:
                path_errors += 1
                return None
            except ResourceExhausted as error:  # a directory whose listing is past the message cap
                raise ChangeTooLarge(f"listing {path} failed: {error}") from error
            except CorralError as error:
                raise ChangeUnreadable(f"listing {path} failed: {error}") from error

    async def walk(directory: str, view: str) -> None:
        nonlocal directories
        directories += 1
        if directories > MAX_WALK_DIRECTORIES:
            raise ChangeTooLarge(f"the trees of the change hold more than {MAX_WALK_DIRECTORIES} directories")
        entries = await listing(directory)
        if entries is None:
            manifest.unreadable.add(view)
            return
        if len(manifest.entries) + len(entries) > MAX_WALK_ENTRIES:
            raise ChangeTooLarge(f"the trees of the change hold more than {MAX_WALK_ENTRIES} entries")
        below = []
        for entry in entries:
            if entry.type == "directory" and entry.name in SKIPPED_DIRECTORIES:
                continue
            manifest.entries[f"{view}/{entry.name}"] = Entry.of(entry)
            if entry.type == "directory":
                below.append(walk(posixpath.join(directory, entry.name), f"{view}/{entry.name}"))
        await _gather(below)

    async def top(path: str, view: str) -> None:
        # A top's own entry comes from its parent's listing: it may be a file, or missing.
        entries = await listing(posixpath.dirname(path))
        found = next((e for e in entries or () if e.name == posixpath.basename(path)), None)
        if entries is None:
            manifest.unreadable.add(view)
        elif found is not None:
            manifest.entries[view] = Entry.of(found)
            if found.type == "directory":
                await walk(path, view)

    await _gather(top(path, f"/{index}") for index, path in enumerate(spec.tops))
    if path_errors:
        await _check_running(sandbox)
    return manifest


async def _gather(awaitables: Iterable) -> None:
    """Runs them together; the first failure cancels the others."""
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _check_running(sandbox: AsyncSandbox) -> None:
    """ChangeUnreadable unless the sandbox still runs (so a failed path was the path's own)."""
    try:
        state = (await sandbox.refresh()).state
    except CorralError as error:
        raise ChangeUnreadable(f"sandbox {sandbox.id} cannot be reached: {error}") from error
    if state != "running":
        raise ChangeUnreadable(f"sandbox {sandbox.id} is {state}")


@dataclass
class Change:
    """What a clean evaluation applies: paths removed first (a deleted file, a file or directory
    whose kind changed, a modified file), then files written, then symlinks made; and what was
    left out, with why."""

    removed: list[str] = field(default_factory=list)
    files: dict[str, tuple[int, bytes]] = field(default_factory=dict)  # path -> (mode, content)
    symlinks: dict[str, str] = field(default_factory=dict)  # path -> target
    dropped: dict[str, str] = field(default_factory=dict)  # path -> reason
    # Files that changed but could not be read (left as the clean sandbox has them).
    unreadable: list[str] = field(default_factory=list)

    def summary(self, spec: ChangeSpec) -> str:
        """One line for the evaluation's output, paths as `spec` names them: what was applied and
        what was left out."""
        parts = [f"{len(self.files)} files written, {len(self.symlinks)} symlinks, {len(self.removed)} paths removed"]
        if self.dropped:
            shown = sorted(self.dropped.items())[:20]
            more = len(self.dropped) - len(shown)
            parts.append(
                "left out: "
                + "; ".join(f"{spec.actual(path)} ({reason})" for path, reason in shown)
                + (f"; and {more} more" if more > 0 else "")
            )
        if self.unreadable:
            parts.append(f"unreadable: {', '.join(spec.actual(path) for path in sorted(self.unreadable)[:20])}")
        return "; ".join(parts)


class Rules:
    """Which changed paths are left out of a change (docs/rollouts.md, "The agent's change")."""

    def __init__(self, spec: ChangeSpec, base: Manifest, agent: Manifest) -> None:
        self.spec = spec
        self.base = base
        self.agent = agent
        self._agent_paths = sorted(agent.entries)
        self._new_modules: dict[str, bool] = {}
        # A protected path in a directory the set-up sandbox does not have (hidden tests in a
        # directory of their own): that whole directory is the evaluation's.
        self.protected = set(spec.protected)
        for path in spec.protected:
            top = next((t for t in spec.tops if _within(path, t) and path != t), None)
            absent = path
            while top is not None and posixpath.dirname(absent) != top:
                if posixpath.dirname(absent) in base.entries:
                    break
                absent = posixpath.dirname(absent)
            self.protected.add(absent)

    def reason(self, path: str) -> str | None:
        """Why a changed path is left out, or None to carry it."""
        spec = self.spec
        if any(_within(path, protected) for protected in self.protected):
            return "protected"
        top = next((t for t in spec.tops if _within(path, t)), spec.root)
        for part in path[len(top) :].split("/"):
            if part in DERIVED_DIRECTORIES:
                return DERIVED_DIRECTORIES[part]
        name = posixpath.basename(path)
        if name in DROPPED_NAMES:
            return DROPPED_NAMES[name]
        suffix = posixpath.splitext(name)[1]
        if suffix in DERIVED_SUFFIXES:
            return DERIVED_SUFFIXES[suffix]
        if top == spec.root and path != spec.root:
            first = posixpath.join(spec.root, path[len(spec.root) :].strip("/").split("/", 1)[0])
            if self._new_module(first):
                return "a new top-level Python module of the root (it would shadow any module of its name)"
        return None

    def _new_module(self, path: str) -> bool:
        """Whether a top-level entry of the root is new and importable: a Python source or extension
        file, or a directory holding one."""
        if path not in self._new_modules:
            entry = self.agent.entries.get(path)
            if path in self.base.entries or entry is None:
                found = False
            elif entry.kind != "directory":
                found = path.endswith(MODULE_SUFFIXES)
            else:
                found = any(p.endswith(MODULE_SUFFIXES) for p in _under(self._agent_paths, path))
            self._new_modules[path] = found
        return self._new_modules[path]


def _within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _under(paths: list[str], directory: str) -> list[str]:
    """The paths strictly under `directory`, from a sorted list."""
    start = bisect.bisect_left(paths, directory + "/")
    return paths[start : bisect.bisect_left(paths, directory + "0")]  # "0" sorts right after "/"


@dataclass(frozen=True)
class Difference:
    """The paths that differ between a manifest and the agent's tree, before any is read."""

    removed: list[str]
    files: list[str]
    symlinks: dict[str, str]
    dropped: dict[str, str]


def compare(base: Manifest, agent: Manifest, spec: ChangeSpec) -> Difference:
    """What changed from `base` to `agent`, the paths the rules leave out set apart. A path in a
    directory that could not be read on either side is left as it is, and so is anything a change
    could only make by removing a path the rules keep."""
    rules = Rules(spec, base, agent)
    base_paths = sorted(base.entries)
    removed: list[str] = []
    files: list[str] = []
    symlinks: dict[str, str] = {}
    dropped: dict[str, str] = {}

    def carry(path: str) -> bool:
        reason = rules.reason(path)
        if reason is not None:
            dropped[path] = reason
        return reason is None

    def clear(directory: str) -> bool:
        """Removes a base directory and its tree: True when it is gone as a whole; False when
        paths the rules keep are in it (the others are removed one by one)."""
        inside = _under(base_paths, directory)
        kept = {path: reason for path in inside if (reason := rules.reason(path)) is not None}
        if not kept:
            removed.append(directory)
            return True
        dropped.update(kept)
        for path in inside:
            if path not in kept and base.entries[path].kind != "directory":
                removed.append(path)
        return False

    def unknown(path: str) -> bool:
        return base.unknown(path) or agent.unknown(path) or path in base.unreadable or path in agent.unreadable

    # Agent directories whose base path could not be cleared: nothing is written under them.
    blocked: list[str] = []
    for path in sorted(agent.entries):  # a directory before what it holds
        now = agent.entries[path]
        if unknown(path):
            continue
        if any(_within(path, directory) for directory in blocked):
            dropped[path] = "under a path the task's version of which is kept"
            continue
        before = base.entries.get(path)
        if before == now:
            continue
        if now.kind in ("directory", "other"):
            # A directory: what it holds follows; an "other" (a fifo, a socket) is not carried, but
            # what was at its path is gone.
            if before is None or before.kind == now.kind:
                continue
            if before.kind == "directory":
                clear(path)
            elif carry(path):
                removed.append(path)
            elif now.kind == "directory":
                blocked.append(path)
            continue
        if not carry(path):
            continue
        if before is not None and before.kind == "directory" and not clear(path):
            dropped[path] = "it would replace a directory holding paths the task's version of which is kept"
            continue
        if before is not None and before.kind != "directory":
            removed.append(path)
        if now.kind == "file":
            files.append(path)
        else:
            symlinks[path] = now.target
    for path in base_paths:  # what the agent's tree no longer has
        if path in agent.entries or unknown(path):
            continue
        parent = agent.entries.get(posixpath.dirname(path))
        if path not in spec.tops and (parent is None or parent.kind != "directory"):
            continue  # its directory went (or became something else): handled there
        if base.entries[path].kind == "directory":
            clear(path)
        elif carry(path):
            removed.append(path)
    return Difference(removed=sorted(set(removed)), files=files, symlinks=symlinks, dropped=dropped)


async def capture_change(sandbox: AsyncSandbox, spec: ChangeSpec, base: Manifest) -> Change:
    """The agent's change in `sandbox` (whose paths `spec` names) against the manifest `base`, its
    files read; paths in the spec's view. Raises ChangeTooLarge past the caps, ChangeUnreadable
    when the sandbox cannot be read."""
    agent = await take_manifest(sandbox, spec)
    difference = compare(base, agent, spec.view())
    if len(difference.files) + len(difference.symlinks) > MAX_CHANGE_FILES:
        raise ChangeTooLarge(
            f"the change writes {len(difference.files) + len(difference.symlinks)} files, more than {MAX_CHANGE_FILES}"
        )
    sizes = {path: agent.entries[path].size for path in difference.files}
    if sum(sizes.values()) > MAX_CHANGE_BYTES:
        raise ChangeTooLarge(f"the change writes {sum(sizes.values())} bytes, more than {MAX_CHANGE_BYTES}")
    too_big = [path for path, size in sizes.items() if size > MAX_FILE_BYTES]
    if too_big:
        raise ChangeTooLarge(f"{too_big[0]} is larger than {MAX_FILE_BYTES} bytes")
    change = Change(removed=list(difference.removed), symlinks=dict(difference.symlinks), dropped=difference.dropped)
    calls = asyncio.Semaphore(CONCURRENT_CALLS)
    total = 0

    async def read(path: str) -> None:
        nonlocal total
        async with calls:
            try:
                # Read to the cap and no further: a file that grew since it was listed is still bounded.
                content = await sandbox.read_file(spec.actual(path), limit=MAX_FILE_BYTES)
            except _PATH_ERRORS:
                change.unreadable.append(path)
                return
            except CorralError as error:
                raise ChangeUnreadable(f"reading {path} failed: {error}") from error
        total += len(content)
        if total > MAX_CHANGE_BYTES:
            raise ChangeTooLarge(f"the change writes more than {MAX_CHANGE_BYTES} bytes")
        change.files[path] = (agent.entries[path].mode & 0o777, content)

    await _gather(read(path) for path in difference.files)
    if change.unreadable:
        await _check_running(sandbox)
        # Left as the clean sandbox has them: not removed either.
        gone = set(change.unreadable)
        change.removed = [path for path in change.removed if path not in gone]
    return change


async def apply_change(sandbox: AsyncSandbox, change: Change, spec: ChangeSpec, *, timeout_s: float) -> None:
    """Applies `change` to a clean sandbox whose paths `spec` names: removals, then files (parents
    made), then symlinks. Runs only the clean sandbox's own programs. Raises CorralError when a step
    fails (the clean sandbox failing is infrastructure: the paths come from a walk of real
    directories)."""
    if change.removed:
        listing = f"/tmp/.corral-removed-{secrets.token_hex(8)}"
        await sandbox.write_file(listing, b"".join(spec.actual(path).encode() + b"\0" for path in change.removed))
        result = await sandbox.exec(
            f"xargs -0 rm -rf -- < {listing} && rm -f {listing}", timeout=timeout_s, env=_PLAIN_ENV
        )
        if not result.ok:
            raise FailedPrecondition(f"removing the change's deleted paths failed: {result.stderr.decode()[-400:]}")
    calls = asyncio.Semaphore(CONCURRENT_CALLS)

    async def write(path: str, mode: int, content: bytes) -> None:
        async with calls:
            await sandbox.write_file(path, content, mode=mode)

    await _gather(write(spec.actual(path), mode, content) for path, (mode, content) in change.files.items())
    if change.symlinks:
        script = "\n".join(
            f"mkdir -p -- {shlex.quote(posixpath.dirname(real))} && ln -sfn -- {shlex.quote(target)} {shlex.quote(real)}"
            for path, target in sorted(change.symlinks.items())
            if (real := spec.actual(path))
        )
        result = await sandbox.exec("set -e\n" + script, timeout=timeout_s, env=_PLAIN_ENV)
        if not result.ok:
            raise FailedPrecondition(f"making the change's symlinks failed: {result.stderr.decode()[-400:]}")


# Commands that apply a change run in the clean sandbox, with its own programs; nothing in their
# environment comes from the agent either way.
_PLAIN_ENV = {"LC_ALL": "C"}
