"""What a rootless local backend reports and sets for the limits no cgroup holds
(daemon/backends/local/rlimits.py), and how `corral doctor` says each of the three states."""

from __future__ import annotations

import resource

from corral.daemon import doctor
from corral.daemon.backends.local.rlimits import SandboxRlimits, kernel_counts_nproc_per_namespace
from corral.daemon.cgroups import LimitSupport

NO_CGROUP = LimitSupport(False, reason="the daemon is not root and has no delegated cgroup with it")
CGROUP_PIDS = LimitSupport(True, "cgroup v2 pids")
NO_DISK = LimitSupport(False, reason="the daemon is not root: it cannot mount a filesystem per sandbox")


def node_limits(**overrides: LimitSupport) -> dict[str, LimitSupport]:
    limits = {"memory": NO_CGROUP, "pids": NO_CGROUP, "cpu": NO_CGROUP, "disk": NO_DISK}
    return {**limits, **overrides}


def test_rlimits_stand_in_where_no_cgroup_holds_the_limit_and_say_so():
    rlimits = SandboxRlimits(held={"pids"}, prlimit="/usr/bin/prlimit", release="6.1.0-18-amd64")
    reported = rlimits.report(node_limits(pids=CGROUP_PIDS))
    assert reported["pids"] == CGROUP_PIDS
    assert reported["memory"].approximated and "RLIMIT_AS" in reported["memory"].mechanism
    assert reported["memory"].reason == NO_CGROUP.reason  # (why not the real thing)
    assert reported["disk"].approximated and "RLIMIT_FSIZE" in reported["disk"].mechanism
    assert not reported["cpu"].enforced and not reported["cpu"].approximated
    assert "RLIMIT_CPU" in reported["cpu"].reason
    assert rlimits.values(memory_bytes=1 << 30, pids=64, disk_bytes=0) == {"as": 1 << 30}
    assert rlimits.prefix({"as": 1 << 30}) == ["/usr/bin/prlimit", f"--as={1 << 30}", "--"]
    assert rlimits.prefix({}) == []


def test_nproc_is_left_out_where_the_kernel_counts_every_process_of_the_uid():
    assert kernel_counts_nproc_per_namespace("5.14.0") and kernel_counts_nproc_per_namespace("6.18.44-fc")
    assert not kernel_counts_nproc_per_namespace("5.10.0-28-amd64")
    rlimits = SandboxRlimits(held=set(), prlimit="/usr/bin/prlimit", release="5.10.0-28-amd64")
    pids = rlimits.report(node_limits())["pids"]
    assert not pids.enforced and not pids.approximated and "5.14" in pids.reason
    assert "nproc" not in rlimits.values(memory_bytes=1 << 30, pids=64, disk_bytes=1 << 30)


def test_without_prlimit_every_stand_in_is_absent_saying_why():
    rlimits = SandboxRlimits(held=set(), prlimit="", release="6.1.0")
    assert rlimits.stand_ins == {} and rlimits.values(1 << 30, 64, 1 << 30) == {}


def test_an_rlimit_never_exceeds_the_daemons_own_hard_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    rlimits = SandboxRlimits(held=set(), prlimit="/usr/bin/prlimit", release="6.1.0")
    wanted = 1 << 40
    expected = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    assert rlimits.values(memory_bytes=0, pids=wanted, disk_bytes=0) == {"nproc": expected}


def test_doctor_says_enforced_approximated_and_absent_apart():
    limits = (
        doctor.Limit("pids", True, "cgroup v2 pids", ""),
        doctor.Limit("memory", False, "RLIMIT_AS per process", "no delegated cgroup", approximated=True),
        doctor.Limit("cpu", False, "", "no rlimit caps a CPU rate"),
    )
    lines = doctor.backend_lines([doctor.Backend("local", True, "bubblewrap", "namespaces", limits)])
    assert "  pids: enforced (cgroup v2 pids)" in lines
    assert "  memory: approximated (RLIMIT_AS per process); not enforced: no delegated cgroup" in lines
    assert "  cpu: not enforced: no rlimit caps a CPU rate" in lines
