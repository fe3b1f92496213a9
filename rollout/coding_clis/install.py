"""Installing the coding CLIs from npm into one prefix, at their pinned versions, with only the
install scripts they need.

`install(prefix, clis)` runs `npm install --prefix PREFIX --save-exact --ignore-scripts` of the
pinned `npm_spec` of every CLI not installed there at its pinned version, then `npm rebuild` of
exactly the packages the CLIs name in `install_scripts` (Claude Code's postinstall copies its
native binary into place), so that no other dependency's install script runs. (npm 11's
`allowScripts` does not do this: an approval only records a review, and scripts nobody reviewed
still run unless denied.) The rebuilt packages are recorded in the prefix (RECORD, package ->
version), so that a script that failed is run again next time and one that ran is not.

A second run with everything at its pinned version and every script run calls npm not at all and
says so. Errors (no node or npm, npm failing, a version npm did not install) raise InstallError
with what to do.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from corral.rollout.coding_clis import CodingCli

# Where the CLIs go unless told otherwise: a directory the local backend's `host` sandboxes are
# shown read-only through local.host_paths (docs/coding-clis.md).
DEFAULT_PREFIX = "/opt/corral-clis"
# Names another prefix (an ordinary user's, a test run's); the tests find the CLIs through it too.
PREFIX_VARIABLE = "CORRAL_CODING_CLIS"
# In the prefix: the packages whose install scripts ran, and at which version.
RECORD = "corral-install-scripts.json"
DEBIAN_PACKAGES = "nodejs npm"
# How much of npm's output an error keeps.
ERROR_TAIL_CHARS = 2000


class InstallError(Exception):
    """The CLIs could not be installed; the message says why and what to do."""


def default_prefix(environ: Mapping[str, str] = os.environ) -> str:
    return environ.get(PREFIX_VARIABLE) or DEFAULT_PREFIX


@dataclass(frozen=True)
class Plan:
    """What a run has to do: the CLIs to (re)install, and the packages whose install scripts must
    run afterwards (package -> version)."""

    install: tuple[CodingCli, ...]
    scripts: dict[str, str]

    @property
    def nothing(self) -> bool:
        return not self.install and not self.scripts


def installed_version(prefix: str, package: str) -> str | None:
    """The version of `package` installed under `prefix` (its own package.json), None without one."""
    try:
        manifest = json.loads((Path(prefix) / "node_modules" / package / "package.json").read_text())
    except (OSError, ValueError):
        return None
    version = manifest.get("version") if isinstance(manifest, dict) else None
    return version if isinstance(version, str) else None


def scripts_run(prefix: str) -> dict[str, str]:
    """The record of install scripts run under `prefix` (empty without one, or an unreadable one)."""
    try:
        record = json.loads((Path(prefix) / RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in record.items()} if isinstance(record, dict) else {}


def plan(prefix: str, clis: Sequence[CodingCli]) -> Plan:
    stale = tuple(cli for cli in clis if installed_version(prefix, cli.package) != cli.version)
    ran = scripts_run(prefix)
    reinstalled = {cli.package for cli in stale}
    scripts = {}
    for cli in clis:
        for package in cli.install_scripts:
            # The package's version after this run: the CLI's own when it is the CLI's package.
            version = cli.version if package == cli.package else installed_version(prefix, package)
            if package in reinstalled or version is None or ran.get(package) != version:
                scripts[package] = version or ""
    return Plan(stale, scripts)


Runner = Callable[[list[str]], "subprocess.CompletedProcess[str]"]


def _run_npm(argv: list[str]) -> subprocess.CompletedProcess[str]:
    # Files others may read: the sandboxes see the prefix as a user of no standing on the host.
    return subprocess.run(argv, capture_output=True, text=True, umask=0o022)


def _npm(which: Callable[[str], str | None] = shutil.which) -> str:
    missing = [tool for tool in ("node", "npm") if which(tool) is None]
    if missing:
        raise InstallError(
            f"{' and '.join(missing)} not found on PATH: the coding CLIs are npm packages run by Node.js; "
            f"install Debian's packages ({'apt-get install ' + DEBIAN_PACKAGES})"
        )
    npm = which("npm")
    assert npm is not None
    return npm


def _check(done: subprocess.CompletedProcess[str], what: str) -> None:
    if done.returncode != 0:
        output = (done.stderr or "") + (done.stdout or "")
        raise InstallError(f"{what} failed (exit {done.returncode}):\n{output[-ERROR_TAIL_CHARS:].strip()}")


def install(
    prefix: str,
    clis: Sequence[CodingCli],
    *,
    run: Runner = _run_npm,
    which: Callable[[str], str | None] = shutil.which,
    log: Callable[[str], None] = print,
) -> Plan:
    """Brings `clis` to their pinned versions under `prefix`, their install scripts run; returns
    what it had to do (Plan.nothing: nothing, and npm was not called)."""
    todo = plan(prefix, clis)
    if todo.nothing:
        log(f"coding CLIs up to date in {prefix}: " + ", ".join(f"{c.name} {c.version}" for c in clis))
        return todo
    npm = _npm(which)
    try:
        os.makedirs(prefix, exist_ok=True)
    except OSError as error:
        raise InstallError(
            f"cannot create {prefix} ({error.strerror}): pass --prefix or set {PREFIX_VARIABLE} to a directory of yours"
        ) from None
    if todo.install:
        specs = [cli.npm_spec for cli in todo.install]
        log(f"npm install --prefix {prefix} {' '.join(specs)} (install scripts held back)")
        argv = [npm, "install", "--prefix", prefix, "--save-exact", "--ignore-scripts", "--no-audit", "--no-fund"]
        _check(run([*argv, *specs]), f"npm install of {' '.join(specs)}")
        for cli in todo.install:
            found = installed_version(prefix, cli.package)
            if found != cli.version:
                raise InstallError(f"npm left {cli.package} at {found or 'nothing'} in {prefix}, not {cli.version}")
    if todo.scripts:
        packages = sorted(todo.scripts)
        log(f"npm rebuild --prefix {prefix} {' '.join(packages)} (their install scripts only)")
        _check(run([npm, "rebuild", "--prefix", prefix, *packages]), f"npm rebuild of {' '.join(packages)}")
        record = {**scripts_run(prefix), **{p: installed_version(prefix, p) or "" for p in packages}}
        (Path(prefix) / RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    for cli in clis:
        if not os.access(cli.binary_path(prefix), os.X_OK):
            raise InstallError(f"{cli.npm_spec} is installed but {cli.binary_path(prefix)} is not an executable")
    log(f"coding CLIs installed in {prefix}: " + ", ".join(f"{c.name} {c.version}" for c in clis))
    return todo
