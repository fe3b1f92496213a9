"""process.read_line: a child's line read on the event loop, no worker thread waiting on it."""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from corral.daemon.process import read_line


class NoThreads(ThreadPoolExecutor):
    def submit(self, *args, **kwargs):
        raise AssertionError("read_line used a worker thread")


def run_without_threads(coro):
    async def main():
        asyncio.get_running_loop().set_default_executor(NoThreads(1))
        return await coro

    return asyncio.run(main())


def test_reads_one_line_on_the_loop_and_leaves_the_rest_in_the_pipe():
    read_fd, write_fd = os.pipe()
    try:

        async def late_writer():
            await asyncio.sleep(0.05)
            os.write(write_fd, b"ready\nafter")

        async def both():
            _, line = await asyncio.gather(late_writer(), read_line(read_fd, 5))
            return line

        assert run_without_threads(both()) == b"ready\n"
        assert os.get_blocking(read_fd)  # as it was
        assert os.read(read_fd, 100) == b"after"
    finally:
        os.close(read_fd)
        os.close(write_fd)


def test_end_of_file_gives_what_came_before_it():
    read_fd, write_fd = os.pipe()
    try:
        os.write(write_fd, b"partial")
        os.close(write_fd)
        assert run_without_threads(read_line(read_fd, 5)) == b"partial"
    finally:
        os.close(read_fd)


def test_no_line_in_time_is_timeout_error():
    read_fd, write_fd = os.pipe()
    try:
        with pytest.raises(TimeoutError):
            run_without_threads(read_line(read_fd, 0.05))
        assert os.get_blocking(read_fd)
    finally:
        os.close(read_fd)
        os.close(write_fd)
