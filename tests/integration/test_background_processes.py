"""Background processes and terminals through the blocking SDK (`Sandbox.start_process`,
`Process`, `Sandbox.terminal`, `Terminal`) against a real daemon: an interactive shell on a
terminal and processes ending with their sandbox on every backend case; an interactive REPL driven
by expect, an interrupted sleep, a server used while it runs, output past the ring buffer and
waits with a timeout, the daemon's logic above the backend, on one (tests/README.md; the unit tier
runs them on the fake backend too)."""

from __future__ import annotations

import os
import re
import time

import pytest

from corral.sdk import ExpectFailed, FailedPrecondition

pytestmark = pytest.mark.local


@pytest.mark.above_backend
def test_python_repl_expect_and_input(sandbox):
    with sandbox.start_process(["python3", "-i", "-q"]) as repl:
        repl.expect(">>> ", timeout=20)
        repl.write("import sys; print(sys.version_info[0] * 14)\n")
        assert repl.expect(re.compile(r"(\d+)\n>>> "), timeout=20).group(1) == "42"
        repl.write("exit(5)\n")
        assert repl.wait(20).exit_code == 5
        with pytest.raises(FailedPrecondition):
            repl.write("1\n")


def test_interactive_bash_terminal(sandbox):
    with sandbox.terminal(["bash", "--norc", "--noprofile"], env={"PS1": "prompt$ "}) as terminal:
        terminal.expect("prompt$ ", timeout=20)
        terminal.send_keys("cd /tmp && echo in $PWD\r")
        terminal.expect("in /tmp\r\nprompt$ ", timeout=20)
        # The program says when it runs in the foreground with its SIGINT handler set: a ^C typed
        # sooner can fall between bash's fork and exec, where it is lost (as on any terminal).
        terminal.send_keys("python3 -c \"print('started'); import time; time.sleep(60)\"\r")
        terminal.expect("started\r\n", timeout=20)
        started = time.monotonic()
        terminal.send_keys("\x03")
        terminal.expect("prompt$ ", timeout=20)
        assert time.monotonic() - started < 15
        assert terminal.screen().splitlines()[-1] == "prompt$"
        terminal.send_keys("exit\r")
        assert not terminal.wait(20).running


@pytest.mark.above_backend
def test_interrupt_and_wait_with_a_timeout(sandbox):
    sleeper = sandbox.start_process("sleep 60")
    started = time.monotonic()
    assert sleeper.wait(0.5).running and time.monotonic() - started >= 0.4
    assert sleeper.poll().running
    sleeper.interrupt()
    ended = sleeper.wait(20)
    assert not ended.running and ended.exit_code == 130


@pytest.mark.above_backend
def test_a_server_answers_while_other_calls_happen(sandbox):
    server = sandbox.start_process(["python3", "-u", "-m", "http.server", "0", "--bind", "127.0.0.1"], cwd="/")
    port = server.expect(re.compile(r"port (\d+)"), timeout=30).group(1)
    fetch = f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{port}/').status)"
    for _ in range(3):
        assert sandbox.exec(["python3", "-c", fetch], timeout=30).stdout == b"200\n"
    assert sandbox.shell().run("echo turn", timeout=30).output == b"turn\n"
    server.expect('"GET / HTTP/1.1" 200', timeout=20)
    assert server.poll().running
    assert [p.id for p in sandbox.list_processes()] == [server.id]
    server.close()
    assert sandbox.list_processes() == []


@pytest.mark.above_backend
def test_output_past_the_ring_buffer_is_counted_as_dropped(sandbox):
    process = sandbox.start_process("seq 1 20000; echo END", buffer_size=4096)
    assert not process.wait(20).running
    output = process.read()
    assert output.dropped_bytes > 0 and output.dropped_bytes + len(output.data) == output.process.output_end
    assert len(output.data) == 4096 and output.data.endswith(b"\n20000\nEND\n")
    with pytest.raises(ExpectFailed) as failed:
        process.expect("1\n2\n3\n", timeout=1)
    assert failed.value.ended


def test_processes_end_with_their_sandbox(client):
    sandbox = client.create_sandbox()
    process = sandbox.start_process(["sleep", "300"])
    pid = process.info.pid
    assert os.path.exists(f"/proc/{pid}")
    sandbox.destroy()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{pid}")
