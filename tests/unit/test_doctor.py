"""`corral doctor`: the running daemon's view when one answers, this host's probe, and a fix named
for every missing part."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from pathlib import Path

import pytest

from corral.daemon import doctor
from corral.daemon.backends.base import FIX_CGROUPS, FIX_ROOT
from corral.daemon.backends.docker.backend import FIX_DOCKER_ENGINE, FIX_DOCKER_PACKAGE
from corral.daemon.backends.local.backend import FIX_BWRAP, FIX_BWRAP_OVER_UNSHARE, FIX_NSENTER
from corral.daemon.backends.registry import BACKENDS
from corral.daemon.backends.singularity.backend import FIX_APPTAINER
from corral.daemon.config import load_config
from corral.daemon.embedded import embedded_daemon
from corral.daemon.testing import fake_backends


async def corral_doctor(*args: str, usable: bool | None = True) -> str:
    """doctor's report; it must exit 0 when `usable`, 1 when not (None: as this host's probe finds)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("CORRAL_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "corral.cli", *args, "doctor", stdout=asyncio.subprocess.PIPE, env=env
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    if usable is None:
        usable = any(status.available for status in doctor.probe(load_config(environ={}))[1].values())
    assert proc.returncode == (0 if usable else 1), out.decode()
    return out.decode()


async def test_doctor_reports_the_running_daemons_view_and_the_host(tmp_path: Path) -> None:
    """The daemon's GetNodeInfo (here a daemon on the fake backend, which says so in its detail),
    then this host probed with doctor's own settings, each labelled."""
    async with embedded_daemon(backend_classes=fake_backends()) as address:
        out = await corral_doctor("--address", address)
    daemon_view, host_view = out.split("this host, probed by corral doctor", 1)
    assert daemon_view.startswith(f"daemon at {address}: corral ")
    assert "  local: available - FAKE BACKEND" in daemon_view and "default backend local" in daemon_view
    assert "FAKE BACKEND" not in host_view and "kernels in local host-image sandboxes" in host_view


async def test_doctor_without_a_daemon_says_how_to_start_one(tmp_path: Path) -> None:
    out = await corral_doctor("--address", f"unix://{tmp_path}/absent.sock", usable=None)
    assert out.startswith(f"daemon at unix://{tmp_path}/absent.sock: none answers")
    assert f"fix: {doctor.FIX_NO_DAEMON}" in out and "this host, probed by corral doctor" in out


def backend(name: str, detail: str, available: bool = False, **unenforced: str) -> doctor.Backend:
    limits = tuple(doctor.Limit(kind, False, "", reason) for kind, reason in unenforced.items())
    return doctor.Backend(name, available, detail, "namespaces" if available else "none", limits)


def test_every_missing_part_names_its_fix(monkeypatch) -> None:
    monkeypatch.setattr(doctor.shutil, "which", lambda *args, **kwargs: None)
    unshare = backend("local", "util-linux unshare 2.38.1 + chroot", available=True)
    assert doctor.fixes(unshare) == [FIX_BWRAP_OVER_UNSHARE]
    missing = backend("local", "neither bubblewrap nor util-linux unshare and chroot are installed (apt-get ...)")
    assert doctor.fixes(missing) == [FIX_BWRAP]
    not_root = backend("local", "nsenter is not installed (apt-get install util-linux); the daemon is not root: ...")
    assert doctor.fixes(not_root) == [FIX_ROOT, FIX_NSENTER]
    engine = backend("docker", "cannot reach the Docker engine at unix:///var/run/docker.sock: ...")
    assert doctor.fixes(engine) == [FIX_DOCKER_ENGINE]
    package = backend("docker", "the docker Python package is not installed (pip install 'corral[docker]')")
    assert doctor.fixes(package) == [FIX_DOCKER_PACKAGE]
    assert doctor.fixes(backend("singularity", "neither apptainer nor singularity is installed")) == [FIX_APPTAINER]
    cgroup = backend(
        "local", "bubblewrap 0.8.0", available=True, memory="cgroup v1 memory hierarchy at /x is not writable"
    )
    assert doctor.fixes(cgroup) == [FIX_CGROUPS]
    lines = doctor.backend_lines([unshare])
    assert lines[-1] == f"  fix: {FIX_BWRAP_OVER_UNSHARE}"


def test_bubblewrap_is_not_suggested_where_it_is_installed(monkeypatch) -> None:
    monkeypatch.setattr(doctor.shutil, "which", lambda *args, **kwargs: "/usr/bin/bwrap")
    assert doctor.fixes(backend("local", "util-linux unshare 2.38.1 + chroot", available=True)) == []


def test_kernels_need_ipykernel_in_the_hosts_python3(tmp_path: Path, monkeypatch) -> None:
    python3 = tmp_path / "python3"
    python3.write_text("#!/bin/sh\nexit 1\n")
    python3.chmod(0o755)
    assert doctor.kernel_python(str(tmp_path)) == (False, f"{python3} has no ipykernel")
    assert doctor.kernel_python(str(tmp_path / "empty"))[0] is False
    python3.write_text("#!/bin/sh\necho 6.0.0\n")
    assert doctor.kernel_python(str(tmp_path)) == (True, f"{python3} has ipykernel 6.0.0")
    monkeypatch.setattr(doctor, "kernel_python", lambda: (False, "/usr/bin/python3 has no ipykernel"))
    host = doctor.host_section(load_config(environ={}), "default settings")
    assert host[-2:] == [
        "  kernels in local host-image sandboxes: unavailable - /usr/bin/python3 has no ipykernel",
        f"    fix: {doctor.FIX_IPYKERNEL}",
    ]


@pytest.mark.skipif(os.geteuid() == 0, reason="checks the advice given to a user who is not root")
def test_not_root_is_told_to_run_as_root() -> None:
    host = doctor.host_section(load_config(environ={}), "default settings")
    assert f"  fix: {FIX_ROOT}" in host


def test_each_backend_names_the_fixes_for_what_its_probe_finds_missing(tmp_path: Path, monkeypatch) -> None:
    """The registered backends probed on a host without their tools (nothing on PATH) or engine (none
    at the docker socket): each status names its backend's own fix, and doctor prints exactly what
    the backend's `fixes` says, in its order."""
    monkeypatch.setattr(shutil, "which", lambda *args, **kwargs: None)
    config = load_config(environ={})
    config.backend("docker").socket = f"unix://{tmp_path}/absent.sock"
    _, statuses = doctor.probe(config)
    assert set(statuses) == set(BACKENDS)
    own = {name: BACKENDS[name].own_fixes(status) for name, status in statuses.items()}
    assert own == {"local": [FIX_NSENTER, FIX_BWRAP], "docker": [FIX_DOCKER_ENGINE], "singularity": [FIX_APPTAINER]}
    for name, status in statuses.items():
        lines = doctor.backend_lines(doctor.host_backends({name: status}))
        printed = [line.removeprefix("  fix: ") for line in lines if line.startswith("  fix: ")]
        assert printed == BACKENDS[name].fixes(status) and set(own[name]) <= set(printed)


def test_nothing_usable_is_said_and_unavailable_backends_list_no_limits(tmp_path: Path, monkeypatch) -> None:
    """A host where no backend can make a sandbox (no tools, no engine) and no daemon answers:
    the report is not usable (doctor exits 1) and no unavailable backend claims a limit enforced."""
    monkeypatch.setattr(shutil, "which", lambda *args, **kwargs: None)
    config = load_config(environ={})
    config.backend("docker").socket = f"unix://{tmp_path}/absent.sock"
    found = doctor.report(config, address="unix:///absent.sock", node=None, error="no such file")
    assert not found.usable
    assert "enforced" not in found.text, found.text
    assert ": unavailable - " in found.text
