"""The blocking client is generated from the asyncio one (scripts/unasync.py): this fails when
sdk/sync_client.py or sdk/sync_rollouts.py is not what the script makes from the current sources."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_sync_client_is_generated_from_the_async_one():
    pytest.importorskip("ruff", reason="the generator formats with ruff: pip install -e '.[dev]'")
    check = subprocess.run([sys.executable, "scripts/unasync.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout[-4000:] + check.stderr
