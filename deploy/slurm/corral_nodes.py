#!/usr/bin/env python3
"""The address file of a corral Slurm job (deploy/slurm/corral.sbatch): which daemon listens
where, for the clients of the job (and corral.cluster's ClusterClient) to read.

Each node's start writes its own entry, `<job dir>/nodes/<node>.json`, once its daemon answers
SERVING; when every node has one, the batch script joins them into `<job dir>/cluster.json`:

    {"version": 1, "job_id": "4242", "token_file": "/shared/corral-4242/token",
     "nodes": [{"node": "n001", "address": "n001:7700",
                "socket": "/tmp/corral-4242/corral.sock", "state_dir": "/tmp/corral-4242/state"}]}

`address` is host:port of the node's TCP listener, where every call carries the bearer token held
in `token_file` (`Authorization: Bearer <token>`; the SDK's `token=`). `socket` and `state_dir`
are the node's own paths (a client on that node may use the socket, without the token).

Python's standard library only, so that any python3 on the nodes runs it:
    corral_nodes.py add-node --dir DIR --node N --address HOST:PORT --socket PATH --state-dir PATH
    corral_nodes.py collect --dir JOB_DIR --job-id ID
    corral_nodes.py addresses FILE          (one address per line)
and from Python, `load(path)` gives a `Cluster` (`.addresses`, `.token()`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

VERSION = 1
# host:port, the host a name, an IPv4 address or a bracketed IPv6 one (the SDK's address forms).
ADDRESS = re.compile(r"(?:[A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.]+\]):[0-9]{1,5}")
NODE_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class Node:
    node: str  # the Slurm node name
    address: str  # host:port of its daemon's TCP listener
    socket: str  # its daemon's Unix socket, on that node
    state_dir: str  # its daemon's state directory, on that node


@dataclass(frozen=True)
class Cluster:
    job_id: str
    token_file: str
    nodes: list[Node]

    @property
    def addresses(self) -> list[str]:
        return [node.address for node in self.nodes]

    def token(self) -> str:
        """The bearer token every TCP call carries."""
        return Path(self.token_file).read_text().strip()


def _node(value: object, where: str) -> Node:
    fields = {"node", "address", "socket", "state_dir"}
    if not isinstance(value, dict) or set(value) != fields or not all(isinstance(v, str) for v in value.values()):
        raise ValueError(f"{where}: a node entry has exactly the strings {', '.join(sorted(fields))}")
    node = Node(**value)
    _check(node, where)
    return node


def _check(node: Node, where: str) -> None:
    if not NODE_NAME.fullmatch(node.node):
        raise ValueError(f"{where}: bad node name {node.node!r}")
    if not ADDRESS.fullmatch(node.address) or not 0 < int(node.address.rsplit(":", 1)[1]) < 65536:
        raise ValueError(f"{where}: address {node.address!r} is not host:port")
    if not (node.socket.startswith("/") and node.state_dir.startswith("/")):
        raise ValueError(f"{where}: socket and state_dir must be absolute paths")


def _write_json(path: Path, value: object) -> None:
    """Whole or not at all: readers on other nodes (a shared filesystem) never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(value, fh, indent=1)
            fh.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def add_node(nodes_dir: Path, node: Node) -> Path:
    """Writes one node's entry (`<node>.json`), replacing an earlier one of that node."""
    _check(node, "add-node")
    path = nodes_dir / f"{node.node}.json"
    _write_json(path, asdict(node))
    return path


def collect(job_dir: Path, job_id: str) -> Path:
    """Joins the node entries under `job_dir/nodes` into `job_dir/cluster.json`, sorted by node."""
    nodes_dir = job_dir / "nodes"
    nodes = [_node(json.loads(path.read_text()), str(path)) for path in sorted(nodes_dir.glob("*.json"))]
    if not nodes:
        raise ValueError(f"{nodes_dir}: no node entries")
    path = job_dir / "cluster.json"
    cluster = Cluster(job_id, str((job_dir / "token").absolute()), nodes)
    _write_json(path, {"version": VERSION, **asdict(cluster)})
    return path


def load(path: str | os.PathLike[str]) -> Cluster:
    """Reads a cluster.json; a file of another version or shape is a ValueError that says why."""
    try:
        value = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not JSON: {err}") from None
    if not isinstance(value, dict) or value.get("version") != VERSION:
        raise ValueError(f"{path}: not a version {VERSION} corral cluster file")
    job_id, token_file, nodes = value.get("job_id"), value.get("token_file"), value.get("nodes")
    if not isinstance(job_id, str) or not isinstance(token_file, str) or not isinstance(nodes, list) or not nodes:
        raise ValueError(f"{path}: needs job_id, token_file and a non-empty list of nodes")
    return Cluster(job_id, token_file, [_node(node, f"{path}: nodes[{i}]") for i, node in enumerate(nodes)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="corral_nodes.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    add = sub.add_parser("add-node", help="write this node's entry")
    add.add_argument("--dir", type=Path, required=True, help="the job's nodes/ directory")
    for name in ("node", "address", "socket", "state-dir"):
        add.add_argument(f"--{name}", required=True)
    join = sub.add_parser("collect", help="join the node entries into cluster.json")
    join.add_argument("--dir", type=Path, required=True, help="the job directory")
    join.add_argument("--job-id", required=True)
    show = sub.add_parser("addresses", help="print the addresses of a cluster.json, one a line")
    show.add_argument("file", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.cmd == "add-node":
            add_node(args.dir, Node(args.node, args.address, args.socket, args.state_dir))
        elif args.cmd == "collect":
            print(collect(args.dir, args.job_id))
        else:
            print("\n".join(load(args.file).addresses))
    except (OSError, ValueError) as err:
        print(f"corral_nodes.py {args.cmd}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
