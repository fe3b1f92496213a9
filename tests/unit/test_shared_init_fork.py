"""fork_children's reading of the daemon's refusals (rollout/shared_init.py): FAILED_PRECONDITION
is a backend that cannot fork (the rollouts fall back to an INIT each, and the pipeline remembers
it) only while the set-up sandbox still runs; for one that stopped it is this fork's failure."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from corral.rollout.shared_init import ForkFailed, ForkUnavailable, fork_children
from corral.sdk import FailedPrecondition, NotFound


class _Parent:
    """A set-up sandbox whose forks are refused, in the state `state` (None: gone)."""

    id = "sb-parent"

    def __init__(self, state: str | None) -> None:
        self.state = state

    async def fork(self, count: int):
        raise FailedPrecondition("refused")

    async def refresh(self):
        if self.state is None:
            raise NotFound("no such sandbox")
        return SimpleNamespace(state=self.state)


@pytest.mark.parametrize(
    ("state", "raised"), [("running", ForkUnavailable), ("stopping", ForkFailed), (None, ForkFailed)]
)
def test_failed_precondition_means_cannot_fork_only_while_the_parent_runs(state, raised) -> None:
    with pytest.raises(raised, match="refused"):
        asyncio.run(fork_children(_Parent(state), 2, retries=0))  # type: ignore[arg-type]
