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
A whole scripted episode (the `episode_*` rows, fewer repeats): a fresh environment, the task's
repository written into it, then the agent's four actions (run the failing test, fix the bug, run
the test again, submit `git add -A && git diff --cached`), timed from the environment's start to
the submitted diff (its teardown untimed):
  episode_mini_corral_local/_docker  mini's DefaultAgent with a scripted DeterministicModel (the
                       episode of tests/integration/test_minisweagent.py) on CorralEnvironment
  episode_mini_docker / episode_mini_local  the same episode on mini's DockerEnvironment (the test
                       image) and LocalEnvironment (a host directory)
  episode_sweagent_remote_local/_docker  SWE-agent's sequence with a scripted model (the episode of
                       tests/integration/test_swerex.py) through RemoteRuntime and `corral
                       swerex-serve`; the server's sandbox is reused, as SWE-agent's remote
                       deployment reuses the server it is pointed at
  episode_sweagent_corral_local/_docker  the same through CorralRuntime, a fresh CorralDeployment
                       sandbox per episode
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
import logging
import os
import re
import secrets
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from _common import (
    BACKEND_IMAGES,
    Daemon,
    backend_missing,
    free_port,
    interleaved,
    interleaved_phases,
    parse_args,
    print_header,
    print_ratios,
    print_table,
    ratios,
    summary,
    write_json,
)

if TYPE_CHECKING:
    from swerex.runtime.remote import RemoteRuntime

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
    ("episode_mini_corral_docker", "episode_mini_docker"),
    ("episode_mini_corral_local", "episode_mini_docker"),
    ("episode_mini_corral_local", "episode_mini_local"),
]
# The episodes are those of the integration tests: the repository root on the path finds them.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    args = parse_args(__doc__.split("\n")[0])
    logging.disable(logging.INFO)  # the harnesses log each sandbox, container and step
    n, warmup = (30, 3) if args.quick else (300, 10)
    episodes, episode_warmup = (2, 0) if args.quick else (7, 1)
    print_header(f"agent harness step ({ACTION['command']!r}), n={n} per variant; episodes, n={episodes}")
    skipped: dict[str, str] = {}
    variants: dict[str, Callable[[], object]] = {}
    episode_variants: dict[str, Callable[[], dict[str, float]]] = {}
    cleanups: list[Callable[[], None]] = []
    with Daemon() as daemon:
        try:
            if importlib.util.find_spec("minisweagent") is None:
                skipped["mini_*"] = "mini-swe-agent is not installed: pip install 'corral[minisweagent]'"
            else:
                add_mini_variants(daemon, variants, cleanups, skipped)
                add_mini_episodes(daemon, episode_variants, skipped)
            if importlib.util.find_spec("swerex") is None:
                skipped["swerex_*"] = "swe-rex is not installed: pip install 'corral[swerex]'"
            else:
                add_swerex_variants(daemon, variants, cleanups, skipped, episode_variants)
            samples = interleaved(variants, n, warmup)
            episode_samples = interleaved_phases(episode_variants, episodes, episode_warmup, blocks=episodes)
        finally:
            for cleanup in reversed(cleanups):
                cleanup()

    results = {name: summary(s) for name, s in samples.items()}
    results |= {name: summary(phases["episode"]) for name, phases in episode_samples.items()}
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


# The scripted model's actions in mini's episode (tests/integration/test_minisweagent.py).
def mini_episode_steps() -> list[tuple[str, str]]:
    from tests.integration.test_minisweagent import RUN_TESTS, SUBMIT_DIFF

    return [
        ("Run the tests", RUN_TESTS),
        ("Fix add()", "sed -i 's/return a - b/return a + b/' calc.py"),
        ("Run them again", RUN_TESTS),
        ("Submit", SUBMIT_DIFF),
    ]


