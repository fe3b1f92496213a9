"""Installing the coding CLIs with the real npm (rollout/coding_clis/install.py).

- Against a local registry standing in for npmjs.org (this machine may not reach it; the packages
  are made here with `npm pack`): two packages with an install script each, one of them named in
  the CLI's `install_scripts`. npm installs both at their pinned versions, only the named script
  runs, and a second run calls npm not at all.
- The registered CLIs where `make test` installed them (CORRAL_CODING_CLIS): installing them
  again is a run that does nothing and says so.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from aiohttp import web

from corral.rollout.coding_clis import CodingCli, HarnessParts, coding_cli, names
from corral.rollout.coding_clis.install import RECORD, install
from tests.conftest import CODING_CLIS_PREFIX, require_coding_cli

if shutil.which("npm") is None or shutil.which("node") is None:
    pytest.skip("node and npm are not installed (apt-get install nodejs npm)", allow_module_level=True)

# Each package's install script leaves a file in its directory when it runs.
SCRIPT = "node -e \"require('fs').writeFileSync('install-script-ran', '')\""


def pack(root: Path, name: str, version: str) -> Path:
    source = root / "src" / name
    source.mkdir(parents=True)
    manifest = {"name": name, "version": version, "bin": {name: "cli.js"}, "scripts": {"postinstall": SCRIPT}}
    (source / "package.json").write_text(json.dumps(manifest))
    (source / "cli.js").write_text(f"#!/usr/bin/env node\nconsole.log('{name} {version}')\n")
    out = subprocess.run(
        ["npm", "pack", "--silent", "--pack-destination", str(root)],
        cwd=source,
        capture_output=True,
        text=True,
        check=True,
    )
    return root / out.stdout.strip().splitlines()[-1]


async def serve_registry(tarballs: dict[str, Path]) -> tuple[web.AppRunner, str]:
    """npm's registry protocol, as much of it as `npm install name@version` uses: a packument per
    package and its tarball."""
    runner: web.AppRunner

    async def packument(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in tarballs:
            return web.json_response({"error": "not found"}, status=404)
        tarball = tarballs[name]
        manifest = json.loads(
            subprocess.run(
                ["tar", "-xOzf", str(tarball), "package/package.json"], capture_output=True, check=True
            ).stdout
        )
        digest = hashlib.sha1(tarball.read_bytes()).hexdigest()
        manifest["dist"] = {"tarball": f"{base}/-/{tarball.name}", "shasum": digest}
        version = manifest["version"]
        return web.json_response({"name": name, "dist-tags": {"latest": version}, "versions": {version: manifest}})

    async def tarball(request: web.Request) -> web.FileResponse:
        return web.FileResponse(next(t for t in tarballs.values() if t.name == request.match_info["file"]))

    app = web.Application()
    app.router.add_get("/-/{file}", tarball)
    app.router.add_get("/{name}", packument)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    return runner, base


def cli(name: str, *scripts: str) -> CodingCli:
    return CodingCli(name, name, "1.0.0", name, "chat", name, lambda prefix: HarnessParts([]), install_scripts=scripts)


async def test_real_npm_installs_the_pins_runs_only_the_named_script_and_then_nothing(tmp_path, monkeypatch):
    tarballs = {name: pack(tmp_path, name, "1.0.0") for name in ("corral-test-plain", "corral-test-native")}
    runner, registry = await serve_registry(tarballs)
    monkeypatch.setenv("npm_config_registry", registry + "/")
    monkeypatch.setenv("npm_config_cache", str(tmp_path / "npm-cache"))
    prefix = tmp_path / "clis"
    clis = [cli("corral-test-plain"), cli("corral-test-native", "corral-test-native")]
    messages: list[str] = []
    try:
        # npm talks to the registry on this event loop: install runs in a thread.
        first = await asyncio.to_thread(install, str(prefix), clis, log=messages.append)
        second = await asyncio.to_thread(install, str(prefix), clis, log=messages.append)
    finally:
        await runner.cleanup()
    assert [c.name for c in first.install] == ["corral-test-plain", "corral-test-native"]
    assert (prefix / "node_modules/corral-test-native/install-script-ran").exists()
    assert not (prefix / "node_modules/corral-test-plain/install-script-ran").exists()
    assert json.loads((prefix / "package.json").read_text())["dependencies"] == {
        "corral-test-plain": "1.0.0",
        "corral-test-native": "1.0.0",
    }
    assert json.loads((prefix / RECORD).read_text()) == {"corral-test-native": "1.0.0"}
    out = subprocess.run([str(prefix / "node_modules/.bin/corral-test-native")], capture_output=True, text=True)
    assert out.stdout == "corral-test-native 1.0.0\n"
    assert second.nothing and messages[-1].startswith(f"coding CLIs up to date in {prefix}")


def test_installing_the_registered_clis_again_does_nothing_and_says_so():
    for name in names():
        require_coding_cli(name)
    tree = Path(CODING_CLIS_PREFIX) / "node_modules" / ".package-lock.json"
    before = tree.stat().st_mtime_ns if tree.exists() else None
    # The first run may still have install scripts to run (a prefix installed by hand); the second
    # must have nothing to do.
    command = [sys.executable, "-m", "corral.rollout.coding_clis", "install", "--prefix", CODING_CLIS_PREFIX]
    subprocess.run(command, capture_output=True, text=True, check=True)
    before = tree.stat().st_mtime_ns if tree.exists() else None
    again = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PATH": "/nonexistent"})
    assert again.returncode == 0, again.stderr  # npm is not even on its PATH: it was not needed
    versions = ", ".join(f"{n} {coding_cli(n).version}" for n in names())
    assert again.stdout == f"coding CLIs up to date in {CODING_CLIS_PREFIX}: {versions}\n"
    assert (tree.stat().st_mtime_ns if tree.exists() else None) == before
