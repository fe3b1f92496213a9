"""corral.cluster's placement and its ledger of owed rollouts, without a cluster."""

from __future__ import annotations

from tests.conftest import require_cluster

require_cluster("ray", "ray", "ray")  # corral.cluster imports ray

from corral.cluster.ledger import Ledger, Submission  # noqa: E402
from corral.cluster.placement import NodeSlot, Placer, slot_from_capacity  # noqa: E402
from corral.sdk.types import NodeCapacity  # noqa: E402
from corral.v1 import rollout_pb2 as pb  # noqa: E402


def _placer(**free: int) -> Placer:
    placer = Placer()
    for node_id, slots in free.items():
        placer.slots[node_id] = NodeSlot(node_id, free_at_poll=slots)
    return placer


def _place(placer: Placer, count: int, image: str | None = None) -> list[str | None]:
    chosen = []
    for _ in range(count):
        slot = placer.choose(image)
        if slot is not None:
            placer.claim(slot)
        chosen.append(slot.node_id if slot else None)
    return chosen


def test_placement_fills_by_room_and_a_full_node_gets_nothing() -> None:
    # Most room first; between nodes of equal room, the one picked least recently ("b" at the third).
    assert _place(_placer(a=3, b=1, c=0), 5) == ["a", "a", "b", "a", None]


def test_claims_made_while_a_poll_runs_stay_counted_against_its_answer() -> None:
    placer = _placer(a=4)
    slot = placer.slots["a"]
    asked_at = slot.claims  # a poll is asked for now ...
    _place(placer, 2)  # ... two placements go out meanwhile, which the daemon already counts
    slot_from_capacity(slot, NodeCapacity(free_slots=2, free_slots_default_limits=2), False, asked_at)
    assert slot.room == 0
    placer.release(slot)  # one of this client's rollouts finished: its slot is free again
    assert slot.room == 1


def test_an_image_the_node_holds_wins_over_more_room() -> None:
    placer = _placer(a=5, b=1)
    placer.slots["b"].images = frozenset({"local:/images/swe"})
    assert _place(placer, 2, image="/images/swe") == ["b", "a"]
    assert _place(placer, 1, image="other") == ["a"]


def test_lost_draining_and_refusing_nodes_get_nothing() -> None:
    placer = _placer(a=2, b=2, c=2)
    placer.slots["a"].lost = True
    placer.slots["b"].draining = True
    placer.refuse(placer.slots["c"])
    assert placer.choose() is None
    assert placer.choose_any() is placer.slots["c"]  # rollouts still go where a daemon can queue them


def _submission(group: str, node: str, n: int) -> Submission:
    return Submission(group, node, pb.Task(task_id=group), [(group, i) for i in range(n)])


def test_each_rollout_is_settled_once_and_a_lost_nodes_late_answers_are_dropped() -> None:
    ledger = Ledger()
    ledger.send(_submission("g1", "a", 2))
    ledger.send(_submission("g2", "b", 1))
    assert ledger.settle("g1", 0, "a") is not None
    assert ledger.settle("g1", 0, "a") is None  # the same answer again
    assert ledger.settle("g2", 0, "a") is None  # from a node that does not run it
    lost = ledger.lose_node("a")
    assert [key for _, key in lost] == [("g1", 1)]
    assert ledger.settle("g1", 1, "a") is None  # too late: reported lost already
    assert ledger.owed == 1 and ledger.owed_on("b") == 1


def test_a_rerun_answers_for_the_callers_group_and_index() -> None:
    ledger = Ledger()
    ledger.send(_submission("g", "a", 2))
    lost = dict((key, submission) for submission, key in ledger.lose_node("a"))
    assert set(lost) == {("g", 0), ("g", 1)}
    ledger.send(Submission("g~1~x", "b", lost[("g", 1)].task, [("g", 1)]))
    settled = ledger.settle("g~1~x", 0, "b")
    assert settled is not None and settled[1] == ("g", 1)
    assert ledger.attempts[("g", 1)] == 2 and ledger.owed == 0
