"""Round trip of one shell command (`echo x`, `true`) through corral and through the alternatives.

Variants, all in one run, on the same machine:
  corral_uds  Shell.run of the sync SDK over the daemon's Unix socket (bash in a local sandbox)
  corral_tcp  the same over TCP with a bearer token
  raw_pty     the floor: bash under a pty in this process, a random sentinel printf per command
  tmux        send-keys, then capture-pane every 1 ms until a sentinel shows
  subprocess  subprocess.run(["bash", "-c", cmd]) per command
  swerex      SWE-ReX's LocalRuntime bash session (pexpect, PS1 prompt, a second line for $?)

Usage: python bench/shell_latency.py [--quick] [--json PATH] [--backend local]
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import select
import shutil
import subprocess
import tempfile
import termios
import time
from collections.abc import Callable

from _common import (Daemon, interleaved, parse_args, print_header, print_ratios, print_table, ratios, summary,
                     write_json)

COMMANDS = ["echo x", "true"]
RATIO_PAIRS = [("corral_uds", "raw_pty"), ("corral_tcp", "corral_uds"), ("tmux", "corral_uds"),
               ("subprocess", "corral_uds"), ("swerex", "corral_uds")]


class RawPty:
    """bash under a pty with echo off and stderr on a pipe (so it runs without a prompt, as the
    daemon's sessions do); a command ends when the per-run sentinel with its exit code shows."""

    def __init__(self) -> None:
        master, slave = os.openpty()
        attrs = termios.tcgetattr(slave)
        attrs[1] &= ~termios.ONLCR
        attrs[3] &= ~(termios.ECHO | termios.ECHONL)
        termios.tcsetattr(slave, termios.TCSANOW, attrs)
        err_r, err_w = os.pipe()
        self.proc = subprocess.Popen(["bash", "--noprofile", "--norc"], stdin=slave, stdout=slave, stderr=err_w,
                                     start_new_session=True)
        os.close(slave)
        os.close(err_w)
        self.master, self.err = master, err_r
        token = secrets.token_hex(8)
        self.marker = f"printf '\\n__B_{token}_%d__\\n' $?\n".encode()
        self.sentinel = re.compile(rb"\n__B_" + token.encode() + rb"_(-?\d+)__\n")

    def run(self, cmd: str) -> tuple[bytes, int]:
        os.write(self.master, cmd.encode() + b"\n" + self.marker)
        out = b""
        while True:
            ready, _, _ = select.select([self.master, self.err], [], [])
            for fd in ready:
                out += os.read(fd, 65536)
            match = self.sentinel.search(out)
            if match:
                return out[: match.start()], int(match.group(1))

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        os.close(self.master)
        os.close(self.err)


class Tmux:
    """A tmux server of its own (socket in a temporary directory), one session running bash
    without rc files."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="corral-bench-tmux-")
        self.token = secrets.token_hex(6)
        self.turn = 0
        self._tmux("-f", "/dev/null", "new-session", "-d", "-s", "b", "-x", "200", "-y", "50",
                   "bash --noprofile --norc")

    def _tmux(self, *args: str) -> bytes:
        return subprocess.run(["tmux", "-S", f"{self.dir}/sock", *args], check=True, capture_output=True).stdout

    def run(self, cmd: str) -> None:
        self.turn += 1
        # The typed line shows %d, the output the number: only the output matches.
        self._tmux("send-keys", "-t", "b", f"{cmd}; printf '__T_{self.token}_%d__\\n' {self.turn}", "Enter")
        done = f"__T_{self.token}_{self.turn}__".encode()
        while done not in self._tmux("capture-pane", "-p", "-t", "b"):
            time.sleep(0.001)

    def close(self) -> None:
        subprocess.run(["tmux", "-S", f"{self.dir}/sock", "kill-server"], capture_output=True)
        shutil.rmtree(self.dir, ignore_errors=True)


class SweRex:
    """SWE-ReX's LocalRuntime with one bash session; each call runs one BashAction. Its exit-code
    step waits only 0.1 s for the prompt and fails now and then on a busy machine: such a call
    counts in `failures`, and the session is replaced (inside the timed call)."""

    def __init__(self) -> None:
        from swerex.runtime.abstract import BashAction, CloseBashSessionRequest, CreateBashSessionRequest
        from swerex.runtime.local import LocalRuntime

        self.action, self.open, self.close_request = BashAction, CreateBashSessionRequest, CloseBashSessionRequest
        self.failures = 0
        self.loop = asyncio.new_event_loop()
        self.runtime = LocalRuntime()
        self.loop.run_until_complete(self.runtime.create_session(self.open(session="bench")))

    def run(self, cmd: str) -> None:
        try:
            self.loop.run_until_complete(self.runtime.run_in_session(self.action(command=cmd, session="bench")))
        except Exception:  # noqa: BLE001 - any SWE-ReX error: count it, start afresh
            self.failures += 1
            self.loop.run_until_complete(self.runtime.close_session(self.close_request(session="bench")))
            self.loop.run_until_complete(self.runtime.create_session(self.open(session="bench")))

    def close(self) -> None:
        self.loop.run_until_complete(self.runtime.close())
        self.loop.close()


def swerex_missing() -> str | None:
    try:
        import swerex.runtime.local  # noqa: F401
    except ImportError as err:
        return f"swe-rex not importable ({err}); pip install swe-rex"
    return None


def main() -> None:
    args = parse_args(__doc__.split("\n")[0], lambda p: p.add_argument(
        "--backend", default="local", choices=["local"], help="sandbox backend for the corral variants"))
    n, warmup = (100, 10) if args.quick else (2000, 50)
    # SWE-ReX takes ~0.1 s a command (pexpect sleeps 50 ms before each of its two sends).
    counts = {"swerex": 15 if args.quick else 200}
    skipped: dict[str, str] = {}
    closers: list[Callable[[], None]] = []
    variants: dict[str, Callable[[str], object]] = {}

    from corral.sdk import Client

    print_header(f"shell round trip, backend {args.backend}, n={n} per variant (swerex {counts['swerex']})")
    with Daemon(tcp=True) as daemon:
        try:
            uds = Client(daemon.address)
            closers.append(uds.close)
            sandbox = uds.create_sandbox(image="host", backend=args.backend)
            closers.append(sandbox.destroy)
            variants["corral_uds"] = sandbox.shell("uds").run
            assert variants["corral_uds"]("echo x").output == b"x\n"
            tcp = Client(daemon.tcp_address, token=daemon.token)
            closers.append(tcp.close)
            variants["corral_tcp"] = tcp.get_sandbox(sandbox.id).shell("tcp").run

            pty = RawPty()
            closers.append(pty.close)
            variants["raw_pty"] = pty.run
            if shutil.which("tmux"):
                tmux = Tmux()
                closers.append(tmux.close)
                variants["tmux"] = tmux.run
            else:
                skipped["tmux"] = "tmux not installed (apt-get install tmux)"
            variants["subprocess"] = lambda cmd: subprocess.run(["bash", "-c", cmd], capture_output=True)
            rex = None
            if (reason := swerex_missing()) is None:
                rex = SweRex()
                closers.append(rex.close)
                variants["swerex"] = rex.run
            else:
                skipped["swerex"] = reason

            per_command = {}
            for cmd in COMMANDS:
                calls = {name: (lambda run=run, cmd=cmd: run(cmd)) for name, run in variants.items()}
                samples = interleaved(calls, n, warmup, counts=counts)
                per_command[cmd] = {name: summary(s) for name, s in samples.items()}
        finally:
            for close in reversed(closers):
                close()

    results = {name: {**per_command["echo x"][name], "commands": {cmd: per_command[cmd][name] for cmd in COMMANDS}}
               for name in variants}
    all_ratios = {cmd: ratios(per_command[cmd], RATIO_PAIRS) for cmd in COMMANDS}
    for cmd in COMMANDS:
        print_table(f"command {cmd!r}", per_command[cmd], skipped)
        print_ratios(all_ratios[cmd])
    if rex is not None:
        results["swerex"]["failures"] = rex.failures
        print(f"\nswerex: {rex.failures} calls failed (counted with their recovery time)")
    # `echo x` ratios as they are, the other commands' prefixed: "true:corral_uds/raw_pty".
    flat = {**all_ratios["echo x"], **{f"{cmd}:{k}": v for cmd in COMMANDS[1:] for k, v in all_ratios[cmd].items()}}
    write_json(args.json, results, flat)


if __name__ == "__main__":
    main()
