"""Sandbox start: from asking for a sandbox to the end of its first command, per backend, through
corral and through the raw engine doing the same without corral.

Variants, all in one run, in alternating blocks (each call starts one sandbox, runs `true` in it,
and destroys it; the destruction is timed apart and reported in its own table):
  corral_local             client.create_sandbox(image="host", backend="local") + sb.exec(["true"])
  raw_bwrap                for reference only: one `bwrap --unshare-pid --unshare-ipc --unshare-uts
                           --unshare-net --new-session --ro-bind / / --proc /proc --dev /dev
                           --tmpfs /tmp --tmpfs /run true` (nothing stays up, nothing to destroy)
  corral_docker            create_sandbox(image=<test image>, backend="docker") + sb.exec(["true"])
  raw_docker               docker SDK: containers.run(image, "sleep infinity", detach=True,
                           init=True, network_mode="none") + container.exec_run("true");
                           destroy: container.remove(force=True)
  raw_docker_nsenter       the same container, but `true` through nsenter into its init (reload()
                           for the pid first), as corral enters containers
  raw_docker_as_corral     the engine calls of corral's docker backend, made directly: images.get,
                           containers.run with its arguments (workspace and run-dir binds, labels,
                           hostname, workdir, cap_drop ALL, no-new-privileges, the default memory
                           and pids limits), reload(), then nsenter `true`: what is left between
                           this and corral_docker is corral's own
  corral_podman            the docker backend on Podman's Docker-compatible socket (a second
                           daemon, with the explicit rlimits Podman needs here), and
  raw_podman, raw_podman_nsenter, raw_podman_as_corral
                           the raw docker variants against the same socket
  corral_singularity       create_sandbox(image=<test SIF>, backend="singularity") + sb.exec(["true"])
  raw_singularity          `apptainer instance start` with the daemon's flags + `apptainer exec
                           --pwd /workspace instance://NAME true`; destroy: `apptainer instance
                           stop --signal SIGKILL NAME` (as the daemon stops its instances)
  raw_singularity_nsenter  the same instance, `instance list --json` for its pid, nsenter `true`
  corral_<backend>_swe     as corral_<backend>, from the SWE-bench-style test image
                           (scripts/build_swe_test_image.sh: the engine image, its exported root
                           filesystem for local, an Apptainer sandbox directory for singularity)
  local_image_first        with local: create_sandbox(image="docker:<test image>", backend="local")
                           + sb.exec(["true"]) on an empty image cache (the engine's export and the
                           unpack, docs/local-backend.md "Container images"); a few starts only
  local_image_cache_hit    the same once the image is cached
  pool_<backend>_warm      create_sandbox alone (until it answers), served from a warm pool: a
                           daemon of its own with a [[pool]] of the backend's test image that
                           keeps 21 sandboxes ready for 20 creates (docs/backends.md, "Warm pools")
  pool_<backend>_cold      the same request on that daemon with one env var no pool prepared: a
                           cold create (alternating with the warm ones; refills run meanwhile)

Usage: python bench/sandbox_start.py [--quick] [--json PATH] [--backends local,docker,podman,singularity]
"""

from __future__ import annotations

import functools
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

from _common import (
    BACKEND_IMAGES,
    BACKENDS,
    DOCKER_IMAGE,
    NSENTER_FLAGS,
    PODMAN_CONFIG,
    PODMAN_SOCKET,
    PODMAN_ULIMITS,
    RUN_DIR_IN_SANDBOX,
    SWE_IMAGES,
    WORKDIR,
    ApptainerInstance,
    Daemon,
    backend_missing,
    interleaved_phases,
    parse_args,
    print_header,
    print_ratios,
    print_table,
    ratios,
    summary,
    write_json,
)

