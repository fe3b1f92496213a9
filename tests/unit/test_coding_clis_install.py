"""Installing the coding CLIs (rollout/coding_clis/install.py) against a stand-in for npm: a small
program that does to the prefix what `npm install` and `npm rebuild` do to it (a package.json and
a bin per package; a marker for a script that ran) and logs its argv. The real npm needs the
registry and Node.js, which the unit tier has not; tests/integration/test_coding_clis_install.py
runs the real one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from corral.rollout.coding_clis import CodingCli, HarnessParts
from corral.rollout.coding_clis import __main__ as cli_main
from corral.rollout.coding_clis.install import RECORD, InstallError, default_prefix, install, plan

# The stand-in: `npm install --prefix P ... name@version ...` writes P/node_modules/NAME/package.json
# and P/node_modules/.bin/BIN (BIN: the name's last part); `npm rebuild --prefix P NAME ...` writes
# P/node_modules/NAME/script-ran. NPM_FAIL=1 makes it fail as npm does; NPM_VERSION_OVERRIDE
# installs that version instead of the one asked for.
STAND_IN_NPM = """\
import json, os, sys
from pathlib import Path
argv = sys.argv[1:]
with open(os.environ["NPM_LOG"], "a") as log:
    log.write(json.dumps(argv) + "\\n")
if os.environ.get("NPM_FAIL"):
    print("npm error code E404", file=sys.stderr)
    sys.exit(1)
command, prefix = argv[0], Path(argv[argv.index("--prefix") + 1])
names = [a for a in argv[1:] if not a.startswith("--") and a != str(prefix)]
for spec in names:
    if command == "install":
        name, _, version = spec.rpartition("@")
        package = prefix / "node_modules" / name
        package.mkdir(parents=True, exist_ok=True)
        version = os.environ.get("NPM_VERSION_OVERRIDE", version)
        (package / "package.json").write_text(json.dumps({"name": name, "version": version}))
        (prefix / "node_modules" / ".bin").mkdir(exist_ok=True)
        binary = prefix / "node_modules" / ".bin" / name.rsplit("/", 1)[-1]
        binary.write_text("#!/bin/sh\\n")
        binary.chmod(0o755)
    elif command == "rebuild":
        (prefix / "node_modules" / spec / "script-ran").write_text("")
