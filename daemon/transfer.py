"""Tar upload and download, done by `tar` running inside the sandbox as the sandbox user.

Unpacking inside the sandbox means a hostile archive (absolute names, `..`, symlink tricks) can do
no more than the sandbox user could anyway; the same code serves every backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
from collections.abc import AsyncIterable, AsyncIterator

from corral.sdk.errors import CorralError, FailedPrecondition, InvalidArgument

from .execs import ExecManager, Exited, Output
from .files import FileManager
from .fsaccess import STAGING_PREFIX
from .rules import CommandSpec

log = logging.getLogger(__name__)

TRANSFER_TIMEOUT_S = 3600.0
NO_CAP = 1 << 62
UPLOAD_QUEUE_CHUNKS = 16
# GNU tar stores a sparse file's holes as holes (--sparse), so a 2 GiB file with a few bytes of data
# travels as a few blocks; a tar without the option (BusyBox) sends the zeros. Symlinks are stored
# as links, never followed (no -h). `--` ends the options, so a name starting with `-` is a name.
_ARCHIVE_SCRIPT = (
    'if tar --sparse --version >/dev/null 2>&1; then exec tar --sparse -c -f - -C "$1" -- "$2"; '
    'else exec tar -c -f - -C "$1" -- "$2"; fi'
)


class TarTransfer:
    def __init__(self, files: FileManager, execs: ExecManager) -> None:
        self.files = files
        self.execs = execs

    def _spec(self, argv: list[str], stdin=None, output_limit: int = NO_CAP) -> CommandSpec:
        return CommandSpec(argv=argv, shell=None, stdin=stdin, timeout_s=TRANSFER_TIMEOUT_S, output_limit=output_limit)

    async def upload(self, sandbox_id: str, path: str, chunks: AsyncIterable[bytes]) -> int:
        """Unpacks the archive into a hidden staging directory inside `path`, then moves its entries
        into place (see SandboxFiles.move_into): an upload that fails or is cancelled part way,
        whether the archive was bad, the disk filled or the client went away, leaves nothing behind."""
        dest = await self.files.make_dirs(sandbox_id, path)
        # Named here, and made in a shielded task that the cleanup waits for, so that a call
        # cancelled while the directory is being made still removes it.
        staging = os.path.join(dest, STAGING_PREFIX + secrets.token_hex(8))
        making = asyncio.ensure_future(self.files.make_staging_dir(sandbox_id, staging))
        try:
            await asyncio.shield(making)
            received = await self._unpack(sandbox_id, staging, chunks, dest)
            await self.files.move_into(sandbox_id, staging, dest)
        finally:
            # Shielded too: a second cancellation must not leave the staging directory behind.
            await asyncio.shield(asyncio.ensure_future(self._remove(sandbox_id, staging, making)))
        return received

    async def _remove(self, sandbox_id: str, staging: str, making: asyncio.Future) -> None:
        with contextlib.suppress(Exception):
            await making  # its error, if any, is the call's
        try:
            await self.files.remove_tree(sandbox_id, staging)
        except CorralError as err:  # the sandbox went away meanwhile, with its files
            log.info("could not remove upload staging directory %s in %s: %s", staging, sandbox_id, err)

    async def _unpack(self, sandbox_id: str, staging: str, chunks: AsyncIterable[bytes], dest: str) -> int:
        # The request stream is read to its end by a task of its own, whatever tar does: a bad
        # message anywhere in it fails the call, even when tar had already seen a whole archive;
        # one that comes while tar still reads fails tar's input at once, killing it.
        queue: asyncio.Queue[bytes | Exception | None] = asyncio.Queue(maxsize=UPLOAD_QUEUE_CHUNKS)
        received = 0
        tar_done = False

        async def read_requests() -> None:
            nonlocal received
            try:
                async for chunk in chunks:
                    received += len(chunk)
                    if not tar_done:
                        await queue.put(chunk)
            except Exception as err:
                if not tar_done:
                    while not queue.empty():  # room for the error, whatever tar had not read
                        queue.get_nowait()
                    queue.put_nowait(err)
                raise
            if not tar_done:
                await queue.put(None)

        async def tar_input():
            while (item := await queue.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                yield item

        reader = asyncio.ensure_future(read_requests())
        spec = self._spec(["tar", "-x", "-f", "-", "-C", staging, "--no-same-owner"], tar_input(), 1 << 16)
        try:
            outcome = await self.execs.run_command(sandbox_id, spec)
            tar_done = True  # tar may stop reading at the end-of-archive marker: read on, unqueued
            while not queue.empty():
                queue.get_nowait()
            await reader
        finally:
            reader.cancel()
            if reader.done() and not reader.cancelled():
                reader.exception()  # the same error run_command raised, when it failed tar's input
        if outcome.exit.exit_code != 0:
            _refuse_without_tar(outcome.exit.exit_code, outcome.stderr)
            raise InvalidArgument(
                f"could not unpack the archive into {dest}: {outcome.stderr.decode(errors='replace').strip()}"
            )
        return received

    async def download(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        absolute, _ = await self.files.path_kind(sandbox_id, path)
        parent, name = os.path.split(absolute.rstrip("/")) if absolute != "/" else ("/", ".")
        spec = self._spec(["/bin/sh", "-c", _ARCHIVE_SCRIPT, "corral-download", parent or "/", name])
        errors = b""
        events = self.execs.stream_command(sandbox_id, spec, keepalive_s=0)
        try:
            async for event in events:
                if isinstance(event, Output):
                    if event.stream == 1:
                        yield event.data
                    else:
                        errors += event.data[:4096]
                elif isinstance(event, Exited) and event.outcome.exit.exit_code not in (0, 1):
                    # GNU tar exits 1 when a file changed while it was read: the archive is still whole.
                    _refuse_without_tar(event.outcome.exit.exit_code, errors)
                    raise InvalidArgument(f"could not archive {absolute}: {errors.decode(errors='replace').strip()}")
        finally:
            await events.aclose()


def _refuse_without_tar(exit_code: int, stderr: bytes) -> None:
    """FAILED_PRECONDITION when the sandbox cannot run tar at all (126/127: the shell's "cannot
    execute" and "not found"): not a problem with the caller's archive or path."""
    if exit_code in (126, 127):
        raise FailedPrecondition(
            f"the sandbox cannot run tar, which file transfers need: {stderr.decode(errors='replace').strip()}"
        )
