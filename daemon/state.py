"""The daemon's small state directory: its persistent id and one record per live sandbox.

A record is written before a sandbox starts and removed after it is destroyed, so a daemon that
was killed (-9) finds in it everything it must clean up on its next start.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path


class StateStore:
    def __init__(self, state_dir: Path) -> None:
        self.root = state_dir
        self.records_dir = state_dir / "records"
        self.records_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(state_dir, 0o711)
        os.chmod(self.records_dir, 0o700)
        self.daemon_id = self._daemon_id()

    def _daemon_id(self) -> str:
        path = self.root / "daemon_id"
        try:
            return path.read_text().strip()
        except FileNotFoundError:
            daemon_id = secrets.token_hex(4)
            path.write_text(daemon_id + "\n")
            return daemon_id

    def save(self, sandbox_id: str, record: dict) -> None:
        tmp = self.records_dir / f".{sandbox_id}.tmp"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.records_dir / f"{sandbox_id}.json")

    def remove(self, sandbox_id: str) -> None:
        (self.records_dir / f"{sandbox_id}.json").unlink(missing_ok=True)

    def records(self) -> list[dict]:
        found = []
        for path in sorted(self.records_dir.glob("*.json")):
            try:
                found.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                found.append({"sandbox_id": path.stem})
        return found
