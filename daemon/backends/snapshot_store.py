"""The named snapshots (SnapshotSandbox) a backend keeps, bounded by what they hold together.

Each backend keeps its snapshots its own way (a read-only btrfs subvolume in the node's pool on
local and docker, storage.py; a copied directory on singularity) and says how to size one
and how to delete one; the store counts them against the backend's `snapshot_store_bytes`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from corral.sdk.errors import ResourceExhausted


class SnapshotStore:
    """The named snapshots of one backend, bounded by what they hold together (`setting`: the key
    that sets `limit_bytes`, for the error). `measure(point)`: the bytes a snapshot holds;
    `remove(point)`: deletes one (nothing when there is none)."""

    def __init__(
        self, setting: str, limit_bytes: int, measure: Callable[[Path], int], remove: Callable[[Path], None]
    ) -> None:
        self.setting = setting
        self.limit_bytes = limit_bytes
        self._measure = measure
        self._remove = remove
        self._sizes: dict[str, int] = {}  # by path

    def admit(self, point: Path, sandbox_id: str) -> int:
        """Counts a snapshot just taken at `point` and returns its size; deletes it and raises
        RESOURCE_EXHAUSTED when the store has no room for it."""
        try:
            size = self._measure(point)
            held = sum(self._sizes.values())
            if held + size > self.limit_bytes:
                raise ResourceExhausted(
                    f"a snapshot of sandbox {sandbox_id} would hold {size} bytes, and the named snapshots "
                    f"already hold {held} of the {self.limit_bytes} {self.setting} allows: delete some"
                )
        except BaseException:
            self._remove(point)
            raise
        self._sizes[str(point)] = size
        return size

    def drop(self, point: Path) -> None:
        """Deletes a fork point or named snapshot (uncounted)."""
        self._sizes.pop(str(point), None)
        self._remove(point)
