"""A container's writable layer on the sandbox's own capped storage (`docker.storage = "btrfs"`).

Docker's overlay2 and Podman's overlay drivers keep a container's writable layer in a directory of
their own (`<graph root>/overlay2/<id>/`: `diff/`, the overlay upper directory; `work/`, overlay's
scratch space, which must be on the same filesystem; `merged/`, where the root is mounted; `link`
and `lower`, the names of the image's layers). Between the engine's create and start, the daemon
copies that directory's few entries into `layer/` of the sandbox's directory (a btrfs subvolume of
the node's pool, capped by a quota group: storage.py) and binds it over the engine's
directory. The engine then mounts the container's root with its upper and work directories on
the sandbox's subvolume, beside its workspace: one limit (`limits.disk_bytes`) covers both, and a
write past it fails inside with EDQUOT ("Disk quota exceeded"). A fork's child starts with its
parent's `diff/` from the snapshot instead of the engine's empty one.

This needs the engine to resolve paths in the daemon's mount namespace (an engine on the same
host, not in a mount namespace of its own): `check_used` proves it on every start by a file
written through the container's root and looked for in the sandbox's `layer/diff`.

Before the engine removes the container (which deletes its directory), the container is stopped
(the engine unmounts its root) and the bind is detached; a restarted daemon detaches what a
crashed one left (here from the engine's list of containers, and every mount of the pool's
sandbox subvolumes: StoragePool.reap).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import struct
from pathlib import Path

from corral.sdk.errors import FailedPrecondition

from ..mount_api import MOUNT_ATTR_NODEV, MOUNT_ATTR_NOSUID, attach_tree, detach, detached_tree

# The engines' storage drivers whose container layer is an overlay upper directory on the host.
OVERLAY_DRIVERS = ("overlay2", "overlay")
LAYER = "layer"  # the engine's layer directory's copy, in the sandbox's directory
UPPER = "diff"  # (the name both engines give the overlay upper directory)


def lacking(info: dict, address: str) -> str:
    """ "" when the engine (its /info reply, and the address the daemon reaches it at) can have
    its containers' layers placed on the pool, else why not: a storage driver other than
    overlay, or an engine that runs in another mount namespace than the daemon's (found from the
    engine socket's peer; an engine whose process cannot be told is left to `check_used`)."""
    driver = info.get("Driver") or "unknown"
    if driver not in OVERLAY_DRIVERS:
        return f"the engine's storage driver is {driver}, not {' or '.join(OVERLAY_DRIVERS)}"
    pid = _engine_pid(address)
    if pid:
        with contextlib.suppress(OSError):
            if os.stat(f"/proc/{pid}/ns/mnt").st_ino != os.stat("/proc/self/ns/mnt").st_ino:
                return f"the engine (pid {pid}) runs in a mount namespace of its own: it would not see the layer's bind"
    return ""


def _engine_pid(address: str) -> int:
    """The pid of the process serving the engine's Unix socket (0: not a Unix socket, or a
    process of another pid namespace)."""
    if not address.startswith("unix://"):
        return 0
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(2)
            sock.connect(address.removeprefix("unix://"))
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return 0
    return struct.unpack("3i", creds)[0]


def layer_dir(attrs: dict) -> Path:
    """The engine's directory of a container's writable layer, from the container's inspect data;
    FAILED_PRECONDITION where the storage driver keeps none the daemon can place (not overlay, or
    an upper and work directory that are not siblings)."""
    driver = attrs.get("GraphDriver") or {}
    name, data = driver.get("Name") or "", driver.get("Data") or {}
    upper, work = data.get("UpperDir") or "", data.get("WorkDir") or ""
    if name not in OVERLAY_DRIVERS or not upper or not work:
        raise FailedPrecondition(
            f'docker.storage = "btrfs" needs the engine\'s overlay storage driver ({" or ".join(OVERLAY_DRIVERS)}) '
            f"with a container layer on the host; this container has {name or 'none'!r}"
        )
    parent = Path(upper).parent
    if Path(work).parent != parent or Path(upper).name != UPPER:
        raise FailedPrecondition(
            f"the engine keeps the container's upper ({upper}) and work ({work}) directories apart: "
            'docker.storage = "btrfs" cannot place them'
        )
    return parent


def place(engine_dir: Path, sandbox_dir: Path, inherited: bool) -> None:
    """Copies the engine's layer directory into the sandbox's `layer/` and binds that over it
    (nosuid, nodev). `inherited`: `layer/` came from a fork's snapshot: its `diff/` (the parent's
    changes) stays, everything else (overlay's scratch, the mount point, the layer's names) is
    the engine's, for this container."""
    ours = sandbox_dir / LAYER
    ours.mkdir(mode=0o700, exist_ok=True)
    for entry in engine_dir.iterdir():
        if not (inherited and entry.name == UPPER):
            _copy_as_is(entry, ours / entry.name)
    _keep_owner_and_mode(engine_dir, ours)
    tree = detached_tree(str(ours), MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, recursive=False)
    try:
        attach_tree(tree, engine_dir)
    finally:
        os.close(tree)


def _copy_as_is(source: Path, target: Path) -> None:
    """Copies a file or directory tree over `target`, with modes, times and owners (an engine
    with user namespace remapping owns its layers as the remapped root)."""
    if source.is_dir() and not source.is_symlink():
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(source, target, symlinks=True)
        for copied in [target, *target.rglob("*")]:
            _keep_owner_and_mode(source / copied.relative_to(target), copied)
    else:
        shutil.copy2(source, target, follow_symlinks=False)
        _keep_owner_and_mode(source, target)


def _keep_owner_and_mode(source: Path, target: Path) -> None:
    st = os.lstat(source)
    os.lchown(target, st.st_uid, st.st_gid)
    if not target.is_symlink():
        shutil.copystat(source, target)


def check_used(init_pid: int, sandbox_dir: Path) -> None:
    """FAILED_PRECONDITION unless the running container's root writes into the sandbox's layer
    (an engine in another mount namespace than the daemon's does not see the bind)."""
    probe = f".corral-layer-{secrets.token_hex(6)}"
    inside = Path(f"/proc/{init_pid}/root") / probe
    inside.write_bytes(b"")
    try:
        seen = (sandbox_dir / LAYER / UPPER / probe).exists()
    finally:
        inside.unlink()
    if not seen:
        raise FailedPrecondition(
            "the engine does not see the daemon's mounts (it runs in a mount namespace of its own): "
            "docker.storage = \"btrfs\" cannot put the container's writable layer on the sandbox's storage"
        )


def take_away(engine_dir: Path) -> None:
    """Detaches the sandbox's layer from the engine's directory (nothing when it is not there:
    Podman detaches it itself when the container stops; nor when the engine removed it)."""
    with contextlib.suppress(FileNotFoundError):
        detach(engine_dir)
