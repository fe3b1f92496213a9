"""A sandbox's own block of host ids (SandboxInfo.host_id_first, host_id_count): where its programs
run in a user namespace of their own (local, apptainer), root inside is the block's first host id,
never host root, what it writes is that id's on the host, and no two sandboxes share any id of
their blocks; docker and podman sandboxes report none (docs/backends.md, "Users inside")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from corral.daemon.users import INSIDE_ID_COUNT
from tests.conftest import cgroup_dirs

USER_NAMESPACE_BACKENDS = {"local", "singularity"}


def _host_ids_of(daemon_id: str, sandbox_id: str, inside_pid: int) -> tuple[list[int], list[int]]:
    """The host uids and gids (real, effective, saved, filesystem) of the process that is
    `inside_pid` in the sandbox, found among its own cgroup's processes."""
    for group in cgroup_dirs(daemon_id):
        if group.name != sandbox_id:
            continue
        for procs in group.rglob("cgroup.procs"):
            for pid in procs.read_text().split():
                try:
                    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
                except OSError:
                    continue  # gone meanwhile
                if int(status["NSpid"].split()[-1]) == inside_pid and len(status["NSpid"].split()) > 1:
                    return [int(v) for v in status["Uid"].split()], [int(v) for v in status["Gid"].split()]
    raise AssertionError(f"no process {inside_pid} in sandbox {sandbox_id}'s cgroup")


def test_root_inside_is_the_first_id_of_a_block_of_its_own(daemon, client):
    daemon_id = client.node_info().daemon_id
    with client.create_sandbox() as a, client.create_sandbox() as b:
        blocks = [(sb.info.host_id_first, sb.info.host_id_count) for sb in (a, b)]
        listed = subprocess.run(
            [sys.executable, "-m", "corral.cli", "--address", daemon.address, "sandbox", "ls", "--json"],
            capture_output=True,
            check=True,
        ).stdout
        shown = {s["id"]: (s["host_id_first"], s["host_id_count"]) for s in json.loads(listed)}
        assert [shown[a.id], shown[b.id]] == blocks
        if daemon.backend not in USER_NAMESPACE_BACKENDS:
            assert blocks == [(0, 0), (0, 0)]
            return
        (first_a, count_a), (first_b, count_b) = blocks
        assert count_a == count_b == INSIDE_ID_COUNT
        assert first_a > 0 and first_b > 0 and abs(first_a - first_b) >= INSIDE_ID_COUNT, blocks
        assert [(s.host_id_first, s.host_id_count) for s in (a.refresh(), b.refresh())] == blocks
        for sb, first in ((a, first_a), (b, first_b)):
            r = sb.exec("sleep 60 >/dev/null 2>&1 & echo $!; id -u; touch /workspace/by-root", user="root", timeout=30)
            inside_pid, inside_uid = (int(v) for v in r.stdout.split())
            assert inside_uid == 0, r
            uids, gids = _host_ids_of(daemon_id, sb.id, inside_pid)
            assert uids == [first] * 4 and gids == [first] * 4, (uids, gids, first)
            written = daemon.state_dir / "sandboxes" / sb.id / "workspace" / "by-root"
            assert (written.stat().st_uid, written.stat().st_gid) == (first, first)
