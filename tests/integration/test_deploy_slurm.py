"""deploy/slurm/corral.sbatch run here as Slurm would run it on a one-node allocation: the job's
environment set by hand and `srun` a stand-in that starts its command once, in place (this node
is the allocation). A real daemon comes up on TCP with the job's token, its address reaches
cluster.json, the job's command uses it, and the daemon is stopped when the command ends."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

from tests.conftest import require_backend
from tests.integration.rootless_daemons import as_user, rootless_place

SLURM = Path(__file__).resolve().parents[2] / "deploy" / "slurm"
# srun's stand-in: drops srun's options and runs the task's command on this node.
FAKE_SRUN = """#!/usr/bin/env bash
while [[ $1 == -* ]]; do shift; done
exec "$@"
"""
# The job's command: reads cluster.json and creates a sandbox on the node it names, over TCP.
JOB_COMMAND = """
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("corral_nodes", sys.argv[1])
nodes = importlib.util.module_from_spec(spec); sys.modules["corral_nodes"] = nodes; spec.loader.exec_module(nodes)
from corral.sdk import Client
cluster = nodes.load(os.environ["CORRAL_CLUSTER_FILE"])
assert cluster.token_file == os.environ["CORRAL_TOKEN_FILE"]
(address,) = cluster.addresses
with Client(address, token=cluster.token()) as client, client.create_sandbox() as sandbox:
    print("sandbox says", sandbox.exec(["echo", "hello"], timeout=10).stdout.decode().strip(), "on", address)
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def job_env(tmp_path: Path, port: int, **extra: str) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    srun = bin_dir / "srun"
    srun.write_text(FAKE_SRUN)
    srun.chmod(0o755)
    env = {key: value for key, value in os.environ.items() if not key.startswith(("CORRAL_", "SLURM"))}
    return {
        **env,
        "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{env['PATH']}",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_CPUS_ON_NODE": "2",
        "SLURM_SUBMIT_DIR": str(tmp_path),
        "SLURMD_NODENAME": "node-a",
        "CORRAL_SLURM_DIR": str(SLURM),
        "CORRAL_JOB_DIR": str(tmp_path / "job"),
        "CORRAL_RUN_DIR": str(tmp_path / "node-a"),
        "CORRAL_BIN": str(Path(sys.executable).parent / "corral"),
        "CORRAL_PYTHON": sys.executable,
        "CORRAL_PORT": str(port),
        "CORRAL_ADVERTISE_HOST": "127.0.0.1",
        "CORRAL_START_TIMEOUT_S": "60",
        **extra,
    }


def run_job(
    args: list[str], env: dict[str, str], timeout: float, prefix: list[str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Runs corral.sbatch with ARGS (after `prefix`: as another user); past `timeout`, its process
    group (the node's script and daemon among it) gets SIGTERM, as scancel would send, so that no
    daemon outlives the test."""
    with subprocess.Popen(
        [*(prefix or []), "bash", str(SLURM / "corral.sbatch"), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as job:
        try:
            out, err = job.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGTERM)
            out, err = job.communicate(timeout=60)
            raise AssertionError(f"the job ran past {timeout} s:\n{out}\n{err}") from None
    return subprocess.CompletedProcess(job.args, job.returncode, out, err)


def test_the_batch_script_serves_a_daemon_per_node_to_its_command(tmp_path: Path) -> None:
    require_backend("local")
    port = free_port()
    job = run_job([sys.executable, "-c", JOB_COMMAND, str(SLURM / "corral_nodes.py")], job_env(tmp_path, port), 180)
    logs = "".join(p.read_text() for p in (tmp_path / "job" / "logs").glob("*.log"))
    assert job.returncode == 0, f"{job.stdout}\n{job.stderr}\n{logs}"
    assert f"sandbox says hello on 127.0.0.1:{port}" in job.stdout

    cluster = json.loads((tmp_path / "job" / "cluster.json").read_text())
    run_dir = tmp_path / "node-a"
    assert cluster == {
        "version": 1,
        "job_id": "4242",
        "token_file": str(tmp_path / "job" / "token"),
        "nodes": [
            {
                "node": "node-a",
                "address": f"127.0.0.1:{port}",
                "socket": str(run_dir / "corral.sock"),
                "state_dir": str(run_dir / "state"),
            }
        ],
    }
    token = tmp_path / "job" / "token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and len(token.read_text()) == 64
    # The command done, the daemon was stopped: its socket is gone and its port closed.
    assert not (run_dir / "corral.sock").exists()
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0


def test_a_daemon_that_cannot_start_fails_the_job_with_its_log(tmp_path: Path) -> None:
    config = tmp_path / "broken.toml"
    config.write_text("[daemon]\nno_such_key = 1\n")
    job = run_job(["true"], job_env(tmp_path, free_port(), CORRAL_CONFIG=str(config)), 120)
    assert job.returncode == 1
    assert "node-a: the daemon exited (2) before it served" in job.stderr
    assert "unknown configuration key daemon.no_such_key" in job.stderr  # the log's end, shown
    assert "a node's daemon did not start" in job.stderr
    assert not (tmp_path / "job" / "cluster.json").exists()


# The rootless job's command: the same, and what the node's daemon says of itself.
ROOTLESS_JOB_COMMAND = JOB_COMMAND.replace(
    "with Client(address, token=cluster.token()) as client, client.create_sandbox() as sandbox:",
    "with Client(address, token=cluster.token()) as client, client.create_sandbox() as sandbox:\n"
    "    print('rootless', client.node_info().rootless)",
)


def test_the_batch_script_serves_a_rootless_daemon_as_the_jobs_user() -> None:
    """A job whose user is not root, with no CORRAL_SERVE_PREFIX: each node's daemon runs as the
    job's user, rootless (docs/local-backend.md, "Without root"), and the job's command makes a
    sandbox on it."""
    with rootless_place() as place:
        home = place.root / "slurm"
        home.mkdir(mode=0o755)
        # The corral command as the job's user runs it: an interpreter it may execute, loading
        # this environment's packages (rootless_daemons.RootlessDaemon).
        corral = home / "corral"
        corral.write_text(f'#!/bin/sh\nexec {place.python} -m corral.cli "$@"\n')
        corral.chmod(0o755)
        port = free_port()
        env = job_env(
            home,
            port,
            CORRAL_BIN=str(corral),
            CORRAL_PYTHON=place.python,
            PYTHONPATH=str(place.boot),
            HOME=str(home),
            TMPDIR=str(home),
        )
        if os.geteuid() == 0:
            os.chown(home, place.user.pw_uid, place.user.pw_gid)
        args = [place.python, "-c", ROOTLESS_JOB_COMMAND, str(SLURM / "corral_nodes.py")]
        job = run_job(args, env, 180, prefix=as_user(place.user))
        logs = "".join(p.read_text() for p in (home / "job" / "logs").glob("*.log"))
        assert job.returncode == 0, f"{job.stdout}\n{job.stderr}\n{logs}"
        assert "rootless True" in job.stdout and f"sandbox says hello on 127.0.0.1:{port}" in job.stdout
        assert not (home / "node-a" / "corral.sock").exists()  # stopped with the job
