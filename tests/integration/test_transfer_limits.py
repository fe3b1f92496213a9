"""File transfers against hostile sizes and clients: a slow reader cannot make the daemon hold a
whole archive, sparse files stay sparse, out-of-order upload messages fail at once, failed uploads
leave nothing behind, symlinks travel as symlinks, and caller mistakes get definite codes.
Sparseness depends on the sandbox's filesystem and runs on every backend case; the rest is the
daemon's transfer logic and runs on one (tests/README.md)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from corral.v1 import sandbox_pb2 as pb
from corral.v1 import sandbox_pb2_grpc
from tests.transfer_messages import tar_of, upload_messages

MiB = 1 << 20
# What the daemon may grow by while it streams an archive, whatever the archive's size.
RSS_GROWTH_BOUND = 100 * MiB


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


class PeakRss:
    """Samples one process's resident size every 20 ms in a thread and keeps the peak."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.baseline = _rss(pid)
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, _rss(self.pid))

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def growth(self) -> int:
        return self.peak - self.baseline


@contextlib.contextmanager
def stub(daemon) -> Iterator[sandbox_pb2_grpc.SandboxServiceStub]:
    with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
        yield sandbox_pb2_grpc.SandboxServiceStub(channel)


def slow_download(daemon, sandbox_id: str, path: str, seconds: float) -> int:
    """Downloads `path` reading one message every 20 ms, for at most `seconds`, then cancels the
    call; returns the archive bytes read."""
    received = 0
    with stub(daemon) as service:
        responses = service.Download(pb.DownloadRequest(sandbox_id=sandbox_id, path=path), timeout=60)
        deadline = time.monotonic() + seconds
        for response in responses:
            received += len(response.chunk)
            if time.monotonic() > deadline:
                responses.cancel()
                break
            time.sleep(0.02)
    return received


@pytest.mark.above_backend
def test_slow_download_of_a_big_file_keeps_daemon_memory_bounded(daemon, sandbox):
    # 512 MiB of allocated (not sparse) zeros: the archive really is that big, and nothing is
    # written to disk. Read at about 3 MiB/s, the daemon must wait for the reader, not buffer.
    sandbox.exec("fallocate -l 512M big.bin", timeout=30).check()
    with PeakRss(daemon.proc.pid) as rss:
        received = slow_download(daemon, sandbox.id, "big.bin", seconds=2)
        time.sleep(0.5)
    print(f"peak daemon RSS growth {rss.growth / MiB:.1f} MiB for {received / MiB:.1f} MiB read")
    assert received > 0
    assert rss.growth < RSS_GROWTH_BOUND, f"the daemon grew by {rss.growth / MiB:.0f} MiB"


def test_sparse_file_downloads_sparse_without_daemon_memory(daemon, sandbox, tmp_path):
    sandbox.exec("truncate -s 2G sparse.bin && printf middle | dd of=sparse.bin bs=1 seek=1G conv=notrunc", timeout=30)
    with PeakRss(daemon.proc.pid) as rss:
        slow_download(daemon, sandbox.id, "sparse.bin", seconds=3)
        time.sleep(0.5)
    print(f"peak daemon RSS growth {rss.growth / MiB:.1f} MiB during a slow 2 GiB sparse download")
    assert rss.growth < RSS_GROWTH_BOUND, f"the daemon grew by {rss.growth / MiB:.0f} MiB"
    local = sandbox.download("sparse.bin", tmp_path, timeout=60)
    st = os.stat(local)
    assert st.st_size == 2 << 30
    assert st.st_blocks * 512 < 16 * MiB, "the downloaded file is no longer sparse"
    with open(local, "rb") as f:
        f.seek(1 << 30)
        assert f.read(6) == b"middle"


def listing(sandbox, path: str) -> list[str]:
    return sorted(e.name for e in sandbox.list_dir(path))


@pytest.mark.above_backend
def test_a_second_upload_start_fails_at_once(daemon, sandbox):
    """While tar still waits for the rest of the archive, a second `start` ends the call at once
    with INVALID_ARGUMENT (it used to hang until the client's deadline), and nothing is written."""
    archive = tar_of({"big.txt": b"x" * 300_000})
    second_start = pb.UploadRequest(start=pb.UploadStart(sandbox_id=sandbox.id, path="/tmp"))
    release = threading.Event()

    def messages():
        yield from upload_messages(sandbox.id, "/workspace/twice", archive[:100_000], then=[second_start])
        release.wait(30)  # keep the stream open: the daemon must not wait for its end

    with stub(daemon) as service:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            service.Upload(messages(), timeout=20)
        elapsed = time.monotonic() - started
        release.set()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert "start" in err.value.details()
    assert elapsed < 5, f"the bad message was answered after {elapsed:.1f}s"
    assert listing(sandbox, "/workspace/twice") == []


