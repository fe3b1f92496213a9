"""Which rollouts a cluster stream still owes, and on which node each one runs: every rollout is
reported exactly once, whether its node sends the result, the node is lost, or it was resubmitted
to another node and the lost node's answer still arrives.

A rollout is (group id, sample index) as the caller sees it. A resubmission runs under a group id
of its own (one sample), which the ledger maps back, so results keep the caller's group and index.
No I/O here; the cluster stream feeds in what it sends and what comes back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from corral.v1 import rollout_pb2 as pb

RolloutKey = tuple[str, int]  # (group id, sample index) as the caller sees them


@dataclass
class Submission:
    """Rollouts sent to one node in one submit: `n` samples under `wire_group` there."""

    wire_group: str
    node_id: str
    task: pb.Task
    # The caller's rollout for each wire sample index.
    keys: list[RolloutKey]
    # Rollout ids the node gave them (its `accepted`), by wire sample index.
    rollout_ids: list[str] = field(default_factory=list)
    # The options the caller gave (staleness bound), which a rerun keeps.
    options: pb.RolloutOptions = field(default_factory=pb.RolloutOptions)


class Ledger:
    def __init__(self) -> None:
        self._submissions: dict[str, Submission] = {}  # by wire group id
        self._owner: dict[RolloutKey, str] = {}  # the wire group that runs each owed rollout now
        self.attempts: dict[RolloutKey, int] = {}

    @property
    def owed(self) -> int:
        return len(self._owner)

    def send(self, submission: Submission) -> None:
        """Records a submit about to be written: its rollouts are now owed by its node."""
        self._submissions[submission.wire_group] = submission
        for key in submission.keys:
            self._owner[key] = submission.wire_group
            self.attempts[key] = self.attempts.get(key, 0) + 1

    def accepted(self, wire_group: str, rollout_ids: list[str]) -> None:
        if wire_group in self._submissions:
            self._submissions[wire_group].rollout_ids = rollout_ids

    def settle(self, wire_group: str, sample_index: int, node_id: str) -> tuple[Submission, RolloutKey] | None:
        """A result arrived from `node_id`: the submission and caller's rollout it answers, if that
        rollout is still owed by that very submission; None for an answer that comes too late
        (the rollout was reported lost or runs elsewhere now)."""
        submission = self._submissions.get(wire_group)
        if submission is None or submission.node_id != node_id or sample_index >= len(submission.keys):
            return None
        key = submission.keys[sample_index]
        if self._owner.get(key) != wire_group:
            return None
        del self._owner[key]
        return submission, key

    def withdraw(self, wire_group: str) -> list[tuple[Submission, RolloutKey]]:
        """The owed rollouts of one submission (a node refused it), no longer owed by it."""
        submission = self._submissions.get(wire_group)
        if submission is None:
            return []
        owed = [(submission, key) for key in submission.keys if self._owner.get(key) == wire_group]
        for _, key in owed:
            del self._owner[key]
        return owed

    def lose_node(self, node_id: str) -> list[tuple[Submission, RolloutKey]]:
        """Every rollout still owed by `node_id`, each with its submission; none is owed by it any
        more (a late answer from it is ignored)."""
        lost = []
        for wire_group in [g for g, s in self._submissions.items() if s.node_id == node_id]:
            lost += self.withdraw(wire_group)
        return lost

    def owed_on(self, node_id: str) -> int:
        return sum(1 for g in self._owner.values() if self._submissions[g].node_id == node_id)
