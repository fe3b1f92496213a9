"""ShellService against a real daemon: sentinel robustness, state, interrupts, output handling.

These talk to the contract directly (generated stubs) so that every field of RunInShellResponse is
checked; tests/integration/test_sdk_shells.py covers the SDK on top.
"""

from __future__ import annotations

import concurrent.futures
import time

import grpc
import pytest

from corral.v1 import shell_pb2 as pb
from tests.conftest import Session


@pytest.fixture
def sh(shells, sandbox) -> Session:
    return Session(shells, sandbox.id)


def test_state_persists_across_turns(sh):
    sh.run('cd /tmp && export GREETING=hello && shout() { echo "$1!"; } && ANSWER=42')
    r = sh.run("pwd; echo $GREETING $ANSWER; shout hey")
    assert r.output == b"/tmp\nhello 42\nhey!\n" and r.exit_code == 0


@pytest.mark.above_backend
def test_exit_codes(sh):
    assert sh.run("false").exit_code == 1
    assert sh.run("(exit 7)").exit_code == 7
    assert sh.run("true").exit_code == 0


@pytest.mark.parametrize(
    "setup",
    [
        "PS1='custom> '; PS2='more> '",
        "PROMPT_COMMAND='echo prompt-command-ran'",
        "set -e",
        "set -u; set -o pipefail",
        "IFS=,",
        "alias printf='echo hijacked'",
        "trap 'echo bye' EXIT",
        "exec bash",
    ],
)
@pytest.mark.above_backend
def test_sentinel_survives(sh, setup):
    sh.run(setup)
    r = sh.run("echo ok; false")
    assert r.output == b"ok\n" and r.exit_code == 1 and not r.timed_out
    assert sh.run("echo again").output == b"again\n"


@pytest.mark.above_backend
def test_activated_environment_persists(sh):
    r = sh.run("python3 -m venv /tmp/venv && . /tmp/venv/bin/activate && command -v python", timeout=120)
    assert r.output == b"/tmp/venv/bin/python\n", r.output
    assert sh.run("command -v python; echo $VIRTUAL_ENV").output == b"/tmp/venv/bin/python\n/tmp/venv\n"
    assert sh.run("deactivate; command -v python || echo none").exit_code == 0


def test_multiline_heredoc_and_no_trailing_newline(sh):
    r = sh.run("cat > /tmp/f.txt <<'EOF'\nline $1\n  indented\nEOF\ncat /tmp/f.txt\nfor i in 1 2; do\n  echo $i\ndone")
    assert r.output == b"line $1\n  indented\n1\n2\n"
    assert sh.run("printf 'no newline'").output == b"no newline"
    assert sh.run("echo " + "x" * 20000).output == b"x" * 20000 + b"\n"  # far beyond a tty line


@pytest.mark.parametrize("reader", ["read x", "cat", "python3", "head -n 1"])
@pytest.mark.above_backend
def test_stdin_reader_times_out_without_swallowing_next_command(sh, reader):
    r = sh.run(reader, timeout=1)
    assert r.timed_out and r.timeout_reason == "timeout" and not r.shell_restarted
    nxt = sh.run("echo next-command")
    assert nxt.output == b"next-command\n" and nxt.exit_code == 0


def test_timeout_kills_foreground_tree_and_keeps_shell(sh):
    sh.run("cd /tmp; export KEPT=yes")
    r = sh.run("echo before; sleep 300 | sleep 301; echo never", timeout=1)
    assert r.timed_out and r.output.startswith(b"before\n") and b"never" not in r.output
    assert not r.shell_restarted
    after = sh.run("ps -eo args | grep -c '[s]leep 30'; pwd; echo $KEPT")
    assert after.output == b"0\n/tmp\nyes\n"