RATIO_PAIRS = [
    ("corral_local", "raw_bwrap"),
    ("corral_docker", "raw_docker"),
    ("corral_docker", "raw_docker_nsenter"),
    ("corral_docker", "raw_docker_as_corral"),
    ("raw_docker_nsenter", "raw_docker"),
    ("raw_docker_as_corral", "raw_docker_nsenter"),
    ("corral_podman", "raw_podman"),
    ("corral_podman", "raw_podman_as_corral"),
    ("raw_podman", "raw_docker"),
    ("corral_podman", "corral_docker"),
    ("corral_singularity", "raw_singularity"),
    ("corral_singularity", "raw_singularity_nsenter"),
    ("raw_singularity_nsenter", "raw_singularity"),
    *((f"corral_{backend}_swe", f"corral_{backend}") for backend in SWE_IMAGES),
]
RAW_VARIANTS = {
    "local": ["raw_bwrap"],
    "docker": ["raw_docker", "raw_docker_nsenter", "raw_docker_as_corral"],
    "podman": ["raw_podman", "raw_podman_nsenter", "raw_podman_as_corral"],
    "singularity": ["raw_singularity", "raw_singularity_nsenter"],
}
BWRAP = [
    "bwrap",
    "--unshare-pid",
    "--unshare-ipc",
    "--unshare-uts",
    "--unshare-net",
    "--new-session",
    "--ro-bind",
    "/",
    "/",
    "--proc",
    "/proc",
    "--dev",
    "/dev",
    "--tmpfs",
    "/tmp",
    "--tmpfs",
    "/run",
    "true",
]


def ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1000


def check(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(what)


def corral_variant(client, backend: str, image: str = "") -> Callable[[], dict[str, float]]:
    image = image or BACKEND_IMAGES[backend]
    engine_backend = "docker" if backend == "podman" else backend

    def cycle() -> dict[str, float]:
        start = time.perf_counter()
        sandbox = client.create_sandbox(image=image, backend=engine_backend, timeout=120)
        try:
            result = sandbox.exec(["true"])
            started = ms_since(start)
            check(result.exit_code == 0, f"corral {backend}: `true` exited {result.exit_code}: {result.stderr!r}")
        finally:
            destroy_start = time.perf_counter()
            sandbox.destroy()
        return {"start": started, "destroy": ms_since(destroy_start)}

    return cycle


def raw_bwrap() -> dict[str, float]:
    start = time.perf_counter()
    done = subprocess.run(BWRAP, capture_output=True)
    started = ms_since(start)
    check(done.returncode == 0, f"bwrap exited {done.returncode}: {done.stderr!r}")
    return {"start": started}


class RawDocker:
    """The docker SDK without corral: run a container, then its first command."""

    def __init__(self, base_url: str | None = None, ulimits: dict[str, int] | None = None) -> None:
        import docker

        self.client = docker.DockerClient(base_url=base_url, timeout=120) if base_url else docker.from_env(timeout=120)
        # Given to every container (Podman here cannot start one with its default rlimits).
        self.ulimits = [docker.types.Ulimit(name=k, soft=v, hard=v) for k, v in (ulimits or {}).items()] or None
        self.live: set = set()  # containers to remove if a cycle fails half-way
        self.base = Path(tempfile.mkdtemp(prefix="corral-bench-docker-"))
        for sub in ("workspace", "run"):
            (self.base / sub).mkdir()

    def as_corral(self) -> dict:
        """The arguments daemon/backends/docker/backend.py gives containers.run, with the default limits
        (4 GiB memory without swap, 1024 pids, no CPU limit) and labels of our own."""
        return dict(
            command=["sleep", "infinity"],
            detach=True,
            init=True,
            hostname="corral",
            name=f"corral-bench-{secrets.token_hex(6)}",
            labels={"io.corral.bench": "sandbox_start"},
            network_mode="none",
            working_dir=WORKDIR,
            environment={},
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            mem_limit=4 << 30,
            memswap_limit=4 << 30,
            pids_limit=1024,
            ulimits=self.ulimits,
            volumes={
                str(self.base / "workspace"): {"bind": WORKDIR, "mode": "rw"},
                str(self.base / "run"): {"bind": RUN_DIR_IN_SANDBOX, "mode": "rw"},
            },
        )

    def cycle(self, nsenter: bool, as_corral: bool = False) -> dict[str, float]:
        start = time.perf_counter()
        if as_corral:
            self.client.images.get(DOCKER_IMAGE)  # the backend's check that the node has the image
            container = self.client.containers.run(DOCKER_IMAGE, **self.as_corral())
        else:
            container = self.client.containers.run(
                DOCKER_IMAGE, "sleep infinity", detach=True, init=True, network_mode="none", ulimits=self.ulimits
            )
        self.live.add(container)
        if nsenter:
            container.reload()
            done = subprocess.run(
                ["nsenter", "-t", str(container.attrs["State"]["Pid"]), *NSENTER_FLAGS, "true"], capture_output=True
            )
            code = done.returncode
        else:
            code = container.exec_run("true").exit_code
        started = ms_since(start)
        check(code == 0, f"raw docker: `true` exited {code}")
        destroy_start = time.perf_counter()
        container.remove(force=True)
        self.live.discard(container)
        return {"start": started, "destroy": ms_since(destroy_start)}

    def close(self) -> None:
        for container in self.live:
            container.remove(force=True)
        self.client.close()
        shutil.rmtree(self.base, ignore_errors=True)


class RawApptainer:
    """`apptainer instance start` with the daemon's flags (binds made once, outside the timing)."""

    def __init__(self) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="corral-bench-sif-"))
        self.prefix = f"corral-bench-{secrets.token_hex(3)}"
        self.count = 0
        self.live: set[ApptainerInstance] = set()

    def cycle(self, nsenter: bool) -> dict[str, float]:
        self.count += 1
        instance = ApptainerInstance(f"{self.prefix}-{self.count}", self.base)
        start = time.perf_counter()
        self.live.add(instance)
        instance.start()
        if nsenter:
            argv = ["nsenter", "-t", str(instance.pid()), *NSENTER_FLAGS, "true"]
        else:
            argv = [instance.binary, "exec", "--pwd", WORKDIR, f"instance://{instance.name}", "true"]
        done = subprocess.run(argv, capture_output=True)
        started = ms_since(start)
        check(done.returncode == 0, f"raw apptainer: `true` exited {done.returncode}: {done.stderr!r}")
        destroy_start = time.perf_counter()
        instance.stop()
        self.live.discard(instance)
        return {"start": started, "destroy": ms_since(destroy_start)}

    def close(self) -> None:
        for instance in self.live:
            instance.stop()
        shutil.rmtree(self.base, ignore_errors=True)


