"""execute('1+1') and kernel start through corral, and through jupyter_client in this process.

Variants, all in one run:
  corral_uds         Kernel.execute (ExecuteGathered) of the sync SDK over the Unix socket; the
                     kernel runs in a local sandbox, the daemon talks to it over zmq ipc
  corral_uds_stream  Kernel.execute_stream (Execute, server streaming), drained
  jupyter_ipc        AsyncKernelManager(transport="ipc") + AsyncKernelClient in this process: send
                     execute_request, read iopub until the cell's status idle and the shell reply
                     (what the daemon itself does); one event-loop entry per call
  jupyter_tcp        the same with transport="tcp" (zmq over 127.0.0.1)

Start time: corral's StartKernel round trip; in process, start_kernel() plus wait_for_ready().
If the daemon has no KernelService yet (UNIMPLEMENTED), only the in-process variants are measured.

Usage: python bench/kernel_latency.py [--quick] [--json PATH]
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Callable
from typing import TypeVar

import grpc
from _common import (
    Daemon,
    interleaved,
    parse_args,
    print_header,
    print_ratios,
    print_table,
    ratios,
    summary,
    write_json,
)
from jupyter_client import AsyncKernelManager
from jupyter_client.asynchronous.client import AsyncKernelClient

CODE = "1+1"
RATIO_PAIRS = [
    ("corral_uds", "jupyter_ipc"),
    ("corral_uds", "jupyter_tcp"),
    ("jupyter_tcp", "jupyter_ipc"),
    ("corral_uds_stream", "corral_uds"),
]


class InProcessKernel:
    """A local ipykernel and an async client for it, driven from a private event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, transport: str, runtime_dir: str) -> None:
        self.loop = loop
        self.manager = AsyncKernelManager(transport=transport)
        if transport == "ipc":  # the ipc socket files go next to the connection file
            self.manager.connection_file = f"{runtime_dir}/kernel-{id(self)}.json"
            self.manager.ip = f"{runtime_dir}/kernel-{id(self)}-ipc"
        self.client: AsyncKernelClient | None = None

    def start(self) -> InProcessKernel:
        async def start():
            await self.manager.start_kernel()
            self.client = self.manager.client()
            self.client.start_channels()
            await self.client.wait_for_ready(timeout=60)

        try:
            self.loop.run_until_complete(start())
        except BaseException:
            self.stop()
            raise
        return self

    def execute(self) -> dict | None:
        return self.loop.run_until_complete(self._execute(CODE))

    async def _execute(self, code: str) -> dict | None:
        assert self.client is not None  # start() made it
        msg_id = self.client.execute(code)
        result, idle, reply = None, False, None
        while not (idle and reply):
            if not idle:
                msg = await self.client.get_iopub_msg(timeout=30)
                if msg["parent_header"].get("msg_id") != msg_id:
                    continue
                kind = msg["msg_type"]
                if kind == "execute_result":
                    result = msg["content"]["data"]
                idle = kind == "status" and msg["content"]["execution_state"] == "idle"
            else:
                reply = await self.client.get_shell_msg(timeout=30)
                if reply["parent_header"].get("msg_id") != msg_id:
                    reply = None
        return result

    def stop(self) -> None:
        async def stop():
            if self.client:
                self.client.stop_channels()
            await self.manager.shutdown_kernel(now=True)

        self.loop.run_until_complete(stop())


KernelT = TypeVar("KernelT")


def start_several(
    start: Callable[[], KernelT],
    stop: Callable[[KernelT], None],
    count: int,
    start_ms: dict[str, list[float]],
    name: str,
) -> KernelT:
    """Starts `count` (at least 1) kernels one after the other, timing each; keeps the last and
    stops the rest."""
    kernel: KernelT | None = None
    for _ in range(count):
        if kernel is not None:
            stop(kernel)
        t0 = time.perf_counter()
        kernel = start()
        start_ms.setdefault(name, []).append((time.perf_counter() - t0) * 1000)
    assert kernel is not None
    return kernel


def main() -> None:
    args = parse_args(__doc__.split("\n")[0])
    n, warmup, starts = (100, 10, 2) if args.quick else (2000, 50, 5)
    skipped: dict[str, str] = {}
    start_ms: dict[str, list[float]] = {}
    variants: dict[str, Callable[[], object]] = {}
    closers: list[Callable[[], None]] = []
    loop = asyncio.new_event_loop()

    from corral.sdk import Client
    from corral.sdk.errors import CorralError

    print_header(f"kernel latency, n={n} executions and {starts} starts per variant")
    with Daemon() as daemon, tempfile.TemporaryDirectory(prefix="corral-bench-kernels-") as runtime_dir:
        try:
            client = Client(daemon.address)
            closers.append(client.close)
            sandbox = client.create_sandbox(image="host")
            closers.append(sandbox.destroy)
            try:
                kernel = start_several(sandbox.kernel, lambda k: k.shutdown(), starts, start_ms, "corral_uds")
                closers.append(kernel.shutdown)
                assert kernel.execute(CODE).result == {"text/plain": b"2"}
                variants["corral_uds"] = lambda: kernel.execute(CODE)
                variants["corral_uds_stream"] = lambda: list(kernel.execute_stream(CODE))
            except CorralError as err:
                if getattr(err, "code", None) != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                print(f"the daemon has no KernelService yet ({err}); measuring only the in-process variants")
                skipped["corral_uds"] = skipped["corral_uds_stream"] = "KernelService UNIMPLEMENTED"

            for transport in ("ipc", "tcp"):
                name = f"jupyter_{transport}"

                def start_local(transport: str = transport) -> InProcessKernel:
                    return InProcessKernel(loop, transport, runtime_dir).start()

                local = start_several(
                    start_local,
                    InProcessKernel.stop,
                    starts,
                    start_ms,
                    name,
                )
                closers.append(local.stop)
                assert local.execute() == {"text/plain": "2"}
                variants[name] = local.execute

            samples = interleaved(variants, n, warmup)
        finally:
            for close in reversed(closers):
                close()
            loop.close()

    results = {name: summary(s) for name, s in samples.items()}
    starts_summary = {name: summary(s) for name, s in start_ms.items()}
    execute_ratios = ratios(results, RATIO_PAIRS)
    start_ratios = ratios(starts_summary, RATIO_PAIRS[:3])
    print_table(f"execute({CODE!r}) round trip", results, skipped)
    print_ratios(execute_ratios)
    print_table("kernel start (until it answers)", starts_summary)
    print_ratios(start_ratios)
    for name, start in starts_summary.items():
        results[name]["start"] = start
    write_json(args.json, results, {**execute_ratios, **{f"start:{k}": v for k, v in start_ratios.items()}})


if __name__ == "__main__":
    main()
