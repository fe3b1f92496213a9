"""Shell turns never lose, reorder or fake a byte: one test per way they used to. What kills a
timed-out turn and what a shell's errors show run on every backend case; the load tests on one
local and one engine case, the framing variants on one (tests/README.md)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from corral.v1 import shell_pb2 as pb
from tests.conftest import Session


@pytest.fixture
def sh(shells, sandbox) -> Session:
    return Session(shells, sandbox.id)


def burners(client, count: int = 2) -> list:
    """Sandboxes that keep the CPU busy (a 2-core machine: two of them load it fully)."""
    sandboxes = [client.create_sandbox() for _ in range(count)]
    pool = concurrent.futures.ThreadPoolExecutor(count)
    futures = [pool.submit(sb.exec, "while :; do :; done", timeout=600) for sb in sandboxes]
    return [(sb, future, pool) for sb, future in zip(sandboxes, futures)]


def stop(burning: list) -> None:
    for sb, _future, pool in burning:
        sb.destroy()
        pool.shutdown(wait=False)


@contextlib.contextmanager
def under_load(client) -> Iterator[None]:
    """The block runs while burners load the CPU."""
    burning = burners(client)
    try:
        yield
    finally:
        stop(burning)


@pytest.mark.load
def test_stderr_is_never_lost_or_reordered_under_load(sh, client):
    with under_load(client):
        for i in range(150):
            r = sh.run(f"echo a{i}; echo b{i} >&2; echo c{i}; printf 'd{i}' >&2")
            assert r.output == f"a{i}\nb{i}\nc{i}\nd{i}".encode() and r.exit_code == 0, (i, r.output)


@pytest.mark.load
def test_what_a_background_job_writes_across_a_turns_end_is_all_in_the_next_turn_under_load(sh, client):
    # The job is still writing when the shell prints the turn's marker: what follows the marker in
    # the same read, or is read before the turn is put away, goes to the next turn (it used to be
    # dropped); what comes before it stays in this one. Nothing the job wrote is lost or doubled.
    with under_load(client):
        for i in range(25):
            ended = sh.run(f"{{ for k in {{1..3000}}; do echo b{i}-$k; done >&2; }} & sleep 0.02")
            rest = sh.run("wait")
            want = "".join(f"b{i}-{k}\n" for k in range(1, 3001)).encode()
            got = ended.output + rest.output
            assert got == want, (i, len(ended.output), len(rest.output), len(want))


@pytest.mark.load
def test_a_shell_that_exits_keeps_every_byte_it_wrote_before_under_load(sh, client):
    # The exit is seen (pidfd) while the end of the output still sits in the terminal, not yet
    # handed to the daemon's reader: it is read before the shell is restarted (it used to be lost
    # with the old terminal).
    with under_load(client):
        for i in range(12):
            # One write of the shell's own right before it exits: as much as possible left unread.
            r = sh.run(f"out=$(head -c 600000 /dev/zero | tr '\\0' x); echo \"$out\"; echo last{i} >&2; exit 3")
            want = b"x" * 600000 + f"\nlast{i}\n".encode()
            assert r.shell_restarted and r.exit_code == 3, (i, r.exit_code)
            assert r.output == want, (i, len(r.output), r.output[-60:])


@pytest.mark.above_backend
def test_terminal_modes_a_command_changes_do_not_break_the_next_turns(sh):
    sh.run("cd /tmp; export KEPT=yes")
    for change in ("stty sane", "stty onlcr", "stty echo", "stty raw -echo", "stty -icanon"):
        r = sh.run(f"{change}; echo changed", timeout=10)
        assert not r.timed_out and not r.shell_restarted and b"changed" in r.output, (change, r)
        after = sh.run("echo next; pwd; echo $KEPT", timeout=10)
        # The modes are back before each turn: raw output, no echo of anything, state kept.
        assert after.output == b"next\n/tmp\nyes\n" and not after.shell_restarted, (change, after)


@pytest.mark.above_backend
def test_a_forged_marker_ends_nothing(sh):
    forged = sh.run(
        "printf \"trap -- '__CORRAL_%s_0_' RTMAX-3\\n\" 0123456789abcdef; "
        "printf '\\n__CORRAL_%s_0__\\n' 0123456789abcdef; echo after-forgery; exit_with() { return $1; }; exit_with 7"
    )
    assert b"after-forgery" in forged.output and forged.exit_code == 7
    assert forged.output.startswith(b"trap -- '__CORRAL_0123456789abcdef_0_' RTMAX-3\n")


@pytest.mark.above_backend
def test_functions_and_aliases_cannot_take_the_framing_over(sh):
    # Every builtin the framing could call, as a function that counts its calls (and calls nothing
    # itself), and aliases for some of them.
    names = ("builtin", "printf", "trap", "eval", "set", "return", "command", "hash", "type", "cd", "source")
    sh.run(
        "; ".join(f"{name}() {{ hijacked=$((hijacked + 1)); }}" for name in names)
        + "; shopt -s expand_aliases; alias trap='hijacked=99' set='hijacked=99'"
    )
    for code in (0, 3, 130):
        r = sh.run(f"(exit {code})")
        assert r.exit_code == code and r.output == b"" and not r.shell_restarted, r
    r = sh.run("sleep 300", timeout=1)
    assert r.timed_out and r.exit_code == 130 and not r.shell_restarted
    assert sh.run("echo ${hijacked:-0}").output == b"0\n"  # none of them ever ran
    assert sh.run("printf x; echo ${hijacked:-0}").output == b"1\n"  # the user's own functions work


def test_a_timed_out_turn_leaves_nothing_it_started_but_its_background_jobs(sh, sandbox):
    sh.run("sleep 301 &")  # an earlier turn's job: untouched
    r = sh.run("sleep 302 & bash -c 'sleep 303 & sleep 304 & sleep 305'", timeout=2)
    assert r.timed_out and not r.shell_restarted
    running = sandbox.exec("ps -eo args", timeout=10).stdout
    assert b"sleep 301" in running and b"sleep 302" in running  # top-level background jobs stay
    assert b"sleep 303" not in running and b"sleep 304" not in running and b"sleep 305" not in running


@pytest.mark.above_backend
def test_pagers_print_and_full_screen_programs_time_out_cleanly(sh):
    if sh.run("command -v less more").output.count(b"\n") == 0:
        pytest.skip("neither less nor more in this image")
    r = sh.run("seq 1 5000 | (command -v less >/dev/null && less || more) | tail -n 2; seq 3 > f.txt", timeout=20)
    assert r.output == b"4999\n5000\n" and not r.timed_out
    for pager in ("less", "more"):
        if sh.run(f"command -v {pager}").output:
            assert sh.run(f"{pager} f.txt", timeout=20).output == b"1\n2\n3\n"
    r = sh.run("stty raw -echo; cat", timeout=1)  # what a full-screen program leaves behind
    assert r.timed_out and not r.shell_restarted
    assert sh.run("echo fine").output == b"fine\n"


@pytest.mark.parametrize("program", ["sh", "/bin/sh", "bash", "/bin/bash"])
@pytest.mark.above_backend
def test_sh_and_bash_sessions_start_and_keep_state(shells, sandbox, program):
    name = program.strip("/").replace("/", "-")
    shells.OpenShell(pb.OpenShellRequest(sandbox_id=sandbox.id, name=name, program=program), timeout=30)
    session = Session.__new__(Session)
    session.stub, session.sandbox_id, session.name = shells, sandbox.id, name
    session.run("cd /tmp; X=kept")
    r = session.run("echo $X; pwd; echo err >&2; (exit 4)")
    assert r.output == b"kept\n/tmp\nerr\n" and r.exit_code == 4
    r = session.run("sleep 300", timeout=1)
    assert r.timed_out and not r.shell_restarted
    assert session.run("echo $X").output == b"kept\n"


@pytest.mark.above_backend
def test_a_program_that_is_not_a_shell_is_refused_with_the_list(shells, sandbox):
    with pytest.raises(grpc.RpcError) as err:
        shells.OpenShell(pb.OpenShellRequest(sandbox_id=sandbox.id, name="py", program="python3"), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "bash, sh, dash" in err.value.details()


def test_errors_read_as_bash_and_no_host_path_is_visible(sh, sandbox, daemon, client):
    assert sh.run("no_such_command_xyz").output == b"bash: line 1: no_such_command_xyz: command not found\n"
    assert sh.run("true\nno_such_command_xyz").output == b"bash: line 2: no_such_command_xyz: command not found\n"
    r = sh.run("f() { no_such_command_xyz; }")
    assert sh.run("f").output == b"bash: line 1: no_such_command_xyz: command not found\n" and r.exit_code == 0
    listing = sandbox.exec("cat /proc/[0-9]*/cmdline | tr '\\0' ' '", timeout=10).stdout
    daemon_id = client.node_info().daemon_id
    # Neither the daemon's state directory nor its run directory on the host (/run/corral-<id>/).
    assert str(daemon.state_dir).encode() not in listing and f"corral-{daemon_id}/".encode() not in listing


def test_options_and_traps_that_echo_what_bash_runs_show_the_users_commands_only(sh):
    """What a terminal would show for `set -v`, `set -x` with any PS4, a DEBUG trap, extdebug and
    history: the user's commands, never the session's own line, variables or paths."""

    def turn(command: str, timeout: float = 20) -> bytes:
        r = sh.run(command, timeout=timeout)
        assert not r.timed_out and not r.shell_restarted and r.exit_code == 0, r
        assert b"__corral" not in r.output and b".cmd" not in r.output, r.output
        return r.output

    assert turn("shopt -q extdebug || echo off") == b"off\n"  # as in a new bash
    assert turn("set -v") == b""
    assert turn("echo one\necho two") == b"echo one\none\necho two\ntwo\n"
    assert turn("set +v") == b"set +v\n"
    assert turn("PS4='+${BASH_SOURCE}:${LINENO}: '; set -x") == b""
    # PS4's first character twice: sourcing the command is one level of indirection (docs/shells.md).
    assert turn("echo hi") == b"++bash:1: echo hi\nhi\n"
    assert turn("set -v +x") == b"++bash:1: set -v +x\n"  # traced, and read before verbose was on
    assert turn("set +v; set -x") == b"set +v; set -x\n"
    assert turn("set +x") == b"++bash:1: set +x\n"
    # A DEBUG trap runs for the commands of its own turn; later turns' commands are a sourced file's,
    # which a DEBUG trap does not reach without functrace (docs/shells.md), and it never sees ours.
    assert turn("trap 'echo \"debug: $BASH_COMMAND\"' DEBUG; echo hi") == b"debug: echo hi\nhi\n"
    assert turn("echo hi") == b"hi\n"
    assert turn("trap - DEBUG") == b""
    assert turn("shopt -s extdebug; f() { :; }; declare -F f; shopt -u extdebug") == b"f 1 bash\n"
    # History on, with `!` expansion: the session's lines are neither kept nor expanded.
    assert turn("set -o history -H") == b""
    assert turn("echo 'a!x'; history | grep -c corral || true", timeout=10) == b"a!x\n0\n"
    assert turn("set +o history +H") == b""


@pytest.mark.above_backend
def test_each_turn_starts_with_the_terminal_as_its_streams(sh):
    """`exec >file 2>&1` sends the rest of its turn's output to the file; the next turn writes to
    the terminal again (docs/shells.md), and the turn's end is never lost to the file."""
    r = sh.run("exec >/tmp/exec-out 2>&1; echo to-the-file; echo err >&2", timeout=10)
    assert r.output == b"" and r.exit_code == 0 and not r.timed_out and not r.shell_restarted
    r = sh.run("echo back; cat /tmp/exec-out", timeout=10)
    assert r.output == b"back\nto-the-file\nerr\n" and not r.shell_restarted