def local_image_starts(n_first: int, n_hit: int) -> dict[str, dict[str, list[float]]]:
    """The local backend on the engine's test image: starts that export and unpack it into an empty
    cache, then starts from the cache. Sequential: a first start takes seconds."""
    from corral.sdk import Client

    cache = Path(tempfile.mkdtemp(prefix="corral-bench-images-"))
    samples: dict[str, dict[str, list[float]]] = {"local_image_first": {}, "local_image_cache_hit": {}}
    try:
        with Daemon(config=f'[local]\nimage_cache_dir = "{cache}"\n') as daemon, Client(daemon.address) as client:
            cycle = corral_variant(client, "local", image=f"docker:{DOCKER_IMAGE}")
            for name, n in (("local_image_first", n_first), ("local_image_cache_hit", n_hit)):
                for _ in range(n):
                    if name == "local_image_first":
                        for image in cache.glob("sha256-*"):
                            shutil.rmtree(image)
                    for phase, ms in cycle().items():
                        samples[name].setdefault(phase, []).append(ms)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return samples


def warm_pool_creates(backend: str, n: int) -> dict[str, dict[str, list[float]]]:
    """pool_<backend>_warm and pool_<backend>_cold, alternating (see the module docstring); each
    sandbox is destroyed after the pair, untimed."""
    from corral.sdk import Client

    engine_backend = "docker" if backend == "podman" else backend
    image = BACKEND_IMAGES[backend]
    config = (PODMAN_CONFIG if backend == "podman" else "") + (
        f'[[pool]]\nname = "bench"\nsize = {n + 1}\nbackend = "{engine_backend}"\nimage = "{image}"\n'
    )
    samples: dict[str, dict[str, list[float]]] = {f"pool_{backend}_warm": {}, f"pool_{backend}_cold": {}}
    with Daemon(config=config) as daemon, Client(daemon.address) as client:
        deadline = time.monotonic() + 300
        while (pool := client.node_info().pools[0]).ready < pool.size:
            check(time.monotonic() < deadline, f"the {backend} pool did not fill: {pool}")
            time.sleep(0.05)
        for _ in range(n):
            made = []
            for kind, env in (("warm", {}), ("cold", {"CORRAL_BENCH": "cold"})):
                start = time.perf_counter()
                made.append(client.create_sandbox(image=image, backend=engine_backend, env=env, timeout=120))
                samples[f"pool_{backend}_{kind}"].setdefault("create", []).append(ms_since(start))
            for sandbox in made:
                sandbox.destroy()
    return samples


