"""Round trip of one shell command (`echo x`, `true`) through corral and through the alternatives.

Variants, all in one run, on the same machine:
  corral_uds       Shell.run of the sync SDK over the daemon's Unix socket (bash in a sandbox of
                   --backend: local, or the docker / singularity test image)
  corral_tcp       the same over TCP with a bearer token
  raw_pty          the floor: bash under a pty in this process, a random sentinel printf per command
  tmux             send-keys, then capture-pane every 1 ms until a sentinel shows     (local only)
  subprocess       subprocess.run(["bash", "-c", cmd]) per command                    (local only)
  swerex           SWE-ReX's LocalRuntime bash session (pexpect, PS1 prompt, $?)      (local only)
With --backend docker, the same container as corral's sandbox, driven like raw_pty:
  raw_docker       `docker exec -it CONTAINER bash --noprofile --norc` under a pty (a setup line
                   first turns off its echo, prompt and line editing)
  raw_nsenter      `nsenter -t <container init> -m -p -i -u -n -r -w bash --noprofile --norc`
With --backend singularity, an instance this script starts with the daemon's flags:
  raw_singularity  `apptainer exec --pwd /workspace instance://NAME bash --noprofile --norc`, pty
  raw_nsenter      nsenter into that instance's init, as above

Usage: python bench/shell_latency.py [--quick] [--json PATH] [--backend local|docker|singularity]
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import re
import secrets
import select
import shutil
import struct
import subprocess
import tempfile
import termios
import time
from collections.abc import Callable, Sequence

from _common import (
    BACKEND_IMAGES,
    BACKENDS,
    NSENTER_FLAGS,
    WORKDIR,
    ApptainerInstance,
    Daemon,
    backend_missing,
    docker_container_of,
    interleaved,
    parse_args,
    print_header,
    print_ratios,
    print_table,
    ratios,
    summary,
    write_json,
)

COMMANDS = ["echo x", "true"]
RATIO_PAIRS = [
    ("corral_uds", "raw_docker"),
    ("corral_uds", "raw_singularity"),
    ("corral_uds", "raw_nsenter"),
    ("corral_uds", "raw_pty"),
    ("corral_tcp", "corral_uds"),
    ("raw_docker", "raw_nsenter"),
    ("raw_singularity", "raw_nsenter"),
    ("raw_nsenter", "raw_pty"),
    ("tmux", "corral_uds"),
    ("subprocess", "corral_uds"),
    ("swerex", "corral_uds"),
]
BASH = ["bash", "--noprofile", "--norc"]
# `docker exec -t` gives bash a terminal on stderr too, so it is interactive: line editing (which
# echoes by itself), a prompt, history, CRLF output. This first line turns all of that off, so
# that from then on it reads and answers like raw_pty's bash.
QUIET_INTERACTIVE = "stty -echo -onlcr; PS1=; PS2=; set +o emacs +o vi +o history"


class RawPty:
    """bash (or `argv`, ending in one) under a pty with echo off and stderr on a pipe (so it runs
    without a prompt, as the daemon's sessions do); a command ends when the per-run sentinel with
    its exit code shows. `setup` is a first line run before any timing (its output dropped)."""

    def __init__(self, argv: Sequence[str] = BASH, setup: str | None = None) -> None:
        master, slave = os.openpty()
        attrs = termios.tcgetattr(slave)
        attrs[1] &= ~termios.ONLCR
        attrs[3] &= ~(termios.ECHO | termios.ECHONL)
        termios.tcsetattr(slave, termios.TCSANOW, attrs)
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
        err_r, err_w = os.pipe()
        self.proc = subprocess.Popen(list(argv), stdin=slave, stdout=slave, stderr=err_w, start_new_session=True)
        os.close(slave)
        os.close(err_w)
        self.master, self.err = master, err_r
        token = secrets.token_hex(8)
        self.marker = f"printf '\\n__B_{token}_%d__\\n' $?\n".encode()
        self.sentinel = re.compile(rb"\n__B_" + token.encode() + rb"_(-?\d+)__\n")
        if setup:
            self.run(setup)
            # Anything the setup line left unread (an echo of it, a prompt) goes now.
            while select.select([self.master, self.err], [], [], 0.2)[0]:
                for fd in select.select([self.master, self.err], [], [], 0)[0]:
                    os.read(fd, 65536)
        output, code = self.run("echo x")
        if output.strip() != b"x" or code != 0:
            self.close()
            raise RuntimeError(f"{argv[0]} pty answered {output!r} (exit {code}) to 'echo x'")

    def run(self, cmd: str, timeout: float = 60.0) -> tuple[bytes, int]:
        os.write(self.master, cmd.encode() + b"\n" + self.marker)
        out = b""
        while True:
            ready, _, _ = select.select([self.master, self.err], [], [], timeout)
            if not ready:
                raise TimeoutError(f"no sentinel after {timeout:g}s; got {out[-200:]!r}")
            for fd in ready:
                try:
                    out += os.read(fd, 65536)
                except OSError as err:  # EIO: the pty's other side is gone
                    raise RuntimeError(f"pty closed; got {out[-200:]!r}") from err
            match = self.sentinel.search(out)
            if match:
                return out[: match.start()], int(match.group(1))

    def close(self) -> None:
        # `exit` first: a killed `docker exec` client would leave its bash running in the container.
        try:
            os.write(self.master, b"exit\n")
            self.proc.wait(5)
        except (OSError, subprocess.TimeoutExpired):
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
        self._tmux(
            "-f", "/dev/null", "new-session", "-d", "-s", "b", "-x", "200", "-y", "50", "bash --noprofile --norc"
        )

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


def raw_variants(backend: str, sandbox_id: str, closers: list[Callable[[], None]]) -> dict[str, Callable]:
    """The raw ptys into the container of a docker sandbox, or into an instance like the daemon's."""
    if backend == "docker":
        container, pid = docker_container_of(sandbox_id)
        docker = RawPty(["docker", "exec", "-it", container, *BASH], setup=QUIET_INTERACTIVE)
        closers.append(docker.close)
        nsenter = RawPty(["nsenter", "-t", str(pid), *NSENTER_FLAGS, *BASH])
        closers.append(nsenter.close)
        return {"raw_docker": docker.run, "raw_nsenter": nsenter.run}
    if backend == "singularity":
        instance = ApptainerInstance(f"corral-bench-{secrets.token_hex(4)}")
        closers.append(instance.stop)
        instance.start()
        singularity = RawPty([instance.binary, "exec", "--pwd", WORKDIR, f"instance://{instance.name}", *BASH])
        closers.append(singularity.close)
        nsenter = RawPty(["nsenter", "-t", str(instance.pid()), *NSENTER_FLAGS, *BASH])
        closers.append(nsenter.close)
        return {"raw_singularity": singularity.run, "raw_nsenter": nsenter.run}
    return {}


def main() -> None:
    args = parse_args(
        __doc__.split("\n")[0],
        lambda p: p.add_argument(
            # Podman's shells are the docker backend's (nsenter into the container): no variant of their own.
            "--backend",
            default="local",
            choices=[b for b in BACKENDS if b != "podman"],
            help="sandbox backend for the corral variants",
        ),
    )
    if reason := backend_missing(args.backend):
        raise SystemExit(f"backend {args.backend} cannot be measured here: {reason}")
    n, warmup = (100, 10) if args.quick else (2000, 50)
    # SWE-ReX takes ~0.1 s a command (pexpect sleeps 50 ms before each of its two sends).
    counts = {"swerex": 15 if args.quick else 200}
    skipped: dict[str, str] = {}
    closers: list[Callable[[], None]] = []
    variants: dict[str, Callable[[str], object]] = {}
    local = args.backend == "local"

    from corral.sdk import Client

    image = BACKEND_IMAGES[args.backend]
    print_header(
        f"shell round trip, backend {args.backend} ({image}), n={n} per variant"
        + (f" (swerex {counts['swerex']})" if local else "")
    )
    with Daemon(tcp=True) as daemon:
        try:
            uds = Client(daemon.address)
            closers.append(uds.close)
            sandbox = uds.create_sandbox(image=image, backend=args.backend, timeout=120)
            closers.append(sandbox.destroy)
            run_uds = variants["corral_uds"] = sandbox.shell("uds").run
            assert run_uds("echo x").output == b"x\n"
            tcp = Client(daemon.tcp_address, token=daemon.token)
            closers.append(tcp.close)
            variants["corral_tcp"] = tcp.get_sandbox(sandbox.id).shell("tcp").run

            pty = RawPty()
            closers.append(pty.close)
            variants["raw_pty"] = pty.run
            variants.update(raw_variants(args.backend, sandbox.id, closers))
            rex = None
            if not local:
                for name in ("tmux", "subprocess", "swerex"):
                    skipped[name] = "a host shell: measured with --backend local"
            else:
                if shutil.which("tmux"):
                    tmux = Tmux()
                    closers.append(tmux.close)
                    variants["tmux"] = tmux.run
                else:
                    skipped["tmux"] = "tmux not installed (apt-get install tmux)"
                variants["subprocess"] = lambda cmd: subprocess.run(["bash", "-c", cmd], capture_output=True)
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
                try:
                    close()
                except Exception as err:  # noqa: BLE001 - close the rest; say what did not close
                    print(f"cleanup: {close!r} failed: {err}")

    results = {
        name: {**per_command["echo x"][name], "commands": {cmd: per_command[cmd][name] for cmd in COMMANDS}}
        for name in variants
    }
    all_ratios = {cmd: ratios(per_command[cmd], RATIO_PAIRS) for cmd in COMMANDS}
    for cmd in COMMANDS:
        print_table(f"command {cmd!r}", per_command[cmd], skipped)
        print_ratios(all_ratios[cmd])
    if rex is not None:
        results["swerex"]["failures"] = rex.failures
        print(f"\nswerex: {rex.failures} calls failed (counted with their recovery time)")
    # `echo x` ratios as they are, the other commands' prefixed: "true:corral_uds/raw_pty".
    flat = {**all_ratios["echo x"], **{f"{cmd}:{k}": v for cmd in COMMANDS[1:] for k, v in all_ratios[cmd].items()}}
    write_json(args.json, results, flat, {"backend": args.backend, "image": image})


if __name__ == "__main__":
    main()
