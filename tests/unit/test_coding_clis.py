"""The coding-CLI registry: a task made a harness task run by a CLI inside its sandbox."""

from __future__ import annotations

import pytest

from corral.rollout import coding_clis
from corral.rollout.coding_clis import CodingCli, HarnessParts, coding_cli, with_coding_cli
from corral.v1 import rollout_pb2 as pb


def test_unknown_clis_are_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="unknown coding CLI 'vim'"):
        coding_cli("vim")


def test_a_task_becomes_a_sandbox_harness_task_with_the_cli_s_files(monkeypatch):
    cli = CodingCli(
        name="echo-cli",
        package="echo-cli",
        version="1.0.0",
        binary="echo-cli",
        api="chat",
        vocabulary="none",
        parts=lambda prefix: HarnessParts(
            [f"{prefix}/node_modules/.bin/echo-cli", "-p"], {"NO_UPDATES": "1"}, {"/root/.echo/config": b"x=1"}
        ),
    )
    monkeypatch.setattr(coding_clis, "coding_cli", lambda name: cli)
    task = pb.Task(task_id="t")
    task.setup.files.add(path="main.py", content=b"print()")
    harnessed = coding_clis.with_coding_cli(task, "echo-cli", "/opt/clis")
    assert list(harnessed.harness.command) == ["/opt/clis/node_modules/.bin/echo-cli", "-p"]
    assert dict(harnessed.harness.env) == {"NO_UPDATES": "1"}
    assert harnessed.harness.place == pb.HARNESS_PLACE_SANDBOX
    assert [f.path for f in harnessed.setup.files] == ["main.py", "/root/.echo/config"]
    assert not task.HasField("harness") and len(task.setup.files) == 1  # the task itself is left alone
    assert cli.npm_spec == "echo-cli@1.0.0" and cli.binary_path("/opt/clis/") == "/opt/clis/node_modules/.bin/echo-cli"
    assert with_coding_cli is coding_clis.with_coding_cli