@pytest.mark.load
def test_stderr_apart_is_complete_in_order_and_relabelled_under_load(sh, client):
    with under_load(client):
        for i in range(60):
            r = sh.run(
                f"echo a{i}; echo b{i} >&2; echo c{i}; printf 'd{i}' >&2; no_such_command_{i}",
                separate_stderr=True,
            )
            assert r.output == f"a{i}\nc{i}\n".encode(), (i, r)
            expected = f"b{i}\nd{i}bash: line 1: no_such_command_{i}: command not found\n".encode()
            assert r.HasField("stderr") and r.stderr == expected and r.stderr_total_bytes == len(expected), (i, r)
            assert r.exit_code == 127
    # Without the option, stderr is the terminal again.
    r = sh.run("echo out; echo err >&2")
    assert r.output == b"out\nerr\n" and not r.HasField("stderr")


@pytest.mark.above_backend
def test_stderr_apart_floods_are_capped_and_timeouts_keep_it(sh):
    flood = sh.run(
        "head -c 3000000 /dev/zero | tr '\\0' e >&2; echo done", separate_stderr=True, output_limit_bytes=1 << 20
    )
    assert flood.output == b"done\n" and flood.stderr_total_bytes == 3_000_000 and flood.truncated
    assert len(flood.stderr) <= 1 << 20 and set(flood.stderr) == {ord("e")} and not flood.shell_restarted
    stopped = sh.run("echo started >&2; sleep 300", timeout=1, separate_stderr=True)
    assert stopped.timed_out and stopped.stderr == b"started\n" and not stopped.shell_restarted


