"""`corral swerex-serve`: SWE-ReX's HTTP server (what its RemoteRuntime and SWE-agent's `deployment:
remote` talk to) over a corral sandbox. Needs the extra corral[swerex]."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

TOKEN_VARIABLE = "CORRAL_SWEREX_TOKEN"


def add_parsers(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser(
        "swerex-serve",
        help="serve SWE-ReX's remote runtime protocol (SWE-agent's `deployment: remote`) over a sandbox",
        description="Creates a sandbox (or uses --sandbox) and serves SWE-ReX's HTTP protocol on it until "
        "SIGINT/SIGTERM; a sandbox it created is destroyed then. Prints the URL it listens on.",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on, 0: any free one (default: 8000)")
    serve.add_argument(
        "--auth-token",
        default=os.environ.get(TOKEN_VARIABLE),
        help=f"the X-API-Key clients must send (default: ${TOKEN_VARIABLE}; '' for none, as SWE-ReX allows)",
    )
    serve.add_argument("--sandbox", help="serve this existing sandbox (left running at exit) instead of a new one")
    serve.add_argument("--image", help="image of the new sandbox (default: the daemon's)")
    serve.add_argument("--backend", help="local, docker or singularity (default: the daemon's)")
    serve.add_argument("--network", action="store_true", help="give the sandbox a network")
    serve.add_argument("--memory-bytes", type=int, help="memory limit of the sandbox")
    serve.add_argument("--user", help="who commands run as in the new sandbox (default: the sandbox's default user)")
    serve.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="a variable of the sandbox")
    serve.add_argument("--label", action="append", default=[], metavar="KEY=VALUE", help="a label of the sandbox")
    serve.add_argument(
        "--idle-timeout",
        type=float,
        default=1800.0,
        help="seconds without calls before the daemon destroys the sandbox by itself (default: 1800)",
    )
    serve.set_defaults(func=swerex_serve_command)


def swerex_serve_command(args: argparse.Namespace) -> int:
    if args.auth_token is None:
        print(f"corral swerex-serve: give --auth-token (or ${TOKEN_VARIABLE}); '' serves without one", file=sys.stderr)
        return 2
    try:
        pairs = {"env": _pairs(args.env), "labels": _pairs(args.label)}
    except ValueError as err:
        print(f"corral swerex-serve: {err}", file=sys.stderr)
        return 2
    try:
        import corral.integrations.swerex  # noqa: F401
    except ImportError as err:
        print(f"corral swerex-serve: needs the extra corral[swerex] ({err})", file=sys.stderr)
        return 2
    return asyncio.run(_serve(args, **pairs))


async def _serve(args: argparse.Namespace, *, env: dict[str, str], labels: dict[str, str]) -> int:
    from corral.integrations.swerex import CorralDeployment, CorralRuntime
    from corral.integrations.swerex_server import serve
    from corral.sdk import AsyncClient

    # Not SWE-ReX's loggers: they print to stdout, whose first line here is the URL.
    logger = logging.getLogger("corral.swerex")
    deployment: CorralDeployment | None = None
    client: AsyncClient | None = None
    if args.sandbox:
        client = AsyncClient(args.address)
        runtime = CorralRuntime(await client.get_sandbox(args.sandbox), logger=logger)
    else:
        deployment = CorralDeployment(
            address=args.address,
            image=args.image,
            backend=args.backend,
            network=args.network,
            memory_bytes=args.memory_bytes,
            user=args.user,
            env=env,
            labels=labels,
            idle_timeout=args.idle_timeout,
            logger=logger,
        )
        await deployment.start()
        runtime = deployment.runtime
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for number in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(number, stop.set)
    try:
        runner = await serve(runtime, host=args.host, port=args.port, auth_token=args.auth_token)
        host, port = runner.addresses[0][:2]
        print(f"corral swerex-serve: sandbox {runtime.sandbox.id} on http://{host}:{port}", flush=True)
        await stop.wait()
        await runner.cleanup()
    finally:
        if deployment is not None:
            await deployment.stop()
        else:
            await runtime.close()
        if client is not None:
            await client.close()
    return 0


def _pairs(items: list[str]) -> dict[str, str]:
    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"expected KEY=VALUE, got {item!r}")
        pairs[key] = value
    return pairs
