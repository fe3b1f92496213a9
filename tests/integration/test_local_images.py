"""Container images on the local backend (daemon/backends/local_images.py): archives, OCI layouts
and the engine's images unpacked once into the daemon's cache, shared by their sandboxes, pruned
by size. The small images here are OCI layouts this module writes itself (the host's dash, env,
cat and C library, plus layers with whiteouts and hard links); the engine's test image shows a
real `docker save` and `docker:` export."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral.daemon.backends.local.images import image_config
from corral.sdk import Client, errors
from tests.conftest import DaemonProcess, require_backend

BASE_IMAGE = "corral-test/base:bookworm"  # scripts/build_test_images.sh
UNPACKED = "unpacked image"  # what the daemon logs once per unpack


# -- images this module writes ----------------------------------------------------------------------


def _host_programs() -> list[tuple[str, bytes, int]]:
    """dash as /bin/sh, env and cat, and the shared libraries they load (paths as the host's
    loader names them): (path in the image, content, mode)."""
    files = {"bin/sh": "/bin/sh", "bin/env": "/usr/bin/env", "bin/cat": "/bin/cat"}
    for program in list(files.values()):
        out = subprocess.run(["ldd", program], capture_output=True, text=True, check=True).stdout
        for lib in re.findall(r"(/\S+) \(0x", out):
            files[lib.lstrip("/")] = lib
    return [(path, Path(os.path.realpath(host)).read_bytes(), 0o755) for path, host in files.items()]


def _tar(entries: list[tuple]) -> bytes:
    """A layer: (name, kind, data, mode, uid, gid) with kind file, dir or hard (data: the target)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, kind, data, mode, uid, gid in entries:
            info = tarfile.TarInfo(name)
            info.mode, info.uid, info.gid, info.mtime = mode, uid, gid, 1_700_000_000
            if kind == "dir":
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif kind == "hard":
                info.type, info.linkname = tarfile.LNKTYPE, data
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _dirs(paths: list[str]) -> list[tuple]:
    parents = sorted({str(Path(p).parents[i]) for p in paths for i in range(len(Path(p).parents) - 1)})
    return [(d, "dir", b"", 0o755, 0, 0) for d in parents]


BASE_LAYER = None


def base_layer() -> bytes:
    global BASE_LAYER
    if BASE_LAYER is None:
        programs = _host_programs()
        BASE_LAYER = _tar(
            [*_dirs([p for p, _, _ in programs]), *((p, "file", data, mode, 0, 0) for p, data, mode in programs)]
        )
    return BASE_LAYER


def _file(name: str, data: bytes = b"", mode: int = 0o644, uid: int = 0, gid: int = 0) -> tuple:
    return (name, "file", data, mode, uid, gid)


def _dir(name: str, mode: int = 0o755) -> tuple:
    return (name, "dir", b"", mode, 0, 0)


DATA_LAYER = _tar(
    [_dir("data"), _dir("data/gone"), _file("data/gone/file", b"gone\n"), _file("data/deleted", b"deleted\n")]
    + [_dir("data/opaque"), _file("data/opaque/old", b"old\n"), _file("data/owned", b"owned\n", 0o640, 1234, 5678)]
    + [_file("data/setuid", b"#!/bin/sh\n", 0o4755)]
)
# Removes what the data layer made (a directory, a file, a directory's old content: whiteouts and
# an opaque directory) and adds a pair of hard links.
CHANGE_LAYER = _tar(
    [_file("data/.wh.gone"), _file("data/.wh.deleted"), _dir("data/opaque", 0o775), _file("data/opaque/.wh..wh..opq")]
    + [_file("data/opaque/new", b"new\n"), _file("data/link1", b"linked\n", 0o644, 42, 43)]
    + [("data/link2", "hard", "data/link1", 0o644, 42, 43)]
)


