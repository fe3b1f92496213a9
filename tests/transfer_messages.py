"""Upload streams for transfer tests, built by hand so that a test can send what no client would."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterator

from corral.v1 import sandbox_pb2 as pb


def tar_of(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def upload_messages(sandbox_id: str, path: str, *chunks: bytes, then=()) -> Iterator[pb.UploadRequest]:
    """An Upload stream: its start, `chunks` of archive, then `then` (messages of the test's own)."""
    yield pb.UploadRequest(start=pb.UploadStart(sandbox_id=sandbox_id, path=path))
    for chunk in chunks:
        yield pb.UploadRequest(chunk=chunk)
    yield from then