def test_sigint_ignoring_command_is_killed(sh):
    sh.run("cd /tmp; export KEPT=yes")
    r = sh.run("trap '' INT; sleep 300; echo never", timeout=1)
    # SIGINT and end-of-file do nothing to it; SIGKILL ends it, and the rest of the command does
    # not run. The end-of-file never reaches the shell (it reads commands from a pipe), so the
    # session goes on, with its state.
    assert r.timed_out and b"never" not in r.output and not r.shell_restarted
    assert sh.run("echo usable; pwd; echo $KEPT").output == b"usable\n/tmp\nyes\n"


def test_a_shell_that_is_slow_to_die_after_an_interrupt_does_not_eat_the_next_command(sh):
    for _ in range(3):
        assert sh.run("trap '' INT; sleep 300", timeout=0.5).timed_out
        follow = sh.run("echo next")
        assert follow.output == b"next\n" and not follow.shell_restarted


@pytest.mark.above_backend
def test_idle_timeout(sh):
    r = sh.run("echo start; sleep 60", timeout=30, idle_timeout_ms=500)
    assert r.timed_out and r.timeout_reason == "idle_timeout" and r.output == b"start\n"
    assert r.duration_ms < 10_000


def test_background_job_does_not_hold_the_turn(sh):
    start = time.monotonic()
    r = sh.run("sleep 100 & echo started")
    assert r.output == b"started\n" and time.monotonic() - start < 5
    r = sh.run("sleep 5", timeout=0.5)  # an interrupt spares background jobs
    assert sh.run("jobs -p | wc -l; ps -eo args | grep -c '[s]leep 100'").output.split()[-1] == b"1"


@pytest.mark.above_backend
def test_pagers_and_editors_disarmed(sh):
    r = sh.run(
        "echo $PAGER $GIT_PAGER; printf 'a\\nb\\n' | $PAGER; git --version >/dev/null && cd /tmp && git init -q p && cd p && git log 2>&1 | head -1"
    )
    assert r.output.startswith(b"cat cat\na\nb\n") and not r.timed_out


@pytest.mark.above_backend
def test_huge_output_keeps_head_and_tail(sh):
    r = sh.run("seq 1 6000000", timeout=60, output_limit_bytes=1 << 20)
    assert r.truncated and r.output_total_bytes > 45_000_000
    assert r.output.startswith(b"1\n2\n3\n") and r.output.endswith(b"5999999\n6000000\n")
    assert sh.run("echo fine").output == b"fine\n"


@pytest.mark.above_backend
def test_binary_output_and_split_multibyte_characters(sh):
    assert sh.run(r"printf '\377\000\200'").output == b"\xff\x00\x80"
    r = sh.run(r"printf '\344'; sleep 0.2; printf '\270\255'")  # 中 written in two pieces
    assert r.output == "中".encode()
    r = sh.run(r"for i in $(seq 1 400); do printf '中'; done", output_limit_bytes=101)
    assert r.truncated
    r.output.decode("utf-8")  # the cut between head and tail falls between characters


@pytest.mark.above_backend
def test_stderr_is_captured(sh):
    r = sh.run("echo out; echo err >&2; ls /no/such/path")
    assert b"out\n" in r.output and b"err\n" in r.output and b"No such file" in r.output


@pytest.mark.above_backend
def test_ansi_stripped_only_on_request(sh):
    r = sh.run(r"printf '\033[31mred\033[0m plain'", strip_ansi=True)
    assert r.output == b"\x1b[31mred\x1b[0m plain"
    assert r.output_plain == b"red plain"
    assert not sh.run("echo x").HasField("output_plain")


def test_shell_death_is_reported_and_recovered(sh):
    sh.run("export LOST=1")
    r = sh.run("exit 3")
    assert r.shell_restarted and r.exit_code == 3
    r = sh.run("echo alive ${LOST:-reset}")
    assert r.output == b"alive reset\n"
    r = sh.run("kill -9 $$")
    assert r.shell_restarted
    assert sh.run("echo again").output == b"again\n"


