"""Tar upload and download, done by `tar` running inside the sandbox as the sandbox user.

Unpacking inside the sandbox means a hostile archive (absolute names, `..`, symlink tricks) can do
no more than the sandbox user could anyway; the same code serves every backend.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterable, AsyncIterator

from corral.sdk.errors import InvalidArgument

from .rules import CommandSpec
from .sandboxes import Exited, Output, SandboxManager

TRANSFER_TIMEOUT_S = 3600.0
NO_CAP = 1 << 62
UPLOAD_QUEUE_CHUNKS = 16


class TarTransfer:
    def __init__(self, manager: SandboxManager) -> None:
        self.manager = manager

    def _spec(self, argv: list[str], stdin=None, output_limit: int = NO_CAP) -> CommandSpec:
        return CommandSpec(argv=argv, shell=None, stdin=stdin, timeout_s=TRANSFER_TIMEOUT_S, output_limit=output_limit)

    async def upload(self, sandbox_id: str, path: str, chunks: AsyncIterable[bytes]) -> int:
        dest = await self.manager.make_dirs(sandbox_id, path)
        # The request stream is read to its end by a task of its own, whatever tar does: a bad
        # message anywhere in it fails the call, even when tar had already seen a whole archive.
        queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=UPLOAD_QUEUE_CHUNKS)
        received = 0
        tar_done = False

        async def read_requests() -> None:
            nonlocal received
            async for chunk in chunks:
                received += len(chunk)
                if not tar_done:
                    await queue.put(chunk)
            if not tar_done:
                await queue.put(None)

        async def tar_input():
            while (chunk := await queue.get()) is not None:
                yield chunk

        reader = asyncio.ensure_future(read_requests())
        spec = self._spec(["tar", "-x", "-f", "-", "-C", dest, "--no-same-owner"], tar_input(), 1 << 16)
        try:
            outcome = await self.manager.run_command(sandbox_id, spec)
            tar_done = True  # tar may stop reading at the end-of-archive marker: read on, unqueued
            while not queue.empty():
                queue.get_nowait()
            await reader
        finally:
            reader.cancel()
        if outcome.exit.exit_code != 0:
            raise InvalidArgument(
                f"could not unpack the archive into {dest}: {outcome.stderr.decode(errors='replace').strip()}"
            )
        return received

    async def download(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        absolute, _ = await self.manager.path_kind(sandbox_id, path)
        parent, name = os.path.split(absolute.rstrip("/")) if absolute != "/" else ("/", ".")
        spec = self._spec(["tar", "-c", "-f", "-", "-C", parent or "/", name])
        errors = b""
        events = self.manager.stream_command(sandbox_id, spec, keepalive_s=0)
        try:
            async for event in events:
                if isinstance(event, Output):
                    if event.stream == 1:
                        yield event.data
                    else:
                        errors += event.data[:4096]
                elif isinstance(event, Exited) and event.outcome.exit.exit_code not in (0, 1):
                    # GNU tar exits 1 when a file changed while it was read: the archive is still whole.
                    raise InvalidArgument(f"could not archive {absolute}: {errors.decode(errors='replace').strip()}")
        finally:
            await events.aclose()
