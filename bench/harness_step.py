"""One mini-swe-agent step, `env.execute({"command": "echo hi"})`, on corral and on mini's own
environments.

Variants, all in one run, on the same machine:
  corral_exec_local    CorralEnvironment (corral.integrations.minisweagent), one `bash -lc` exec per
                       action (its default), in a local sandbox (image "host")
  corral_shell_local   the same with persistent_shell: the action runs in a corral shell session
  corral_exec_docker   one exec per action in a docker sandbox of the test image
  corral_shell_docker  persistent shell in that docker sandbox
  mini_docker          mini's DockerEnvironment on the same image: `docker exec ... bash -lc` per
                       action, as mini ships it
  mini_local           mini's LocalEnvironment: `subprocess` on the host, no sandbox at all (the floor)
The ratio to watch is corral_exec_docker/mini_docker: the same step, in the same image, through
corral instead of `docker exec`.

Usage: python bench/harness_step.py [--quick] [--json PATH]
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable

from _common import (
    BACKEND_IMAGES,
    Daemon,
    backend_missing,
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
]


def main() -> None:
    args = parse_args(__doc__.split("\n")[0])
    n, warmup = (30, 3) if args.quick else (300, 10)
    print_header(f"mini-swe-agent step (execute {ACTION['command']!r}), n={n} per variant")
    if importlib.util.find_spec("minisweagent") is None:
        raise SystemExit("mini-swe-agent is not installed: pip install 'corral[minisweagent]'")
    os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
    from minisweagent.environments.docker import DockerEnvironment
    from minisweagent.environments.local import LocalEnvironment

    from corral.integrations.minisweagent import CorralEnvironment

    skipped: dict[str, str] = {}
    variants: dict[str, Callable[[], object]] = {}
    cleanups: list[Callable[[], None]] = []
    with Daemon() as daemon:
        try:
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
            samples = interleaved(variants, n, warmup)
        finally:
            for cleanup in reversed(cleanups):
                cleanup()

    results = {name: summary(s) for name, s in samples.items()}
    step_ratios = ratios(results, RATIO_PAIRS)
    print_table(f"execute({ACTION!r}) round trip", results, skipped)
    print_ratios(step_ratios)
    write_json(args.json, results, step_ratios, {"image": BACKEND_IMAGES["docker"], "skipped": skipped})


if __name__ == "__main__":
    main()