@pytest.mark.above_backend
def test_stderr_of_a_background_job_after_its_turn_reaches_the_next_turn(sh):
    sh.run("(sleep 0.5; echo late >&2) &", separate_stderr=True)
    assert sh.run("sleep 2").output == b""  # the job writes meanwhile, to the fifo: kept for later
    assert sh.run("echo now").output == b"late\nnow\n"
    sh.run("(sleep 0.5; echo later >&2) &", separate_stderr=True)
    sh.run("sleep 2")
    assert sh.run("echo now", separate_stderr=True).stderr == b"later\n"


@pytest.mark.above_backend
def test_invalid_open_shell_requests_are_invalid_argument_and_leak_nothing(shells, sandbox, daemon):
    def daemon_ptys() -> int:
        fds = Path(f"/proc/{daemon.proc.pid}/fd")
        return sum(1 for fd in fds.iterdir() if _link(fd) in ("/dev/ptmx", "/dev/pts/ptmx"))

    before = daemon_ptys()
    invalid = [
        {"env": {"A": "1\0"}},
        {"env": {"A\0": "1"}},
        {"env": {"A=B": "1"}},
        {"cwd": "/tmp\0"},
        {"cwd": "relative/dir"},
        {"program": "bash\0"},
        {"program": "python3"},
        {"name": "a/b"},
        {"name": "a\0"},
        {"size": pb.TerminalSize(rows=0, cols=80)},
        {"size": pb.TerminalSize(rows=24, cols=100_000)},
    ]
    for _ in range(5):
        for fields in invalid:
            request = pb.OpenShellRequest(sandbox_id=sandbox.id, **{"name": "bad", **fields})
            with pytest.raises(grpc.RpcError) as err:
                shells.OpenShell(request, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, fields
    assert daemon_ptys() == before
    assert [s.name for s in shells.ListShells(pb.ListShellsRequest(sandbox_id=sandbox.id)).shells] == []


def _link(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""