@pytest.mark.parametrize("failure", ["bad archive", "client cancels", "bad message"])
@pytest.mark.above_backend
def test_a_failed_upload_leaves_nothing_behind(daemon, sandbox, failure):
    """Whatever ends an upload early, its destination holds exactly what it held before."""
    sandbox.write_file("/workspace/dest/keep.txt", b"old")
    good = tar_of({"a.txt": b"a" * 1000, "sub/b.txt": b"b" * 200_000, "keep.txt": b"new"})
    if failure == "bad archive":
        # A whole first member, then garbage where the next header should be.
        messages = upload_messages(sandbox.id, "/workspace/dest", good[:2048] + b"\xff" * 4096)
    elif failure == "bad message":
        messages = upload_messages(sandbox.id, "/workspace/dest", good[:150_000], then=[pb.UploadRequest()])
    else:
        release = threading.Event()

        def slow():
            yield from upload_messages(sandbox.id, "/workspace/dest", good[:150_000])
            release.wait(30)

        messages = slow()
    with stub(daemon) as service:
        if failure == "client cancels":
            call = service.Upload.future(messages, timeout=30)
            time.sleep(1.0)  # tar has unpacked what it was sent
            call.cancel()
            release.set()
            with pytest.raises(grpc.FutureCancelledError):
                call.result()
        else:
            with pytest.raises(grpc.RpcError) as err:
                service.Upload(messages, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    deadline = time.monotonic() + 10  # a cancelled call's cleanup runs after the client has left
    while listing(sandbox, "/workspace/dest") != ["keep.txt"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert listing(sandbox, "/workspace/dest") == ["keep.txt"]
    assert sandbox.read_file("/workspace/dest/keep.txt") == b"old"


@pytest.mark.above_backend
def test_upload_merges_into_an_existing_tree(sandbox, tmp_path):
    """Moving into place keeps what tar -x did: files replaced, directories merged."""
    sandbox.write_file("/workspace/m/proj/old.txt", b"old")
    sandbox.write_file("/workspace/m/proj/same.txt", b"before")
    src = tmp_path / "proj"
    (src / "pkg").mkdir(parents=True)
    (src / "same.txt").write_bytes(b"after")
    (src / "pkg" / "new.txt").write_bytes(b"new")
    assert sandbox.upload(src, "/workspace/m") == "/workspace/m/proj"
    assert listing(sandbox, "/workspace/m") == ["proj"]
    assert listing(sandbox, "/workspace/m/proj") == ["old.txt", "pkg", "same.txt"]
    assert sandbox.read_file("/workspace/m/proj/same.txt") == b"after"
    assert sandbox.read_file("/workspace/m/proj/pkg/new.txt") == b"new"


@pytest.mark.above_backend
def test_upload_of_a_file_where_a_directory_is_fails_cleanly(sandbox, tmp_path):
    sandbox.write_file("/workspace/c/thing/inside.txt", b"x")
    (tmp_path / "thing").write_bytes(b"a file now")
    from corral.sdk import errors

    with pytest.raises(errors.InvalidArgument, match="directory is in the way"):
        sandbox.upload(tmp_path / "thing", "/workspace/c")
    assert listing(sandbox, "/workspace/c") == ["thing"]
    assert sandbox.read_file("/workspace/c/thing/inside.txt") == b"x"


@pytest.mark.above_backend
def test_download_of_a_tree_with_absolute_symlinks(sandbox, tmp_path):
    """A venv's bin/python -> /usr/bin/python3 travels as that link: not followed, not refused."""
    sandbox.exec(
        "mkdir -p venv/bin venv/lib && ln -s /usr/bin/python3 venv/bin/python && ln -s lib venv/lib64"
        " && ln -s ../../../../etc venv/up && echo hi > venv/lib/f.txt",
        timeout=10,
    ).check()
    top = sandbox.download("venv", tmp_path / "out")
    assert os.readlink(top / "bin" / "python") == "/usr/bin/python3"
    assert os.readlink(top / "lib64") == "lib"
    assert os.readlink(top / "up") == "../../../../etc"
    assert (top / "lib" / "f.txt").read_bytes() == b"hi\n"


@pytest.mark.above_backend
def test_read_file_past_the_cap_is_refused_with_size_and_a_way_out(daemon, sandbox):
    """ReadFile of a whole file bigger than the daemon's cap (64 MiB) is FAILED_PRECONDITION naming
    the size and Download, on the wire and through the SDK (which used to gather it all)."""
    from corral.sdk import errors

    sandbox.exec("truncate -s 100M huge.bin", timeout=10).check()
    with stub(daemon) as service, pytest.raises(grpc.RpcError) as err:
        service.ReadFile(pb.ReadFileRequest(sandbox_id=sandbox.id, path="huge.bin"), timeout=30)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert str(100 << 20) in err.value.details() and "Download" in err.value.details()
    with pytest.raises(errors.FailedPrecondition, match="download"):
        sandbox.read_file("huge.bin", limit=80 << 20)
    # A range, or the tail of the file, is fine.
    assert sandbox.read_file("huge.bin", offset=(100 << 20) - 5) == b"\0" * 5
    assert sandbox.read_file("huge.bin", offset=10, limit=3) == b"\0" * 3


@pytest.mark.above_backend
def test_download_of_names_tar_could_mistake(sandbox, tmp_path):
    """A name starting with `-` is a name, not a tar option; names that are not UTF-8 arrive as
    the same bytes."""
    sandbox.write_file("-v", b"dash")
    assert sandbox.download("-v", tmp_path / "a").read_bytes() == b"dash"
    sandbox.exec("mkdir odd && printf raw > odd/$(printf 'caf\\351')", timeout=10).check()
    top = sandbox.download("odd", tmp_path / "b")
    assert os.listdir(os.fsencode(top)) == [b"caf\xe9"]


@pytest.mark.above_backend
def test_listing_a_directory_whose_entries_come_and_go(sandbox):
    """Entries removed while a directory is listed (an upload's staging directory being cleaned
    up, a build's temporary files) are left out; the listing does not fail as NOT_FOUND."""
    sandbox.exec("mkdir churn", timeout=10).check()
    churn = sandbox.exec_stream(
        "cd churn; end=$(( $(date +%s) + 3 )); while [ $(date +%s) -lt $end ]; do"
        " for i in 0 1 2 3 4 5 6 7 8 9; do : > f$i; done; rm -f f*; done",
        timeout=10,
    )
    with churn:
        next(iter(churn))  # started
        deadline = time.monotonic() + 2.5
        lists = 0
        while time.monotonic() < deadline:
            assert set(listing(sandbox, "churn")) <= {f"f{i}" for i in range(10)}
            lists += 1
    assert lists > 10
