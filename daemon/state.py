"""The daemon's small state directory: its persistent id, one record per live sandbox, and whether
the node drains (a marker file, so that a restarted daemon goes on draining until it is undone).

A record is written before a sandbox starts and removed after it is destroyed, so a daemon that
was killed (-9) finds in it everything it must clean up on its next start. Nothing here may stop
the daemon: a record that cannot be read is logged and skipped (its sandbox's leftovers are still
found by the backends' sweep of orphans), and a save that fails (a full disk, no file descriptor
left) leaves no half-written file behind.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
from pathlib import Path

log = logging.getLogger(__name__)

DAEMON_ID = re.compile(r"[0-9a-f]{8}")
SANDBOX_ID = re.compile(r"sb-[0-9a-f]{12}")
DRAINING = "draining"  # present while the node drains (Drain), across restarts


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
            daemon_id = path.read_text().strip()
            if DAEMON_ID.fullmatch(daemon_id):
                return daemon_id
            log.warning("%s holds no daemon id (%r): this daemon takes a new one", path, daemon_id[:40])
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as err:
            log.warning("cannot read %s (%s): this daemon takes a new id", path, err)
        daemon_id = secrets.token_hex(4)
        tmp = self.root / ".daemon_id.tmp"
        tmp.write_text(daemon_id + "\n")
        os.replace(tmp, path)
        return daemon_id

    @property
    def draining(self) -> bool:
        return (self.root / DRAINING).exists()

    def set_draining(self, draining: bool) -> None:
        """Records the drain (an empty marker file) or its end. A failure raises: a drain that
        would not survive a restart is not reported as done."""
        marker = self.root / DRAINING
        if draining:
            marker.touch()
        else:
            marker.unlink(missing_ok=True)

    def save(self, sandbox_id: str, record: dict) -> None:
        """Writes a record whole (a crash or a full disk leaves the previous one, or none)."""
        tmp = self.records_dir / f".{sandbox_id}.tmp"
        try:
            tmp.write_text(json.dumps(record))
            os.replace(tmp, self.records_dir / f"{sandbox_id}.json")
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def remove(self, sandbox_id: str) -> None:
        try:
            (self.records_dir / f"{sandbox_id}.json").unlink(missing_ok=True)
        except OSError as err:
            log.warning("cannot remove the record of %s: %s", sandbox_id, err)

    def records(self) -> list[tuple[str, dict]]:
        """(sandbox id, record) of every record left, the id taken from the file name. A record
        that cannot be read or is not a JSON object comes back empty, with a warning."""
        found = []
        for path in sorted(self.records_dir.glob("*.json")):
            if not SANDBOX_ID.fullmatch(path.stem):
                log.warning("skipping %s: not a sandbox record", path)
                continue
            try:
                record = json.loads(path.read_text())
                if not isinstance(record, dict):
                    raise ValueError(f"a JSON {type(record).__name__}, not an object")
            except (OSError, ValueError) as err:
                log.warning("skipping unreadable sandbox record %s: %s", path, err)
                record = {}
            found.append((path.stem, {**record, "sandbox_id": path.stem}))
        return found