@pytest.mark.above_backend
def test_independent_named_sessions(shells, sandbox):
    a, b = Session(shells, sandbox.id, "a"), Session(shells, sandbox.id, "b")
    a.run("cd /tmp; export WHO=a")
    assert b.run("pwd; echo ${WHO:-none}").output == b"/workspace\nnone\n"
    names = {s.name for s in shells.ListShells(pb.ListShellsRequest(sandbox_id=sandbox.id)).shells}
    assert {"a", "b"} <= names


@pytest.mark.above_backend
def test_bad_input(shells, sandbox):
    with pytest.raises(grpc.RpcError) as err:
        shells.RunInShell(pb.RunInShellRequest(sandbox_id=sandbox.id, name="nope", command="true"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        shells.OpenShell(pb.OpenShellRequest(sandbox_id="sb-unknown"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    Session(shells, sandbox.id, "dup")
    with pytest.raises(grpc.RpcError) as err:
        shells.OpenShell(pb.OpenShellRequest(sandbox_id=sandbox.id, name="dup"))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS


def test_close_kills_what_the_shell_started(shells, sandbox):
    s = Session(shells, sandbox.id, "closing")
    s.run("sleep 1234 &")
    shells.CloseShell(pb.CloseShellRequest(sandbox_id=sandbox.id, name="closing"))
    assert b"sleep 1234" not in sandbox.exec("ps -eo args", timeout=10).stdout
    with pytest.raises(grpc.RpcError):
        s.run("true")


def test_attach_interactive_terminal(shells, sandbox):
    def requests():
        yield pb.AttachRequest(start=pb.AttachStart(sandbox_id=sandbox.id, size=pb.TerminalSize(rows=30, cols=100)))
        yield pb.AttachRequest(input=b"stty size; echo attached-$((6*7)); exit 5\n")

    output, exit_code = b"", None
    for message in shells.Attach(requests(), timeout=30):
        if message.WhichOneof("message") == "output":
            output += message.output
        else:
            exit_code = message.exited.exit_code
    assert b"30 100" in output and b"attached-42" in output and exit_code == 5


@pytest.mark.load
def test_50_sandboxes_20_turns_each(client, shells):
    # Created and destroyed ten at a time: one by one, an engine's container start and removal
    # (about 1.5 s each on a loaded 2-core machine) made this the suite's slowest test.
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        sandboxes = list(pool.map(lambda _: client.create_sandbox(), range(50)))
    try:

        def drive(i: int) -> bool:
            s = Session(shells, sandboxes[i].id)
            s.run(f"N={i}")
            return all(s.run(f"echo $((N * 1000 + {t}))").output == f"{i * 1000 + t}\n".encode() for t in range(20))

        with concurrent.futures.ThreadPoolExecutor(50) as pool:
            assert all(pool.map(drive, range(50)))
    finally:
        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            list(pool.map(lambda sb: sb.destroy(), sandboxes))


def test_planted_symlink_in_run_dir_is_never_followed(shells, sandbox, tmp_path):
    victim = tmp_path / "root-owned.txt"
    victim.write_text("untouched")
    tmp_path.chmod(0o755)
    for slot in range(1, 4):
        sandbox.exec(f"ln -sf {victim} /run/corral/sh{slot}.cmd", timeout=10).check()
    s = Session(shells, sandbox.id, "victim-test")
    assert s.run("echo ran").output == b"ran\n"
    assert victim.read_text() == "untouched"


@pytest.mark.above_backend
def test_close_during_a_turn_fails_that_turn_cleanly(shells, sandbox):
    s = Session(shells, sandbox.id, "closing-mid-turn")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(s.run, "sleep 30", 60)
        time.sleep(0.5)
        shells.CloseShell(pb.CloseShellRequest(sandbox_id=sandbox.id, name="closing-mid-turn"))
        with pytest.raises(grpc.RpcError) as err:
            running.result(timeout=30)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