def write_oci_layout(path: Path, layers: list[bytes], *, env: list[str], label: str = "") -> Path:
    """An OCI image layout directory holding one image of these layers."""
    blobs = path / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def blob(data: bytes, media_type: str) -> dict:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return {"mediaType": media_type, "digest": f"sha256:{digest}", "size": len(data)}

    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": env, "WorkingDir": "/data", "User": "1234", "Cmd": ["/bin/sh"], "Labels": {"l": label}},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{hashlib.sha256(x).hexdigest()}" for x in layers]},
    }
    manifest_type = "application/vnd.oci.image.manifest.v1+json"
    manifest = {
        "schemaVersion": 2,
        "mediaType": manifest_type,
        "config": blob(json.dumps(config).encode(), "application/vnd.oci.image.config.v1+json"),
        "layers": [blob(x, "application/vnd.oci.image.layer.v1.tar") for x in layers],
    }
    index = {"schemaVersion": 2, "manifests": [blob(json.dumps(manifest).encode(), manifest_type)]}
    (path / "index.json").write_text(json.dumps(index))
    (path / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    return path


def small_image(parent: Path, name: str) -> str:
    """An oci: reference to a small image of its own (its digest differs by name)."""
    return f"oci:{write_oci_layout(parent / name, [base_layer()], env=['PATH=/bin'], label=name)}"


# -- daemons ----------------------------------------------------------------------------------------


def require_tools() -> None:
    require_backend("local")
    for tool in ("skopeo", "umoci"):
        if shutil.which(tool) is None:
            message = f"{tool} is not installed (apt-get install {tool})"
            if "local" in os.environ.get("CORRAL_REQUIRE_BACKENDS", ""):
                pytest.fail(message)
            pytest.skip(message)


def start_daemon(root: Path, cache: Path, limit: int = 0) -> DaemonProcess:
    require_tools()
    config = root / "corral.toml"
    config.write_text(f'[local]\nimage_cache_dir = "{cache}"\nimage_cache_bytes = {limit}\n')
    return DaemonProcess(root, "--config", str(config)).start()


@contextlib.contextmanager
def daemon(tmp_path: Path, limit: int = 0) -> Iterator[tuple[DaemonProcess, Client, Path]]:
    cache = tmp_path / "cache"
    d = start_daemon(tmp_path, cache, limit)
    try:
        with Client(d.address) as c:
            yield d, c, cache
    finally:
        d.stop()


@pytest.fixture
def images() -> Iterator[Path]:
    """Where the test's archives and layouts go: a directory any user may read (the daemon takes
    only such images), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="corral-test-images-", dir="/var/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def cached_images(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if not p.name.startswith("."))


def unpacks(d: DaemonProcess) -> int:
    return d.log.read_text().count(UNPACKED)


# -- tests ------------------------------------------------------------------------------------------


def test_layers_unpack_as_the_image_says(tmp_path, images):
    layout = write_oci_layout(images / "layout", [base_layer(), DATA_LAYER, CHANGE_LAYER], env=["PATH=/bin", "A=b=c"])
    archive = images / "image.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(layout, arcname=".")
    with daemon(tmp_path) as (d, c, cache):
        with c.create_sandbox(image=f"oci:{layout}") as sb:
            r = sb.exec("cat /data/opaque/new /data/link2; echo /data/* /data/opaque/*", timeout=20)
            assert r.exit_code == 0, r.stderr
            assert (
                r.stdout
                == b"new\nlinked\n/data/link1 /data/link2 /data/opaque /data/owned /data/setuid /data/opaque/new\n"
            )
        [key] = cached_images(cache)
        # The cache is root's alone; inside, every file is as the image made it (unpacked as root).
        assert (cache.stat().st_mode & 0o777) == 0o700
        rootfs = cache / key / "rootfs"
        owned, setuid, opaque = (os.stat(rootfs / "data" / n) for n in ("owned", "setuid", "opaque"))
        assert (owned.st_uid, owned.st_gid, owned.st_mode & 0o7777) == (1234, 5678, 0o640)
        assert (setuid.st_uid, setuid.st_mode & 0o7777) == (0, 0o4755)
        assert opaque.st_mode & 0o7777 == 0o775
        link1, link2 = os.stat(rootfs / "data" / "link1"), os.stat(rootfs / "data" / "link2")
        assert link1.st_ino == link2.st_ino and link1.st_nlink == 2 and (link1.st_uid, link1.st_gid) == (42, 43)
        assert not any(n.startswith(".wh.") for _, dirs, files in os.walk(rootfs) for n in (*dirs, *files))
        config = image_config(str(rootfs))
        assert config is not None
        assert (config.env, config.workdir, config.user, config.cmd) == (
            {"PATH": "/bin", "A": "b=c"},
            "/data",
            "1234",
            ("/bin/sh",),
        )
        # The same layout as an oci-archive is the same image: no second unpack.
        with c.create_sandbox(image=f"oci-archive:{archive}") as sb:
            assert sb.exec(["cat", "/data/opaque/new"], timeout=20).stdout == b"new\n"
        assert cached_images(cache) == [key] and unpacks(d) == 1


def test_concurrent_first_starts_unpack_once(tmp_path, images):
    image = small_image(images, "concurrent")
    with daemon(tmp_path) as (d, c, cache):
        results: list = []

        def start() -> None:
            try:
                with Client(d.address) as own, own.create_sandbox(image=image) as sb:
                    results.append(sb.exec(["cat", "/bin/sh"], timeout=30).exit_code)
            except Exception as err:  # noqa: BLE001 - reported below
                results.append(err)

        threads = [threading.Thread(target=start) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert results == [0, 0, 0, 0]
        assert unpacks(d) == 1 and len(cached_images(cache)) == 1
        assert not [p for p in cache.iterdir() if p.name.startswith((".tmp-", ".trash-"))]


def test_pruning_keeps_to_the_limit_and_spares_images_in_use(tmp_path, images):
    refs = {name: small_image(images, name) for name in ("a", "b", "c")}
    (tmp_path / "size").mkdir()
    (tmp_path / "d").mkdir()
    with daemon(tmp_path / "size") as (_, c, cache):
        with c.create_sandbox(image=refs["a"]):
            pass
        [key] = cached_images(cache)
        size = json.loads((cache / key / "image.json").read_text())["size_bytes"]
    # Room for one image and a half: every unpack past the first prunes.
    with daemon(tmp_path / "d", limit=size * 3 // 2) as (d, c, cache):
        held = c.create_sandbox(image=refs["a"])
        with c.create_sandbox(image=refs["b"]) as sb:
            sb.exec(["cat", "/bin/sh"], timeout=20).check()
        assert len(cached_images(cache)) == 2  # over the limit: a is in use, b was just unpacked
        with c.create_sandbox(image=refs["c"]):
            pass
        # b, unused and least recently used of the unused, went; a is in use still.
        assert sorted(cached_images(cache)) == sorted(_keys(cache, refs["a"], refs["c"]))
        assert held.exec(["cat", "/bin/sh"], timeout=20).exit_code == 0
        held.destroy()
    # At the next start the cache is pruned to its limit again: c goes, used less recently than a
    # (whose sandbox ended last).
    d.start()
    try:
        assert cached_images(cache) == _keys(cache, refs["a"])
    finally:
        d.stop()


def _keys(cache: Path, *refs: str) -> list[str]:
    """The cache names of images (by the references their image.json records)."""
    by_ref = {
        json.loads((p / "image.json").read_text())["reference"]: p.name
        for p in cache.iterdir()
        if (p / "image.json").exists()
    }
    return sorted(by_ref[r] for r in refs)


def test_bad_references_are_refused_clearly(tmp_path, images):
    corrupt = images / "corrupt.tar"
    corrupt.write_bytes(b"this is not a tar archive" * 100)
    corrupt.chmod(0o644)
    private = images / "private.tar"
    private.write_bytes(b"")
    private.chmod(0o600)
    (images / "empty-layout").mkdir()
    with daemon(tmp_path) as (_, c, cache):
        cases = [
            ("docker-archive:relative/image.tar", errors.InvalidArgument, "absolute path"),
            ("docker-archive:/nonexistent/image.tar", errors.NotFound, "/nonexistent/image.tar does not exist"),
            (f"oci:{images}/empty-layout", errors.NotFound, "index.json does not exist"),
            (f"docker-archive:{private}", errors.FailedPrecondition, "not readable by other users"),
            # Below the test's own directory, which only root may enter.
            (small_image(tmp_path, "hidden"), errors.FailedPrecondition, "not readable by other users"),
            (f"docker-archive:{corrupt}", errors.FailedPrecondition, "cannot read image .*: skopeo: "),
            ("docker:", errors.InvalidArgument, "names an image"),
            ("nonsense", errors.InvalidArgument, "container image"),
        ]
        for image, error, message in cases:
            with pytest.raises(error, match=message):
                c.create_sandbox(image=image)
        assert not cached_images(cache)


def test_a_crash_during_an_unpack_leaves_no_half_image(tmp_path, images):
    layout = big_image(images / "big")  # still unpacking when the daemon dies
    with daemon(tmp_path) as (d, c, cache):
        starting = threading.Thread(target=lambda: _ignore_errors(c.create_sandbox, image=f"oci:{layout}"))
        starting.start()
        deadline = time.monotonic() + 60
        while not list(cache.glob(".tmp-sha256-*/image/rootfs")) and time.monotonic() < deadline:
            time.sleep(0.01)
        d.stop(signal.SIGKILL)
        starting.join(30)
        assert not cached_images(cache)
        d.start()  # removes the leftovers, then the image unpacks whole
        assert not [p for p in cache.iterdir() if p.name.startswith(".tmp-")]
        with Client(d.address) as c2, c2.create_sandbox(image=f"oci:{layout}") as sb:
            sb.exec(["cat", "/bin/sh"], timeout=20).check()


def test_an_unpack_goes_on_after_its_request_gives_up(tmp_path, images):
    layout = big_image(images / "big")
    with daemon(tmp_path) as (d, c, cache):
        with pytest.raises(errors.DeadlineExceeded):
            c.create_sandbox(image=f"oci:{layout}", timeout=0.5)
        deadline = time.monotonic() + 60
        while not cached_images(cache) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert cached_images(cache), "the unpack ended with its request"
        with c.create_sandbox(image=f"oci:{layout}") as sb:
            sb.exec(["cat", "/bin/sh"], timeout=20).check()
        assert unpacks(d) == 1


def big_image(path: Path) -> Path:
    """An image whose unpack takes a while (a layer of 64 MiB that does not compress)."""
    return write_oci_layout(path, [base_layer(), _tar([_file("big", os.urandom(64 << 20))])], env=[])


def _ignore_errors(fn, **kwargs) -> None:
    with contextlib.suppress(Exception):
        fn(**kwargs)


# -- the engine's test image ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_image() -> Iterator[str]:
    """An image the engine builds from the test base image, with a file deleted, a directory made
    anew and a hard link in a later layer."""
    require_backend("docker")
    if subprocess.run(["docker", "image", "inspect", BASE_IMAGE], capture_output=True).returncode != 0:
        pytest.skip(f"{BASE_IMAGE} is missing: run scripts/build_test_images.sh")
    tag = "corral-test/local-images:probe"
    dockerfile = (
        f"FROM {BASE_IMAGE}\n"
        "RUN mkdir -p /data/opaque && echo old > /data/opaque/old && echo x > /data/file && chown 1234:5678 /data/file\n"
        "RUN rm /etc/debian_version && rm -r /data/opaque && mkdir /data/opaque && ln /data/file /data/link\n"
    )
    subprocess.run(
        ["docker", "build", "-q", "-t", tag, "-"], input=dockerfile.encode(), check=True, capture_output=True
    )
    yield tag
    subprocess.run(["docker", "image", "rm", "-f", tag], capture_output=True)


def test_engine_image_first_start_unpacks_then_hits_the_cache(engine_image, tmp_path, images):
    archive = images / "image.tar"
    subprocess.run(["docker", "save", "-o", str(archive), engine_image], check=True)
    archive.chmod(0o644)  # (docker save writes it for its owner only)
    with daemon(tmp_path) as (d, c, cache):
        timings = {}
        for label, image in (
            ("docker-archive, first start", f"docker-archive:{archive}"),
            ("docker-archive, cache hit", f"docker-archive:{archive}"),
            ("docker engine, cache hit", f"docker:{engine_image}"),
        ):
            start = time.monotonic()
            with c.create_sandbox(image=image) as sb:
                timings[label] = time.monotonic() - start
                r = sb.exec(
                    "test ! -e /etc/debian_version && ls -A /data/opaque | wc -l && stat -c %i /data/file /data/link",
                    timeout=20,
                )
                lines = r.stdout.decode().split()
                assert r.exit_code == 0 and lines[0] == "0" and lines[1] == lines[2], (r.stdout, r.stderr)
        print(f"\nlocal image starts (load {os.getloadavg()[0]:.1f}):", {k: f"{v:.2f}s" for k, v in timings.items()})
        assert unpacks(d) == 1 and len(cached_images(cache)) == 1
        [key] = cached_images(cache)
        assert os.stat(cache / key / "rootfs" / "data" / "file").st_uid == 1234
        assert timings["docker-archive, cache hit"] < timings["docker-archive, first start"]