def main() -> None:
    args = parse_args(
        __doc__.split("\n")[0],
        lambda p: p.add_argument(
            "--backends", default=",".join(BACKENDS), help="comma-separated, of: " + ", ".join(BACKENDS)
        ),
    )
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if unknown := [b for b in backends if b not in BACKENDS]:
        raise SystemExit(f"unknown backend(s): {', '.join(unknown)}; known: {', '.join(BACKENDS)}")
    n, warmup = (5, 1) if args.quick else (50, 3)

    from corral.sdk import Client
    from corral.sdk.errors import CorralError

    print_header(f"sandbox start to first command, backends {', '.join(backends)}, n={n} per variant")
    skipped: dict[str, str] = {}
    variants: dict[str, Callable[[], dict[str, float]]] = {}
    closers: list[Callable[[], None]] = []
    # Podman's socket is a second docker engine: its sandboxes come from a daemon of their own.
    with Daemon() as daemon, Daemon(config=PODMAN_CONFIG) if "podman" in backends else nullcontext() as podman_daemon:
        try:
            client = Client(daemon.address)
            closers.append(client.close)
            podman_client = Client(podman_daemon.address) if podman_daemon else None
            if podman_client:
                closers.append(podman_client.close)
            for backend in backends:
                if reason := backend_missing(backend):
                    skipped.update(
                        dict.fromkeys(
                            [f"corral_{backend}", f"corral_{backend}_swe", *RAW_VARIANTS.get(backend, ())], reason
                        )
                    )
                    continue
                backend_client = podman_client if backend == "podman" else client
                for name, image in ((f"corral_{backend}", ""), (f"corral_{backend}_swe", SWE_IMAGES[backend])):
                    corral = corral_variant(backend_client, backend, image)
                    try:
                        corral()  # a first sandbox: does the daemon have this backend and image at all?
                    except CorralError as err:
                        skipped[name] = f"the daemon cannot: {err}"
                    else:
                        variants[name] = corral
                if backend == "local":
                    variants["raw_bwrap"] = raw_bwrap
                elif backend in ("docker", "podman"):
                    docker = RawDocker() if backend == "docker" else RawDocker(PODMAN_SOCKET, PODMAN_ULIMITS)
                    closers.append(docker.close)
                    variants[f"raw_{backend}"] = functools.partial(docker.cycle, nsenter=False)
                    variants[f"raw_{backend}_nsenter"] = functools.partial(docker.cycle, nsenter=True)
                    variants[f"raw_{backend}_as_corral"] = functools.partial(docker.cycle, nsenter=True, as_corral=True)
                elif backend == "singularity":
                    apptainer = RawApptainer()
                    closers.append(apptainer.close)
                    variants["raw_singularity"] = functools.partial(apptainer.cycle, nsenter=False)
                    variants["raw_singularity_nsenter"] = functools.partial(apptainer.cycle, nsenter=True)
            samples = interleaved_phases(variants, n, warmup, blocks=min(20, n))
            if "corral_local" in variants and not backend_missing("docker"):
                samples.update(local_image_starts(2 if args.quick else 5, n))
            elif "local" in backends:
                skipped["local_image_first"] = skipped["local_image_cache_hit"] = "needs docker and its test image"
            pools: dict[str, dict[str, list[float]]] = {}
            for backend in backends:
                if f"corral_{backend}" in variants:
                    pools.update(warm_pool_creates(backend, 20))
        finally:
            for close in reversed(closers):
                try:
                    close()
                except Exception as err:  # noqa: BLE001 - close the rest; say what did not close
                    print(f"cleanup: {close!r} failed: {err}")

    start = {name: summary(s["start"]) for name, s in samples.items()}
    destroy = {name: summary(s["destroy"]) for name, s in samples.items() if "destroy" in s}
    start_ratios = ratios(start, RATIO_PAIRS)
    destroy_ratios = ratios(destroy, RATIO_PAIRS)
    print_table("start: create until the first command (`true`) has exited", start, skipped)
    print_ratios(start_ratios)
    print_table("destroy (not in start)", destroy)
    print_ratios(destroy_ratios)
    create = {name: summary(s["create"]) for name, s in pools.items()}
    pool_pairs = [(f"pool_{b}_cold", f"pool_{b}_warm") for b in backends]
    create_ratios = ratios(create, pool_pairs)
    print_table("create alone: from a warm pool and cold", create)
    print_ratios(create_ratios)
    results = {name: {**start[name], **({"destroy": destroy[name]} if name in destroy else {})} for name in start}
    results.update({name: {"create": create[name]} for name in create})
    flat = {
        **start_ratios,
        **{f"destroy:{k}": v for k, v in destroy_ratios.items()},
        **{f"create:{k}": v for k, v in create_ratios.items()},
    }
    write_json(args.json, results, flat, {"backends": backends, "skipped": skipped})


if __name__ == "__main__":
    main()
