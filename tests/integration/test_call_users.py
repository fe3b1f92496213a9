"""A call's `user` on every backend: commands, shells and kernels run as the user they name, beside
the sandbox's default (root in the test images), each with what it needs in the run directory
(shell files it can read, a kernel directory of its own)."""

from __future__ import annotations

import pytest

from corral.sdk import errors

pytestmark = pytest.mark.usefixtures("kernel_python")


def test_commands_shells_and_kernels_run_as_the_user_a_call_names(sandbox):
    assert sandbox.exec("id -un", timeout=30).stdout == b"root\n"
    assert sandbox.exec("id -un", user="nobody", timeout=30).stdout == b"nobody\n"
    with sandbox.shell(user="nobody") as shell:
        assert shell.run("id -un", timeout=30).output == b"nobody\n"
    with sandbox.shell() as shell:
        assert shell.run("id -un", timeout=30).output == b"root\n"
    kernel = sandbox.kernel(user="nobody")
    assert kernel.execute("import os; os.getuid(), os.getgid()").result == {"text/plain": b"(65534, 65534)"}
    root_kernel = sandbox.kernel()
    assert root_kernel.execute("import os; os.getuid()").result == {"text/plain": b"0"}
    # Each kernel's connection file (its HMAC key) and sockets are its own user's alone.
    peek = sandbox.exec("cat /run/corral/*/k.json", user="nobody", timeout=30)
    assert peek.exit_code != 0 and b'"key"' not in peek.stdout


def test_an_unknown_user_is_refused_on_every_call(sandbox):
    with pytest.raises(errors.FailedPrecondition):
        sandbox.exec("true", user="no-such-user", timeout=30)
    with pytest.raises(errors.FailedPrecondition):
        sandbox.kernel(user="no-such-user")


def test_home_is_the_home_of_the_user_a_call_runs_as(sandbox):
    """As `docker exec` sets it: the user's home from the image's passwd (a SWE image's
    /root/.bashrc is then ~/.bashrc), the workdir for a uid the image does not name."""
    workdir = sandbox.exec("pwd", timeout=30).stdout
    assert sandbox.exec("echo $HOME", timeout=30).stdout == b"/root\n"
    assert sandbox.exec("echo $HOME", user="nobody", timeout=30).stdout == b"/nonexistent\n"
    assert sandbox.exec("echo $HOME", user="4242", timeout=30).stdout == workdir
    with sandbox.shell() as shell:
        assert shell.run("cd && pwd", timeout=30).output == b"/root\n"
    kernel = sandbox.kernel()
    assert kernel.execute("import os; os.environ['HOME']").result == {"text/plain": b"'/root'"}
