"""Regenerates the committed Python modules from proto/corral/v1/*.proto.

Run from anywhere: `python scripts/gen_protos.py`. The generated modules sit next to their .proto
files (proto/corral/v1/), which pyproject maps to the import name `corral.v1`. tests/unit/test_protos.py
fails when they drift from the .proto files.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"


def generate(out_dir: Path) -> list[Path]:
    """Generates *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every .proto under proto/ into out_dir."""
    sources = sorted(PROTO_DIR.rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(PROTO_DIR)) for p in sources],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted(p for p in out_dir.rglob("*_pb2*.py*"))


if __name__ == "__main__":
    written = generate(PROTO_DIR)
    for path in written:
        print(path.relative_to(ROOT))
    sys.exit(0)
