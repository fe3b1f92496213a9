"""`corral serve` and `corral doctor`: the commands that run daemon code in this process; and
`corral drain`, which drains the node of a running daemon, and `corral health`, which asks it
whether it serves (the probe of deploy/k8s and deploy/slurm)."""

from __future__ import annotations

import argparse
import os
import sys
import time

# How long doctor waits for a daemon's GetNodeInfo.
DOCTOR_CALL_TIMEOUT_S = 10.0
# How often `corral drain --wait` asks whether the node is empty.
DRAIN_POLL_S = 1.0
# How long `corral health` waits for the daemon's answer by default.
HEALTH_TIMEOUT_S = 5.0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="run the node daemon")
    serve.add_argument("--config", help="TOML configuration (default: $CORRAL_CONFIG)")
    serve.add_argument("--socket", help="Unix socket path")
    serve.add_argument("--state-dir", help="state directory")
    serve.add_argument("--tcp", help="also listen on HOST:PORT (needs a token)")
    serve.add_argument("--token-file", help="file holding the TCP bearer token")
    serve.add_argument("--metrics", help="serve Prometheus metrics on HOST:PORT")
    serve.set_defaults(func=serve_command)

    doctor = sub.add_parser(
        "doctor",
        help="explain which backends, isolation and limits work here, and how to fix what is missing",
        description="Reports the running daemon's view (GetNodeInfo at --address, when one answers) and this "
        "host probed with this command's settings (--config), naming the fix for each missing part. Exits 1 when "
        "no backend can make a sandbox (the daemon's, or where none answers, this host's).",
    )
    doctor.add_argument("--config", help="TOML configuration for the host probe (default: $CORRAL_CONFIG)")
    doctor.set_defaults(func=doctor_command)

    drain = sub.add_parser(
        "drain",
        help="drain the node: no new sandboxes or rollouts, what runs finishes (--undo: take work again)",
    )
    drain.add_argument("--undo", action="store_true", help="take the node back into service")
    drain.add_argument("--wait", action="store_true", help="wait until nothing is left on the node")
    drain.set_defaults(func=drain_command)

    health = sub.add_parser(
        "health",
        help="exit 0 when the daemon answers SERVING on its gRPC health service, else 1 (a probe)",
        description="Calls grpc.health.v1.Health/Check on the daemon at --address (over TCP with the bearer "
        "token of $CORRAL_TOKEN) and prints its status. Exit status 0: SERVING; 1: anything else, or no answer.",
    )
    health.add_argument(
        "--service", default="", help="one service's status, e.g. corral.v1.SandboxService (default: the daemon's)"
    )
    health.add_argument(
        "--timeout",
        type=float,
        default=HEALTH_TIMEOUT_S,
        help=f"seconds to wait for the answer (default {HEALTH_TIMEOUT_S:g})",
    )
    health.set_defaults(func=health_command)


def serve_command(args: argparse.Namespace) -> int:
    from corral.daemon.config import ConfigError, load_config
    from corral.daemon.server import DaemonAlreadyRunning, main

    try:
        config = load_config(
            args.config,
            socket=args.socket,
            state_dir=args.state_dir,
            tcp_listen=args.tcp,
            token_file=args.token_file,
            metrics_listen=args.metrics,
        )
        main(config)
    except (ConfigError, DaemonAlreadyRunning) as err:
        print(f"corral serve: {err}", file=sys.stderr)
        return 2
    return 0


def doctor_command(args: argparse.Namespace) -> int:
    from corral.daemon.config import ConfigError, load_config
    from corral.daemon.doctor import NOTHING_USABLE, report
    from corral.sdk import Client
    from corral.sdk.errors import CorralError
    from corral.sdk.types import NodeInfo

    try:
        config = load_config(args.config)
    except ConfigError as err:
        print(f"corral doctor: {err}", file=sys.stderr)
        return 2
    address, error, fix = args.address or "the default address", None, None
    node: NodeInfo | None = None
    try:
        with Client(args.address, timeout=DOCTOR_CALL_TIMEOUT_S) as client:
            address = client.address
            node = client.node_info()
    except CorralError as err:
        error = err.details
        fix = getattr(err, "hint", None)
    source = args.config or os.environ.get("CORRAL_CONFIG")
    found = report(
        config,
        address=address,
        node=node,
        error=error,
        fix=fix,
        config_source=f"settings from {source}" if source else "default settings",
    )
    print(found.text)
    if not found.usable:
        print(f"corral doctor: {NOTHING_USABLE}", file=sys.stderr)
        return 1
    return 0


def drain_command(args: argparse.Namespace) -> int:
    from corral.sdk import Client

    with Client(args.address, token=os.environ.get("CORRAL_TOKEN")) as client:
        state = client.drain(not args.undo)
        while args.wait and state.draining and not state.empty:
            time.sleep(DRAIN_POLL_S)
            node = client.node_info()
            state = type(state)(node.draining, node.empty)
    what = "draining" if state.draining else "taking new work"
    print(f"{client.address}: {what}, {'empty' if state.empty else 'not empty'}")
    return 0


def health_command(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from corral.sdk._address import auth_metadata, resolve_address, resolve_token

    address = resolve_address(args.address)
    request = health_pb2.HealthCheckRequest(service=args.service)
    with grpc.insecure_channel(address.grpc_target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                request, timeout=args.timeout, metadata=auth_metadata(resolve_token())
            )
        except grpc.RpcError as err:
            print(f"corral health: {address}: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    print(f"{address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1
