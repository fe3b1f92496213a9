"""Container images for the local backend: a Docker or OCI image, from an archive, an OCI layout
or the node's Docker/Podman engine, unpacked once into a cached root filesystem directory that
every sandbox of that image shares read-only (docs/local-backend.md, "Container images").

References, besides "host" and a root filesystem directory:

    docker-archive:/path/image.tar[:name:tag]   what `docker save` writes
    oci-archive:/path/image.tar[:tag]           an OCI image layout in a tar
    oci:/path/layout[:tag]                      an OCI image layout directory
    docker:NAME or docker://NAME                an image of the engine at local.engine_socket

Two tools do the image work, both Debian packages: skopeo (containers/image) reads every source,
exports engine images through the engine's API and writes an OCI layout; umoci (opencontainers)
unpacks that layout's layers into a root filesystem as root, so whiteouts, opaque directories,
hard links, ownership, modes, special files and extended attributes come out as the image has
them. No layer tar is read here.

The cache (local.image_cache_dir, by default <state_dir>/images) is root's alone (0700): an image
may hold setuid-root programs that no host user may reach by its host path. In it:

    sha256-<hex>/rootfs       the image's root filesystem
    sha256-<hex>/config.json  the image's OCI configuration (User, Env, WorkingDir, Entrypoint, Cmd)
    sha256-<hex>/image.json   the reference it was made from, its digest, its size on disk
    .locks/sha256-<hex>       taken while the image is unpacked (by any daemon sharing the cache)
    .tmp-*                    an unpack or an inspection under way
    .trash-*                  an image being removed

An image is named by the digest of its configuration as its source holds it (for Docker images,
the image ID `docker images` shows), which covers its layers' content: the same image saved to an
archive and found in the engine is unpacked once. An unpack is written under .tmp-* and renamed
into place, so a crash leaves no half image (the next daemon start removes the leftovers).

Pruning keeps the cache under local.image_cache_bytes, least recently used images first (a
directory's mtime: set whenever a sandbox of it starts or ends), at daemon start and after each
unpack. Every sandbox holds a shared flock on its image's directory until it is destroyed;
pruning takes the lock exclusively, without waiting, before it moves an image away, so an image
in use is never removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from corral.sdk.errors import FailedPrecondition, InvalidArgument, NotFound

from ...diskcap import disk_usage
from ..nsenter import HOST_ENV

log = logging.getLogger(__name__)

# Image sources held in files, by skopeo's name for them (their reference prefix is the same).
FILE_TRANSPORTS = ("docker-archive", "oci-archive", "oci")
# An engine's image: skopeo's docker-daemon transport, reached through the engine's API.
ENGINE_PREFIXES = ("docker://", "docker:")
ENGINE_TRANSPORT = "docker-daemon"
TOOL_PACKAGES = {"skopeo": "skopeo", "umoci": "umoci"}
# The tag the unpack gives the image in its own OCI layout.
LAYOUT_TAG = "image"
LOCK_POLL_S = 0.1
GZIP_MAGIC = b"\x1f\x8b"
OCI_LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
ENGINE_TIMEOUT_S = 30


@dataclass(frozen=True)
class ImageSource:
    """A container image reference, parsed."""

    reference: str  # as the caller wrote it
    transport: str  # FILE_TRANSPORTS or ENGINE_TRANSPORT
    path: str  # the archive or layout (file transports), normalised; "" for an engine's image
    name: str  # the image inside the archive or layout ("" for its only one), or the engine's name

    def skopeo_name(self, engine_id: str = "") -> str:
        """The image as skopeo names it (an engine's image by its ID: what was inspected is what
        is exported, even if the name moves meanwhile)."""
        if self.transport == ENGINE_TRANSPORT:
            return f"{ENGINE_TRANSPORT}:{engine_id or self.name}"
        return f"{self.transport}:{self.path}" + (f":{self.name}" if self.name else "")


def parse_reference(image: str) -> ImageSource | None:
    """The container image an image string names; None for anything else ("host", a directory)."""
    for transport in FILE_TRANSPORTS:
        if image.startswith(f"{transport}:"):
            # skopeo's own syntax: the path ends at the first colon, the image within follows.
            path, _, name = image[len(transport) + 1 :].partition(":")
            if not os.path.isabs(path):
                raise InvalidArgument(
                    f"a {transport} image names an absolute path ({transport}:/path...), got {image!r}"
                )
            return ImageSource(image, transport, os.path.normpath(path), name)
    for prefix in ENGINE_PREFIXES:
        if image.startswith(prefix):
            name = image[len(prefix) :]
            if not name or any(c.isspace() for c in name):
                raise InvalidArgument(f"a docker image reference names an image (docker:NAME[:TAG]), got {image!r}")
            return ImageSource(image, ENGINE_TRANSPORT, "", name)
    return None


@dataclass(frozen=True)
class ImageConfig:
    """What an image says about how its programs run (the OCI configuration's `config`)."""

    user: str = ""
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = ""
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()


def image_config(rootfs: str) -> ImageConfig | None:
    """The configuration recorded beside a cached image's root filesystem; None for a root
    filesystem that is not one (a directory image, "host")."""
    try:
        document = json.loads((Path(rootfs).parent / "config.json").read_bytes())
    except (OSError, ValueError):
        return None
    config = (document.get("config") or {}) if isinstance(document, dict) else {}
    env = {}
    for entry in config.get("Env") or []:
        key, sep, value = str(entry).partition("=")
        if sep:
            env[key] = value
    return ImageConfig(
        user=str(config.get("User") or ""),
        env=env,
        workdir=str(config.get("WorkingDir") or ""),
        entrypoint=tuple(str(a) for a in config.get("Entrypoint") or ()),
        cmd=tuple(str(a) for a in config.get("Cmd") or ()),
    )


class ImageHold:
    """A sandbox's use of a cached image: a shared flock on the image's directory."""

    def __init__(self, fd: int, image_dir: Path) -> None:
        self._fd = fd
        self.image_dir = image_dir

    def release(self) -> None:
        if self._fd < 0:
            return
        _touch(self.image_dir)  # its last use, for pruning
        os.close(self._fd)
        self._fd = -1


class ImageCache:
    """The local backend's cache of unpacked container images."""

    def __init__(self, root: Path, limit_bytes: int, engine_address: str) -> None:
        self.root = root
        self.limit_bytes = limit_bytes  # 0: no limit
        self.engine_address = engine_address
        # The root filesystem each reference was last prepared as (rootfs() answers from it).
        self._prepared: dict[str, str] = {}
        # Configuration digests of archives and layouts, by what their files were when inspected.
        self._digests: dict[tuple, str] = {}
        # Unpacks under way, by image: the requests for one image wait for one unpack.
        self._unpacks: dict[str, asyncio.Task] = {}

    # -- use ----------------------------------------------------------------------------------------

    async def prepare(self, source: ImageSource) -> str:
        """The root filesystem of an image, unpacked first unless the cache has it."""
        self._make_root()
        engine_id = await self._engine_image_id(source.name) if source.transport == ENGINE_TRANSPORT else ""
        key = _key(engine_id or await self._digest(source))
        image_dir = self.root / key
        if not image_dir.is_dir():
            unpack = self._unpacks.get(key)
            if unpack is None:
                unpack = asyncio.create_task(self._unpack_once(source, engine_id, key))
                self._unpacks[key] = unpack
                unpack.add_done_callback(functools.partial(self._unpack_done, key))
            # A request that gives up (its deadline) leaves the unpack going: a retry finds the
            # image, or waits for the same unpack.
            await asyncio.shield(unpack)
        # From here to the sandbox's hold (LocalSandbox.__init__) nothing awaits: no pruning in
        # this daemon can fall in between.
        _touch(image_dir)
        rootfs = str(image_dir / "rootfs")
        self._prepared[source.reference] = rootfs
        return rootfs

    def cached(self) -> list[str]:
        """The references this daemon prepared whose root filesystem is still in the cache."""
        return [reference for reference, rootfs in self._prepared.items() if os.path.isdir(rootfs)]

    def rootfs(self, source: ImageSource) -> str:
        """The root filesystem `prepare` made of a reference (the backend checks images, so
        prepares them, before it makes a sandbox)."""
        rootfs = self._prepared.get(source.reference)
        if rootfs is None or not os.path.isdir(rootfs):
            raise FailedPrecondition(f"image {source.reference} is not in the local image cache")
        return rootfs

    def hold(self, rootfs: str) -> ImageHold | None:
        """Keeps a cached image from pruning until the hold is released; None for a root
        filesystem outside the cache."""
        image_dir = Path(rootfs).parent
        if image_dir.parent != self.root or Path(rootfs).name != "rootfs":
            return None
        try:
            fd = os.open(image_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            fd = -1
        try:
            if fd >= 0:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                if os.fstat(fd).st_ino == os.stat(image_dir).st_ino:
                    _touch(image_dir)
                    return ImageHold(fd, image_dir)
        except (BlockingIOError, FileNotFoundError):
            pass  # being moved away by pruning at this very moment
        if fd >= 0:
            os.close(fd)
        raise FailedPrecondition(
            f"image {image_dir.name} was removed from the local image cache before its sandbox started "
            "(local.image_cache_bytes is smaller than the images in use): retry, or raise the limit"
        )

    # -- housekeeping ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """At daemon start: removes what interrupted unpacks and removals left, then prunes."""
        if not self.root.is_dir():
            return
        try:
            self._make_root()
            for entry in self.root.iterdir():
                if entry.name.startswith(".trash-") or (entry.name.startswith(".tmp-") and self._abandoned(entry.name)):
                    log.info("removing leftover %s from the local image cache", entry)
                    await asyncio.to_thread(shutil.rmtree, entry, True)
            await self.prune()
        except OSError as err:  # (a daemon that is not root: the backend says it cannot work)
            log.warning("cannot tidy the local image cache %s: %s", self.root, err)

    async def prune(self, keep: tuple[str, ...] = ()) -> None:
        """Removes least recently used images until the cache fits its limit, never one in use or
        one of `keep`."""
        if not self.limit_bytes or not self.root.is_dir():
            return
        for trash in self._take_unused_images(keep):
            await asyncio.to_thread(shutil.rmtree, trash, True)

    def _take_unused_images(self, keep: tuple[str, ...]) -> list[Path]:
        """Moves images out of the cache, least recently used first, until it fits (without
        awaiting: see prepare). Returns where they went, to be deleted."""
        images = []
        for entry in os.scandir(self.root):
            if not entry.name.startswith(".") and entry.is_dir(follow_symlinks=False):
                images.append((entry.stat(follow_symlinks=False).st_mtime_ns, _recorded_size(entry.path), entry.name))
        total = sum(size for _, size, _ in images)
        moved = []
        for _, size, name in sorted(images):
            if total <= self.limit_bytes:
                break
            if name in keep:
                continue
            trash = self._move_unused(name)
            if trash is not None:
                log.info("pruning image %s (%d bytes) from the local image cache", name, size)
                moved.append(trash)
                total -= size
        if total > self.limit_bytes:
            log.warning(
                "the local image cache holds %d bytes, over local.image_cache_bytes (%d): the rest is in use",
                total,
                self.limit_bytes,
            )
        return moved

    def _move_unused(self, name: str) -> Path | None:
        """Moves an image no sandbox holds to a .trash- name; None when one does."""
        try:
            fd = os.open(self.root / name, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            trash = Path(tempfile.mkdtemp(prefix=f".trash-{name}-", dir=self.root))
            os.rename(self.root / name, trash / name)
            return trash
        except BlockingIOError:
            return None
        finally:
            os.close(fd)

    def _abandoned(self, tmp_name: str) -> bool:
        """Whether a .tmp- directory is no unpack's under way (in this daemon or another one
        sharing the cache): nobody holds its image's unpack lock."""
        key = tmp_name.removeprefix(".tmp-").rsplit("-", 1)[0]
        fd = os.open(self.root / ".locks" / key, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        finally:
            os.close(fd)

    # -- what an image is ---------------------------------------------------------------------------

    async def _digest(self, source: ImageSource) -> str:
        """The digest of an archive's or layout's image configuration, inspected once per version
        of its file."""
        stamp = (source.transport, source.path, source.name, *_file_stamp(source))
        digest = self._digests.get(stamp)
        if digest is None:
            async with self._work_dir("inspect") as work:
                config = await _run_tool(
                    ["skopeo", "inspect", "--config", "--raw", source.skopeo_name()],
                    f"cannot read image {source.reference}",
                    work,
                )
            digest = "sha256:" + hashlib.sha256(config).hexdigest()
            self._digests[stamp] = digest
        return digest

    async def _engine_image_id(self, name: str) -> str:
        """The engine's ID of an image (the digest of its configuration)."""
        import docker  # the docker SDK is a dependency of the daemon; imported where it is used

        def inspect() -> str:
            client = docker.APIClient(base_url=self.engine_address, timeout=ENGINE_TIMEOUT_S)
            try:
                return str(client.inspect_image(name)["Id"])
            finally:
                client.close()

        try:
            return await asyncio.to_thread(inspect)
        except docker.errors.ImageNotFound:
            raise NotFound(
                f"image {name!r} is not on the node's engine at {self.engine_address} (docker load or build it there)"
            ) from None
        except docker.errors.APIError as err:
            if err.status_code == 400:
                raise InvalidArgument(f"image name {name!r}: {err.explanation or err}") from None
            raise FailedPrecondition(f"engine at {self.engine_address}: {err.explanation or err}") from None
        except docker.errors.DockerException as err:
            raise FailedPrecondition(
                f"docker: images come from a Docker or Podman engine, and none answers at {self.engine_address} "
                f"(local.engine_socket): {err}"
            ) from None

    # -- unpacking ----------------------------------------------------------------------------------

    async def _unpack_once(self, source: ImageSource, engine_id: str, key: str) -> None:
        async with self._unpack_lock(key):  # (another daemon sharing the cache may be at it)
            if not (self.root / key).is_dir():
                await self._unpack(source, engine_id, key)
        await self.prune(keep=(key,))

    def _unpack_done(self, key: str, task: asyncio.Task) -> None:
        self._unpacks.pop(key, None)
        if not task.cancelled() and task.exception() is not None:
            log.info("unpacking image %s failed: %s", key, task.exception())

    async def _unpack(self, source: ImageSource, engine_id: str, key: str) -> None:
        """skopeo copies the image into an OCI layout, umoci unpacks it; the result is renamed
        into the cache."""
        async with self._work_dir(key) as work:
            layout, image_dir = work / "layout", work / "image"
            image_dir.mkdir(mode=0o700)
            failure = f"cannot unpack image {source.reference}"
            # Layers are copied as they are: Docker's uncompressed ones are not compressed only for
            # umoci to decompress them (half the CPU of an unpack). The policy is for signatures of
            # registry images; local sources have none, and a node's policy must not reject them.
            copy = ["skopeo", "--insecure-policy", "copy", "--quiet", "--dest-oci-accept-uncompressed-layers"]
            if source.transport == ENGINE_TRANSPORT:
                copy += ["--src-daemon-host", self.engine_address]
            await _run_tool([*copy, source.skopeo_name(engine_id), f"oci:{layout}:{LAYOUT_TAG}"], failure, work)
            await asyncio.to_thread(_declare_uncompressed_layers, layout)
            rootfs = image_dir / "rootfs"
            unpack = ["umoci", "raw", "unpack", "--image", f"{layout}:{LAYOUT_TAG}"]
            if os.geteuid() != 0:
                # Every file the daemon's own (root inside its sandboxes), no device nodes.
                unpack.append("--rootless")
            await _run_tool([*unpack, str(rootfs)], failure, work)
            (image_dir / "config.json").write_bytes(_layout_config(layout))
            size = await asyncio.to_thread(disk_usage, rootfs)
            record = {"reference": source.reference, "digest": key.replace("-", ":", 1), "size_bytes": size}
            (image_dir / "image.json").write_text(json.dumps(record) + "\n")
            os.rename(image_dir, self.root / key)
        log.info("unpacked image %s (%s, %d bytes) into the local image cache", source.reference, key, size)

    @contextlib.asynccontextmanager
    async def _unpack_lock(self, key: str) -> AsyncIterator[None]:
        """The image's unpack lock, across daemons sharing the cache (polled: a waiting request
        may be cancelled)."""
        fd = os.open(self.root / ".locks" / key, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    await asyncio.sleep(LOCK_POLL_S)
            yield
        finally:
            os.close(fd)

    @contextlib.asynccontextmanager
    async def _work_dir(self, what: str) -> AsyncIterator[Path]:
        """A scratch directory in the cache (the tools' large temporary files go there too),
        removed afterwards, whatever happened."""
        work = Path(tempfile.mkdtemp(prefix=f".tmp-{what}-", dir=self.root))
        try:
            yield work
        finally:
            await asyncio.shield(asyncio.to_thread(shutil.rmtree, work, True))

    def _make_root(self) -> None:
        (self.root / ".locks").mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)


async def _run_tool(argv: list[str], failure: str, work: Path) -> bytes:
    """Runs skopeo or umoci (temporary files under `work`); its standard output. A tool that is
    missing or fails is the node's FAILED_PRECONDITION, naming the package or the tool's error."""
    tool = shutil.which(argv[0], path=HOST_ENV["PATH"])
    if tool is None:
        raise FailedPrecondition(
            f"{argv[0]} is not installed: the local backend needs it for container images "
            f"(apt-get install {TOOL_PACKAGES[argv[0]]})"
        )
    # setpriv: the tool dies with the daemon, whose next start removes what it left.
    proc = await asyncio.create_subprocess_exec(
        "setpriv",
        "--pdeathsig",
        "KILL",
        "--",
        tool,
        *argv[1:],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**HOST_ENV, "TMPDIR": str(work)},
        cwd=work,
    )
    try:
        out, err = await proc.communicate()
    except BaseException:  # cancelled: the tool must not outlive the request
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise
    if proc.returncode != 0:
        lines = err.decode(errors="replace").strip().splitlines()
        raise FailedPrecondition(f"{failure}: {argv[0]}: {' '.join(lines[-3:]) or f'exit {proc.returncode}'}")
    return out


def image_tools(path: str = HOST_ENV["PATH"]) -> tuple[bool, str]:
    """Whether this host has the tools container images need (`corral doctor`): (ok, what was
    found)."""
    missing = [tool for tool in TOOL_PACKAGES if shutil.which(tool, path=path) is None]
    if missing:
        return False, f"{' and '.join(missing)} not installed"
    return True, f"{' and '.join(TOOL_PACKAGES)} installed"


def _file_stamp(source: ImageSource) -> tuple[int, int, int, int]:
    """What identifies the version of an archive or layout (its index, for a layout); NOT_FOUND
    when it is missing. The daemon reads it as root: like a directory image, it must be one that
    any user could read on the host (FAILED_PRECONDITION otherwise), or a caller could run what
    only root may read."""
    path = os.path.join(source.path, "index.json") if source.transport == "oci" else source.path
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise NotFound(f"local image {source.reference}: {path} does not exist") from None
    except OSError as err:
        raise InvalidArgument(f"local image {source.reference}: {path}: {err.strerror}") from None
    if source.transport != "oci" and not os.path.isfile(path):
        raise InvalidArgument(f"local image {source.reference}: {path} is not a file")
    if not _readable_by_anyone(path):
        raise FailedPrecondition(
            f"local image {source.reference} is not readable by other users: it and every directory above it "
            "must be readable and searchable by any user (the daemon unpacks only what a sandbox's uid could read)"
        )
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _readable_by_anyone(path: str) -> bool:
    """Whether a user who is neither the owner nor in the group could read a file: read permission
    for others on it, search permission on every directory above it."""
    if not os.stat(path).st_mode & stat.S_IROTH:
        return False
    parent = os.path.dirname(os.path.abspath(path))
    while True:
        if not os.stat(parent).st_mode & stat.S_IXOTH:
            return False
        if parent == "/":
            return True
        parent = os.path.dirname(parent)


def _layout_config(layout: Path) -> bytes:
    """The configuration blob of the one image in an OCI layout skopeo wrote."""

    def blob(digest: str) -> bytes:
        algorithm, _, hexdigest = digest.partition(":")
        return (layout / "blobs" / algorithm / hexdigest).read_bytes()

    index = json.loads((layout / "index.json").read_bytes())
    manifest = json.loads(blob(index["manifests"][0]["digest"]))
    return blob(manifest["config"]["digest"])


def _declare_uncompressed_layers(layout: Path) -> None:
    """Gives the uncompressed layers of a layout skopeo wrote the media type that says so. From a
    Docker archive or engine, skopeo keeps the source manifest's gzip media type for layers it
    copied uncompressed, and umoci reads a layer by its media type."""
    index_path = layout / "index.json"
    index = json.loads(index_path.read_bytes())
    blobs = layout / "blobs" / "sha256"
    manifest = json.loads((blobs / index["manifests"][0]["digest"].removeprefix("sha256:")).read_bytes())
    changed = False
    for layer in manifest["layers"]:
        with open(blobs / layer["digest"].removeprefix("sha256:"), "rb") as blob:
            magic = blob.read(4)
        if layer["mediaType"].endswith("+gzip") and not magic.startswith(GZIP_MAGIC):
            layer["mediaType"] = OCI_LAYER_TAR
            changed = True
    if changed:
        data = json.dumps(manifest).encode()
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        index["manifests"][0].update(digest=f"sha256:{digest}", size=len(data))
        index_path.write_text(json.dumps(index))


def _key(digest: str) -> str:
    """The cache's name for an image ("sha256-<hex>": no colon, which overlayfs options reserve)."""
    return digest.replace(":", "-", 1)


def _touch(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.utime(path)


def _recorded_size(image_dir: str) -> int:
    try:
        return int(json.loads(Path(image_dir, "image.json").read_text())["size_bytes"])
    except (OSError, ValueError, KeyError, TypeError):
        return disk_usage(Path(image_dir))
