"""gRPC round trips over a Unix socket versus TCP (127.0.0.1), with the sync Python client.

A tiny grpc.aio server (a child process, as the daemon is) listens on both at once and serves:
  unary_health  grpc.health.v1 Health/Check (a real servicer, no payload)
  unary_echo    a generic bytes-passthrough unary method, 64-byte payload
  stream_1      a generic server-streaming method answering with 1 message of 64 bytes
  stream_10     the same with 10 messages
For reference the same Health/Check is also sent to a real corral daemon over its Unix socket
(`corral_unary_health`): the difference is what the daemon's interceptors and loop add.

Usage: python bench/transport.py [--quick] [--json PATH]
"""

from __future__ import annotations

import asyncio
import multiprocessing
import tempfile
from collections.abc import Callable
from pathlib import Path

import grpc
from _common import (
    Daemon,
    free_port,
    interleaved,
    parse_args,
    print_header,
    print_ratios,
    print_table,
    ratios,
    summary,
    write_json,
)
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

PAYLOAD = bytes(64)
METHODS = ["unary_health", "unary_echo", "stream_1", "stream_10"]


def serve(unix_socket: str, port: int) -> None:
    async def echo(request: bytes, context) -> bytes:
        return request

    async def stream(request: bytes, context):
        for _ in range(request[0]):
            yield request

    async def main() -> None:
        server = grpc.aio.server()
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        server.add_generic_rpc_handlers(
            [
                grpc.method_handlers_generic_handler(
                    "bench.Echo",
                    {
                        "Unary": grpc.unary_unary_rpc_method_handler(echo),  # no (de)serializers: raw bytes
                        "Stream": grpc.unary_stream_rpc_method_handler(stream),
                    },
                )
            ]
        )
        server.add_insecure_port(f"unix:{unix_socket}")
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        await server.wait_for_termination()

    asyncio.run(main())


def calls(channel: grpc.Channel) -> dict[str, Callable[[], object]]:
    check = health_pb2_grpc.HealthStub(channel).Check
    unary = channel.unary_unary("/bench.Echo/Unary")
    stream = channel.unary_stream("/bench.Echo/Stream")
    request = health_pb2.HealthCheckRequest()
    one, ten = bytes([1]) + PAYLOAD[1:], bytes([10]) + PAYLOAD[1:]
    return {
        "unary_health": lambda: check(request, timeout=10),
        "unary_echo": lambda: unary(PAYLOAD, timeout=10),
        "stream_1": lambda: list(stream(one, timeout=10)),
        "stream_10": lambda: list(stream(ten, timeout=10)),
    }


def main() -> None:
    args = parse_args(__doc__.split("\n")[0])
    n, warmup = (500, 50) if args.quick else (5000, 200)
    print_header(f"gRPC round trip, sync client, grpc.aio server in a child process, n={n} per variant")
    root = Path(tempfile.mkdtemp(prefix="corral-bench-grpc-"))
    unix_socket, port = root / "echo.sock", free_port()
    server = multiprocessing.get_context("spawn").Process(target=serve, args=(str(unix_socket), port), daemon=True)
    server.start()
    channels = []
    try:
        with Daemon() as daemon:
            variants: dict[str, Callable[[], object]] = {}
            for kind, target in (("uds", f"unix:{unix_socket}"), ("tcp", f"127.0.0.1:{port}")):
                channel = grpc.insecure_channel(target)
                channels.append(channel)
                grpc.channel_ready_future(channel).result(timeout=30)
                variants.update({f"{kind}_{method}": call for method, call in calls(channel).items()})
            channel = grpc.insecure_channel(f"unix:{daemon.socket}")
            channels.append(channel)
            variants["corral_unary_health"] = calls(channel)["unary_health"]
            samples = interleaved(variants, n, warmup)
    finally:
        for channel in channels:
            channel.close()
        server.terminate()
        server.join(10)
        unix_socket.unlink(missing_ok=True)
        root.rmdir()

    results = {name: summary(s) for name, s in samples.items()}
    pairs = [(f"tcp_{m}", f"uds_{m}") for m in METHODS] + [
        ("corral_unary_health", "uds_unary_health"),
        ("uds_stream_1", "uds_unary_echo"),
    ]
    values = ratios(results, pairs)
    print_table("round trip", results)
    print_ratios(values)
    write_json(args.json, results, values)


if __name__ == "__main__":
    main()