"""


def cli(name: str, package: str, version: str, *scripts: str) -> CodingCli:
    return CodingCli(
        name=name,
        package=package,
        version=version,
        binary=package.rsplit("/", 1)[-1],
        api="chat",
        vocabulary=name,
        parts=lambda prefix: HarnessParts([]),
        install_scripts=scripts,
    )


PLAIN = cli("plain", "@acme/plain-cli", "1.2.3")
NATIVE = cli("native", "@acme/native-cli", "2.0.0", "@acme/native-cli")


class StandIn:
    def __init__(self, root: Path) -> None:
        self.program = root / "npm.py"
        self.program.write_text(STAND_IN_NPM)
        self.log = root / "npm-log.jsonl"
        self.env = {"NPM_LOG": str(self.log)}

    def run(self, argv: list[str]) -> subprocess.CompletedProcess[str]:
        assert argv[0] == "/usr/bin/npm"
        env = {**os.environ, **self.env}
        return subprocess.run([sys.executable, str(self.program), *argv[1:]], capture_output=True, text=True, env=env)

    def calls(self) -> list[list[str]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]


@pytest.fixture
def npm(tmp_path) -> StandIn:
    return StandIn(tmp_path)


def found(tool: str) -> str:
    return f"/usr/bin/{tool}"


def run_install(prefix: Path, npm: StandIn, clis, messages: list[str] | None = None):
    return install(str(prefix), clis, run=npm.run, which=found, log=(messages if messages is not None else []).append)


def test_the_pinned_specs_install_with_scripts_held_back_and_only_the_named_scripts_run(tmp_path, npm):
    prefix = tmp_path / "clis"
    done = run_install(prefix, npm, [PLAIN, NATIVE])
    assert [c.name for c in done.install] == ["plain", "native"]
    install_argv, rebuild_argv = npm.calls()
    assert install_argv[:3] == ["install", "--prefix", str(prefix)]
    assert "--ignore-scripts" in install_argv and "--save-exact" in install_argv
    assert install_argv[-2:] == ["@acme/plain-cli@1.2.3", "@acme/native-cli@2.0.0"]
    assert rebuild_argv == ["rebuild", "--prefix", str(prefix), "@acme/native-cli"]
    assert (prefix / "node_modules/@acme/native-cli/script-ran").exists()
    assert not (prefix / "node_modules/@acme/plain-cli/script-ran").exists()
    assert json.loads((prefix / RECORD).read_text()) == {"@acme/native-cli": "2.0.0"}


def test_a_second_run_calls_npm_not_at_all_and_says_so(tmp_path, npm):
    prefix = tmp_path / "clis"
    run_install(prefix, npm, [PLAIN, NATIVE])
    calls = len(npm.calls())
    messages: list[str] = []
    assert run_install(prefix, npm, [PLAIN, NATIVE], messages).nothing
    assert len(npm.calls()) == calls
    assert messages == [f"coding CLIs up to date in {prefix}: plain 1.2.3, native 2.0.0"]


def test_a_new_pin_reinstalls_that_cli_alone_and_reruns_its_scripts(tmp_path, npm):
    prefix = tmp_path / "clis"
    run_install(prefix, npm, [PLAIN, NATIVE])
    first = len(npm.calls())
    newer = cli("native", "@acme/native-cli", "2.1.0", "@acme/native-cli")
    run_install(prefix, npm, [PLAIN, newer])
    install_argv, rebuild_argv = npm.calls()[first:]
    assert install_argv[-1] == "@acme/native-cli@2.1.0" and "@acme/plain-cli@1.2.3" not in install_argv
    assert rebuild_argv[-1] == "@acme/native-cli"
    assert json.loads((prefix / RECORD).read_text()) == {"@acme/native-cli": "2.1.0"}


def test_scripts_that_did_not_run_run_next_time_without_reinstalling(tmp_path, npm):
    prefix = tmp_path / "clis"
    run_install(prefix, npm, [PLAIN, NATIVE])
    (prefix / RECORD).unlink()  # as if its script had not run (npm rebuild failed, say)
    before = len(npm.calls())
    assert plan(str(prefix), [PLAIN, NATIVE]).install == ()
    run_install(prefix, npm, [PLAIN, NATIVE])
    assert npm.calls()[before:] == [["rebuild", "--prefix", str(prefix), "@acme/native-cli"]]


def test_missing_node_or_npm_names_the_debian_packages(tmp_path, npm):
    with pytest.raises(InstallError, match=r"node and npm not found on PATH.*apt-get install nodejs npm"):
        install(str(tmp_path / "clis"), [PLAIN], run=npm.run, which=lambda tool: None, log=print)
    with pytest.raises(InstallError, match=r"^npm not found"):
        install(str(tmp_path / "clis"), [PLAIN], run=npm.run, which=lambda t: found(t) if t == "node" else None)
    assert npm.calls() == []


def test_npm_failing_is_an_error_with_its_exit_status_and_output(tmp_path, npm):
    npm.env["NPM_FAIL"] = "1"
    with pytest.raises(
        InstallError, match=r"npm install of @acme/plain-cli@1.2.3 failed \(exit 1\):\nnpm error code E404"
    ):
        run_install(tmp_path / "clis", npm, [PLAIN])


def test_a_version_npm_did_not_install_is_an_error(tmp_path, npm):
    npm.env["NPM_VERSION_OVERRIDE"] = "1.2.4"
    with pytest.raises(InstallError, match=r"npm left @acme/plain-cli at 1.2.4 in .*, not 1.2.3"):
        run_install(tmp_path / "clis", npm, [PLAIN])


def test_a_prefix_that_cannot_be_made_is_an_error_naming_the_way_out(tmp_path, npm):
    (tmp_path / "file").write_text("")
    with pytest.raises(InstallError, match=r"cannot create .*: pass --prefix or set CORRAL_CODING_CLIS"):
        run_install(tmp_path / "file" / "clis", npm, [PLAIN])


def test_the_prefix_defaults_to_the_variable_then_opt():
    assert default_prefix({"CORRAL_CODING_CLIS": "/home/me/clis"}) == "/home/me/clis"
    assert default_prefix({}) == "/opt/corral-clis"


def test_the_command_installs_what_is_registered_and_fails_cleanly(tmp_path, npm, monkeypatch, capsys):
    import corral.rollout.coding_clis.install as installing

    monkeypatch.setattr(cli_main, "names", lambda: ["native", "plain"])
    monkeypatch.setattr(cli_main, "coding_cli", {"native": NATIVE, "plain": PLAIN}.__getitem__)
    prefix = tmp_path / "clis"
    monkeypatch.setattr(cli_main, "install", lambda p, clis: installing.install(p, clis, run=npm.run, which=found))
    assert cli_main.main(["install", "--prefix", str(prefix)]) == 0
    assert npm.calls()[0][-2:] == ["@acme/native-cli@2.0.0", "@acme/plain-cli@1.2.3"]
    npm.env["NPM_FAIL"] = "1"
    assert cli_main.main(["install", "--prefix", str(tmp_path / "other"), "plain"]) == 1
    assert "error: npm install of @acme/plain-cli@1.2.3 failed (exit 1)" in capsys.readouterr().err
