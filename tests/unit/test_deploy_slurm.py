"""deploy/slurm without Slurm: the scripts parse (and pass shellcheck where it is installed), and
the address file's format survives the round trip through its helper, corral_nodes.py, which
refuses what is not that format. tests/integration/test_deploy_slurm.py runs the scripts."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

SLURM = Path(__file__).resolve().parents[2] / "deploy" / "slurm"
SCRIPTS = [SLURM / "corral.sbatch", SLURM / "corral-node.sh"]


def corral_nodes() -> ModuleType:
    """deploy/slurm/corral_nodes.py, a script beside the batch script rather than a module of corral."""
    spec = importlib.util.spec_from_file_location("corral_nodes", SLURM / "corral_nodes.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_scripts_parse(script: Path) -> None:
    checked = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0, checked.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_the_scripts_pass_shellcheck() -> None:
    checked = subprocess.run(["shellcheck", *map(str, SCRIPTS)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout


def test_node_entries_round_trip_through_cluster_json(tmp_path: Path) -> None:
    nodes = corral_nodes()
    (tmp_path / "token").write_text("the-token\n")
    second = nodes.Node("n002", "[fd00::2]:7700", "/tmp/corral-7/corral.sock", "/tmp/corral-7/state")
    first = nodes.Node("n001", "n001.cluster:7700", "/tmp/corral-7/corral.sock", "/tmp/corral-7/state")
    for node in (second, first):
        nodes.add_node(tmp_path / "nodes", node)
    path = nodes.collect(tmp_path, "7")
    assert path == tmp_path / "cluster.json"
    cluster = nodes.load(path)
    assert cluster.nodes == [first, second] and cluster.job_id == "7"
    assert cluster.addresses == ["n001.cluster:7700", "[fd00::2]:7700"]
    assert cluster.token() == "the-token"
    assert json.loads(path.read_text())["version"] == 1
    shown = subprocess.run(
        [sys.executable, str(SLURM / "corral_nodes.py"), "addresses", str(path)], capture_output=True, text=True
    )
    assert shown.returncode == 0 and shown.stdout == "n001.cluster:7700\n[fd00::2]:7700\n"


def test_the_helper_refuses_what_is_not_a_cluster_file(tmp_path: Path) -> None:
    nodes = corral_nodes()
    with pytest.raises(ValueError, match="is not host:port"):
        nodes.add_node(tmp_path, nodes.Node("n1", "n1", "/s", "/d"))
    with pytest.raises(ValueError, match="absolute paths"):
        nodes.add_node(tmp_path, nodes.Node("n1", "n1:7700", "sock", "/d"))
    with pytest.raises(ValueError, match="no node entries"):
        nodes.collect(tmp_path, "1")
    path = tmp_path / "cluster.json"
    for text, why in (
        ("{", "not JSON"),
        ('{"version": 2}', "not a version 1"),
        ('{"version": 1, "job_id": "1", "token_file": "/t", "nodes": []}', "non-empty list"),
        ('{"version": 1, "job_id": "1", "token_file": "/t", "nodes": [{"node": "n1"}]}', "nodes\\[0\\]"),
    ):
        path.write_text(text)
        with pytest.raises(ValueError, match=why):
            nodes.load(path)
    shown = subprocess.run(
        [sys.executable, str(SLURM / "corral_nodes.py"), "addresses", str(path)], capture_output=True, text=True
    )
    assert shown.returncode == 1 and "nodes[0]" in shown.stderr
