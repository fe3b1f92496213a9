"""`corral serve` and `corral doctor`: the commands that run daemon code in this process."""

from __future__ import annotations

import argparse
import sys


def add_parsers(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="run the node daemon")
    serve.add_argument("--config", help="TOML configuration (default: $CORRAL_CONFIG)")
    serve.add_argument("--socket", help="Unix socket path")
    serve.add_argument("--state-dir", help="state directory")
    serve.add_argument("--tcp", help="also listen on HOST:PORT (needs a token)")
    serve.add_argument("--token-file", help="file holding the TCP bearer token")
    serve.add_argument("--metrics", help="serve Prometheus metrics on HOST:PORT")
    serve.set_defaults(func=serve_command)

    doctor = sub.add_parser("doctor", help="explain which backends, isolation and limits work here")
    doctor.add_argument("--config")
    doctor.set_defaults(func=doctor_command)


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
    from corral.daemon.doctor import report

    try:
        config = load_config(args.config)
    except ConfigError as err:
        print(f"corral doctor: {err}", file=sys.stderr)
        return 2
    print(report(config))
    return 0