def add_mini_episodes(
    daemon: Daemon, episodes: dict[str, Callable[[], dict[str, float]]], skipped: dict[str, str]
) -> None:
    """mini's DefaultAgent and DeterministicModel fixing calc.py, on corral and on mini's own
    environments: each call starts a fresh environment, writes the repository into it through the
    environment itself, runs the agent to its submission and checks the diff."""
    from minisweagent.environments.docker import DockerEnvironment
    from minisweagent.environments.local import LocalEnvironment

    from corral.integrations.minisweagent import CorralEnvironment
    from tests.integration.test_minisweagent import BUGGY_REPO, default_agent

    commit = "git init -q && git add -A && git -c user.name=t -c user.email=t@t commit -qm buggy"
    write = " && ".join(f"printf %s {shlex.quote(text)} > {name}" for name, text in BUGGY_REPO.items())
    steps = mini_episode_steps()

    def episode(make_env: Callable[[str], object], teardown: Callable[[object], None], repo: str) -> dict[str, float]:
        started = time.perf_counter()
        env = make_env(repo)
        try:
            setup = env.execute({"command": f"mkdir -p {repo} && cd {repo} && {write} && {commit}"}, cwd="/")  # type: ignore[attr-defined]
            assert setup["returncode"] == 0, setup
            info = default_agent(env, steps, cost_limit=10.0).run("add(2, 3) returns -1; make test_calc pass")  # type: ignore[arg-type]
            elapsed = (time.perf_counter() - started) * 1000
            assert info["exit_status"] == "Submitted" and "+    return a + b\n" in info["submission"], info
        finally:
            teardown(env)
        return {"episode": elapsed}

    def cleanup(env: object) -> None:
        if callable(stop := getattr(env, "cleanup", None)):  # mini's LocalEnvironment has nothing to clean up
            stop()

    def remove_container(env: object) -> None:
        # mini's cleanup stops the container in the background; removed here, untimed, so that no
        # stopping container weighs on the next episode.
        subprocess.run(["docker", "rm", "-f", env.container_id], capture_output=True, check=False)  # type: ignore[attr-defined]

    def local_episode() -> dict[str, float]:
        with tempfile.TemporaryDirectory() as directory:
            return episode(lambda repo: LocalEnvironment(cwd=repo), cleanup, f"{directory}/repo")

    for backend in ("local", "docker"):
        if missing := backend_missing(backend):
            skipped[f"episode_mini_corral_{backend}"] = missing
            continue

        def make_corral(repo: str, backend: str = backend) -> CorralEnvironment:
            return CorralEnvironment(address=daemon.address, backend=backend, image=BACKEND_IMAGES[backend], cwd=repo)

        episodes[f"episode_mini_corral_{backend}"] = functools.partial(episode, make_corral, cleanup, "/tmp/repo")
    if missing := backend_missing("docker"):
        skipped["episode_mini_docker"] = missing
    else:

        def make_docker(repo: str) -> DockerEnvironment:
            return DockerEnvironment(image=BACKEND_IMAGES["docker"], cwd=repo)

        episodes["episode_mini_docker"] = functools.partial(episode, make_docker, remove_container, "/tmp/repo")
    episodes["episode_mini_local"] = local_episode


def add_swerex_variants(
    daemon: Daemon,
    variants: dict[str, Callable[[], object]],
    cleanups: list[Callable[[], None]],
    skipped: dict[str, str],
    episodes: dict[str, Callable[[], dict[str, float]]],
) -> None:
    """SWE-ReX's session turn through CorralRuntime, through `corral swerex-serve` and RemoteRuntime,
    and through SWE-ReX's own LocalRuntime and server. Its API is asyncio: every variant runs its
    turn on one event loop of this thread, so they all pay the same for it."""
    from swerex.runtime.abstract import AbstractRuntime, BashAction, CreateBashSessionRequest
    from swerex.runtime.local import LocalRuntime
    from swerex.runtime.remote import RemoteRuntime

    from corral.integrations.swerex import CorralDeployment, CorralRuntime
    from tests.integration.test_swerex import swe_agent_episode

    loop = asyncio.new_event_loop()
    cleanups.append(loop.close)
    # check="silent", as SWE-agent sends its commands: an exit code that SWE-ReX's LocalRuntime
    # fails to read back in time under load (its 0.1 s wait for the prompt) is then None, not an
    # exception that would end the run.
    action = BashAction(command=ACTION["command"], timeout=30, check="silent")

    def timed_episode(runtime: Callable[[], AbstractRuntime], deployment: CorralDeployment | None) -> dict[str, float]:
        """SWE-agent's sequence from the deployment's start (if any) to the patch read back."""
        with tempfile.TemporaryDirectory() as directory:
            started = time.perf_counter()
            if deployment is not None:
                loop.run_until_complete(deployment.start())
            active = runtime()
            try:
                episode = loop.run_until_complete(swe_agent_episode(active, Path(directory)))
                elapsed = (time.perf_counter() - started) * 1000
                assert "+    return n % 2 == 0\n" in episode.patch, episode
            finally:
                loop.run_until_complete(deployment.stop() if deployment is not None else active.close())
        return {"episode": elapsed}

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
        add(f"swerex_remote_{backend}", serve(daemon, backend, cleanups))
        # A server of its own: SWE-agent's episode opens the session "default" as the turns above do.
        episode_server = serve(daemon, backend, cleanups)

        def remote_episode(remote: RemoteRuntime = episode_server) -> dict[str, float]:
            return timed_episode(lambda: remote, None)

        def corral_episode(backend: str = backend) -> dict[str, float]:
            deployment = CorralDeployment(address=daemon.address, backend=backend, image=BACKEND_IMAGES[backend])
            return timed_episode(lambda: deployment.runtime, deployment)

        episodes[f"episode_sweagent_remote_{backend}"] = remote_episode
        episodes[f"episode_sweagent_corral_{backend}"] = corral_episode
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


def serve(daemon: Daemon, backend: str, cleanups: list[Callable[[], None]]) -> RemoteRuntime:
    """`corral swerex-serve` on a sandbox of `backend`, and SWE-ReX's RemoteRuntime for it."""
    from swerex.runtime.remote import RemoteRuntime

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
    return RemoteRuntime(host=url.group(1), auth_token=token, timeout=30)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(30)


if __name__ == "__main__":
    main()
