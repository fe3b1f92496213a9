"""One agent-harness step, `echo hi`, on corral and on the harness's own environments: a
mini-swe-agent step (`env.execute({"command": "echo hi"})`) and a SWE-ReX session turn
(`runtime.run_in_session(BashAction(command="echo hi"))`).

Variants, all in one run, on the same machine:
  corral_exec_local    CorralEnvironment (corral.integrations.minisweagent), one `bash -lc` exec per
                       action (its default), in a local sandbox (image "host")
  corral_shell_local   the same with persistent_shell: the action runs in a corral shell session
  corral_exec_docker   one exec per action in a docker sandbox of the test image
  corral_shell_docker  persistent shell in that docker sandbox
  mini_docker          mini's DockerEnvironment on the same image: `docker exec ... bash -lc` per
                       action, as mini ships it
  mini_local           mini's LocalEnvironment: `subprocess` on the host, no sandbox at all (the floor)
  swerex_corral_local  SWE-ReX's run_in_session through CorralRuntime (corral.integrations.swerex),
                       a turn of a corral shell session in a local sandbox
  swerex_corral_docker the same in a docker sandbox of the test image
  swerex_corral_docker_unchecked  the same without SWE-ReX's syntax check (`bash -n` on the host)
  swerex_remote_local  SWE-ReX's RemoteRuntime over HTTP to `corral swerex-serve` (a CorralRuntime
                       on a local sandbox): what SWE-agent's `deployment: remote` does
  swerex_remote_docker the same on a docker sandbox
  swerex_local         SWE-ReX's LocalRuntime: its pexpect-driven bash on the host, no sandbox
  swerex_remote_host   SWE-ReX's own server (`swerex-remote`, a LocalRuntime) on the host, through
                       RemoteRuntime: what SWE-agent's docker deployment runs inside its container
The ratios to watch are corral_exec_docker/mini_docker (the same step, in the same image, through
corral instead of `docker exec`) and swerex_remote_docker/swerex_remote_host (SWE-ReX's HTTP
protocol served by corral against SWE-ReX's own server). The mini rows need corral[minisweagent],
the swerex rows corral[swerex]; a missing package skips its rows.

Usage: python bench/harness_step.py [--quick] [--json PATH]
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import os
import re
import secrets
import subprocess
import sys
from collections.abc import Callable

from _common import (
    BACKEND_IMAGES,
    Daemon,
    backend_missing,
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

ACTION = {"command": "echo hi"}
RATIO_PAIRS = [
    ("corral_exec_docker", "mini_docker"),
    ("corral_shell_docker", "mini_docker"),
    ("corral_exec_local", "mini_docker"),
    ("corral_shell_local", "mini_docker"),
    ("corral_exec_local", "mini_local"),
    ("corral_shell_local", "mini_local"),
    ("mini_docker", "mini_local"),
    ("swerex_corral_docker", "swerex_local"),
    ("swerex_corral_local", "swerex_local"),
    ("swerex_remote_docker", "swerex_remote_host"),
    ("swerex_remote_local", "swerex_remote_host"),
]


def main() -> None:
    args = parse_args(__doc__.split("\n")[0])
    n, warmup = (30, 3) if args.quick else (300, 10)
    print_header(f"agent harness step ({ACTION['command']!r}), n={n} per variant")
    skipped: dict[str, str] = {}
    variants: dict[str, Callable[[], object]] = {}
    cleanups: list[Callable[[], None]] = []
    with Daemon() as daemon:
        try:
            if importlib.util.find_spec("minisweagent") is None:
                skipped["mini_*"] = "mini-swe-agent is not installed: pip install 'corral[minisweagent]'"
            else:
                add_mini_variants(daemon, variants, cleanups, skipped)
            if importlib.util.find_spec("swerex") is None:
                skipped["swerex_*"] = "swe-rex is not installed: pip install 'corral[swerex]'"
            else:
                add_swerex_variants(daemon, variants, cleanups, skipped)
            samples = interleaved(variants, n, warmup)
        finally:
            for cleanup in reversed(cleanups):
                cleanup()

    results = {name: summary(s) for name, s in samples.items()}
    step_ratios = ratios(results, RATIO_PAIRS)
    print_table(f"{ACTION['command']!r}: one step's round trip", results, skipped)
    print_ratios(step_ratios)
    write_json(args.json, results, step_ratios, {"image": BACKEND_IMAGES["docker"], "skipped": skipped})


def add_mini_variants(
    daemon: Daemon,
    variants: dict[str, Callable[[], object]],
    cleanups: list[Callable[[], None]],
    skipped: dict[str, str],
) -> None:
    os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
    from minisweagent.environments.docker import DockerEnvironment
    from minisweagent.environments.local import LocalEnvironment

    from corral.integrations.minisweagent import CorralEnvironment

    for backend in ("local", "docker"):
        if missing := backend_missing(backend):
            skipped[f"corral_exec_{backend}"] = skipped[f"corral_shell_{backend}"] = missing
            continue
        for mode, persistent in (("exec", False), ("shell", True)):
            env = CorralEnvironment(
                address=daemon.address,
                backend=backend,
                image=BACKEND_IMAGES[backend],
                persistent_shell=persistent,
            )
            cleanups.append(env.cleanup)
            assert env.execute(ACTION)["output"] == "hi\n"
            variants[f"corral_{mode}_{backend}"] = functools.partial(env.execute, ACTION)
    if missing := backend_missing("docker"):
        skipped["mini_docker"] = missing
    else:
        docker_env = DockerEnvironment(image=BACKEND_IMAGES["docker"])
        cleanups.append(docker_env.cleanup)
        assert docker_env.execute(ACTION)["output"] == "hi\n"
        variants["mini_docker"] = lambda: docker_env.execute(ACTION)
    local_env = LocalEnvironment()
    variants["mini_local"] = lambda: local_env.execute(ACTION)


def add_swerex_variants(
    daemon: Daemon,
    variants: dict[str, Callable[[], object]],
    cleanups: list[Callable[[], None]],
    skipped: dict[str, str],
) -> None:
    """SWE-ReX's session turn through CorralRuntime, through `corral swerex-serve` and RemoteRuntime,
    and through SWE-ReX's own LocalRuntime and server. Its API is asyncio: every variant runs its
    turn on one event loop of this thread, so they all pay the same for it."""
    from swerex.runtime.abstract import AbstractRuntime, BashAction, CreateBashSessionRequest
    from swerex.runtime.local import LocalRuntime
    from swerex.runtime.remote import RemoteRuntime

    from corral.integrations.swerex import CorralDeployment, CorralRuntime

    loop = asyncio.new_event_loop()
    cleanups.append(loop.close)
    # check="silent", as SWE-agent sends its commands: an exit code that SWE-ReX's LocalRuntime
    # fails to read back in time under load (its 0.1 s wait for the prompt) is then None, not an
    # exception that would end the run.
    action = BashAction(command=ACTION["command"], timeout=30, check="silent")

    def add(name: str, runtime: AbstractRuntime) -> None:
        loop.run_until_complete(runtime.create_session(CreateBashSessionRequest()))
        turn = functools.partial(runtime.run_in_session, action)
        # strip(): SWE-ReX's LocalRuntime leaves the terminal's blank lines around the output.
        assert loop.run_until_complete(turn()).output.strip() == "hi"
        variants[name] = lambda: loop.run_until_complete(turn())

        def close() -> None:
            loop.run_until_complete(runtime.close())

        cleanups.append(close)

    for backend in ("local", "docker"):
        if missing := backend_missing(backend):
            skipped[f"swerex_corral_{backend}"] = skipped[f"swerex_remote_{backend}"] = missing
            continue
        deployment = CorralDeployment(address=daemon.address, backend=backend, image=BACKEND_IMAGES[backend])
        loop.run_until_complete(deployment.start())

        def stop(deployment: CorralDeployment = deployment) -> None:
            loop.run_until_complete(deployment.stop())

        cleanups.append(stop)
        add(f"swerex_corral_{backend}", deployment.runtime)
        if backend == "docker":  # what the syntax check (`bash -n` on the host) costs a turn
            add("swerex_corral_docker_unchecked", CorralRuntime(deployment.runtime.sandbox, check_syntax=False))
        token = secrets.token_hex(8)
        server = subprocess.Popen(
            [sys.executable, "-m", "corral.cli", "--address", daemon.address, "swerex-serve", "--port", "0"]
            + ["--auth-token", token, "--backend", backend, "--image", BACKEND_IMAGES[backend]],
            stdout=subprocess.PIPE,
            text=True,
        )
        cleanups.append(functools.partial(_stop, server))
        url = re.search(r"(http://\S+)", server.stdout.readline() if server.stdout else "")
        if url is None:
            raise SystemExit(f"corral swerex-serve did not start (exit {server.wait()})")
        add(f"swerex_remote_{backend}", RemoteRuntime(host=url.group(1), auth_token=token, timeout=30))
    add("swerex_local", LocalRuntime())
    token, port = secrets.token_hex(8), free_port()
    native = subprocess.Popen(
        [os.path.join(os.path.dirname(sys.executable), "swerex-remote"), "--host", "127.0.0.1"]
        + ["--port", str(port), "--auth-token", token],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    cleanups.append(functools.partial(_stop, native))
    remote = RemoteRuntime(host="http://127.0.0.1", port=port, auth_token=token, timeout=30)
    loop.run_until_complete(remote.wait_until_alive(timeout=60))
    add("swerex_remote_host", remote)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(30)


if __name__ == "__main__":
    main()
