"""FileManager: the file calls of every sandbox (ReadFile, WriteFile, ListDir, and what uploads
and downloads need), passed through to the sandbox's `SandboxFiles` (daemon/fsaccess.py) in a
thread pool of their own; and the resolution of a command's working directory, which goes the
same way."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from corral.sdk.errors import FailedPrecondition, NotFound

from .fsaccess import Entry, SandboxFiles
from .sandboxes import Sandbox, SandboxManager

T = TypeVar("T")

FILE_THREADS = 16


class FileManager:
    def __init__(self, sandboxes: SandboxManager) -> None:
        self.sandboxes = sandboxes
        # A pool of its own, so that slow file calls can never starve the daemon's other blocking
        # work (cgroup kills, teardown) of threads.
        self._pool = ThreadPoolExecutor(FILE_THREADS, thread_name_prefix="sandbox-files")

    def close(self) -> None:
        """Drops the file calls not started yet (call once no RPC is left to wait for them)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _run(self, files: SandboxFiles, call: Callable[[SandboxFiles], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, call, files)

    async def _files(self, sandbox_id: str, call: Callable[[SandboxFiles], T]) -> T:
        """Runs one blocking file operation of a running sandbox in the pool."""
        with self.sandboxes.using(sandbox_id) as sandbox:
            assert sandbox.runtime is not None
            return await self._run(sandbox.runtime.file_access(), call)

    async def command_directory(self, sandbox: Sandbox, cwd: str) -> str:
        """A command's `cwd` checked before anything starts in it: "" and the workdir as they are,
        anything else through `working_directory` (FAILED_PRECONDITION naming a missing path, not
        a shell, kernel or process that fails to start for a reason it cannot say)."""
        runtime = sandbox.runtime
        assert runtime is not None  # a running sandbox (SandboxManager.using)
        if not cwd or cwd == runtime.workdir:
            return cwd
        return await self.working_directory(sandbox, cwd)

    async def working_directory(self, sandbox: Sandbox, cwd: str) -> str:
        """The absolute path of a command's `cwd` in a running sandbox (relative to the workdir,
        as the file calls take paths): FAILED_PRECONDITION naming the path when it is missing or
        not a directory, instead of a command that fails to start."""
        runtime = sandbox.runtime
        assert runtime is not None  # a running sandbox (SandboxManager.using)
        files = runtime.file_access()
        try:
            path, kind = await self._run(files, lambda files: files.kind(cwd))
        except NotFound as err:
            raise FailedPrecondition(
                f"cwd {files.absolute(cwd)} does not exist in sandbox {sandbox.sandbox_id}"
            ) from err
        if kind != "directory":
            raise FailedPrecondition(f"cwd {path} is not a directory in sandbox {sandbox.sandbox_id} (it is a {kind})")
        return path

    async def read_file(self, sandbox_id: str, path: str, offset: int, limit: int) -> tuple[bytes, int, bool]:
        """(data, file size, truncated) of up to `limit` bytes (0: the cap) from `offset`."""
        return await self._files(sandbox_id, lambda files: files.read(path, offset, limit))

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int, make_parents: bool) -> int:
        """Writes a whole file; returns the bytes written."""
        return await self._files(sandbox_id, lambda files: files.write(path, data, mode, make_parents))

    async def list_dir(self, sandbox_id: str, path: str) -> list[Entry]:
        return await self._files(sandbox_id, lambda files: files.list(path))

    async def path_kind(self, sandbox_id: str, path: str) -> tuple[str, str]:
        """(absolute path, kind) of an existing path; NotFound otherwise."""
        return await self._files(sandbox_id, lambda files: files.kind(path))

    async def make_dirs(self, sandbox_id: str, path: str) -> str:
        """Creates a directory and its parents as the sandbox user; returns its absolute path."""
        return await self._files(sandbox_id, lambda files: files.make_dirs(path))

    async def make_staging_dir(self, sandbox_id: str, path: str) -> None:
        """Makes the hidden directory an upload is unpacked into (see SandboxFiles)."""
        await self._files(sandbox_id, lambda files: files.make_staging_dir(path))

    async def move_into(self, sandbox_id: str, staging: str, directory: str) -> None:
        """Moves what a staging directory holds into `directory`, merging directories."""
        await self._files(sandbox_id, lambda files: files.move_into(staging, directory))

    async def remove_tree(self, sandbox_id: str, path: str) -> None:
        await self._files(sandbox_id, lambda files: files.remove_tree(path))
