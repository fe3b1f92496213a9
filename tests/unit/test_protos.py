"""The committed generated modules match the .proto files (regenerate with scripts/gen_protos.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_matches_protos(tmp_path):
    generated = _load_generator().generate(tmp_path)
    assert generated, "no .proto files found"
    for fresh in generated:
        committed = ROOT / "proto" / fresh.relative_to(tmp_path)
        assert committed.exists(), f"{committed} is missing: run scripts/gen_protos.py"
        assert committed.read_bytes() == fresh.read_bytes(), f"{committed} is stale: run scripts/gen_protos.py"
    committed_all = {
        p.relative_to(ROOT / "proto")
        for p in (ROOT / "proto").rglob("*_pb2*.py*")
        if "__pycache__" not in p.parts  # bytecode an ordinary Python run leaves beside them
    }
    assert committed_all == {p.relative_to(tmp_path) for p in generated}, "generated files without a .proto"
