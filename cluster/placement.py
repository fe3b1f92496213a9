"""Where the next sandbox or rollout goes: the node with the most room, an image it holds first.

Room comes from each node's capacity as last polled (GetNodeInfo's free slots, memory admission
included) less what this client placed there since the poll was asked for, and plus what of its
own finished since (rollouts whose results came back, sandboxes destroyed through the cluster
client's handle or found gone by its lease renewal): a client that places a thousand sandboxes
between two polls still counts each one. No I/O here; the cluster client feeds in the polls and the placements.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from corral.sdk.types import NodeCapacity


@dataclass
class NodeSlot:
    """What placement knows of one node."""

    node_id: str
    # The daemon's free slots for sandboxes of its default limits at the last poll, and whether it
    # was draining then (a draining node takes nothing).
    free_at_poll: int = 0
    draining: bool = False
    # "<backend>:<reference>" of the images the node holds ready, as GetNodeInfo lists them.
    images: frozenset[str] = frozenset()
    # This client's live placements there (sandboxes created, rollouts in flight), now and when the
    # last poll was asked for.
    claims: int = 0
    claims_at_poll: int = 0
    # Set once the node is gone (its daemon or its cluster node died): it takes nothing more.
    lost: bool = False
    # Ties between equal nodes go round robin, by when each last got something.
    last_pick: int = field(default=0, repr=False)

    @property
    def room(self) -> int:
        if self.lost or self.draining:
            return 0
        return self.free_at_poll - (self.claims - self.claims_at_poll)

    def holds_image(self, image: str | None) -> bool:
        """Whether the node has `image` ready (any backend's copy of that reference)."""
        return bool(image) and any(cached.split(":", 1)[-1] == image for cached in self.images)


def slot_from_capacity(slot: NodeSlot, capacity: NodeCapacity, draining: bool, claims_when_asked: int) -> None:
    """Takes in a poll of the node's capacity, asked for when this client's claims there were
    `claims_when_asked` (placements made while the poll ran stay counted against its answer)."""
    slot.free_at_poll = capacity.free_slots_default_limits
    slot.draining = draining
    slot.images = frozenset(capacity.images_cached)
    slot.claims_at_poll = claims_when_asked


class Placer:
    """Chooses nodes and counts the claims on them."""

    def __init__(self) -> None:
        self.slots: dict[str, NodeSlot] = {}
        self._picks = itertools.count(1)

    def choose(self, image: str | None = None, exclude: set[str] | frozenset[str] = frozenset()) -> NodeSlot | None:
        """The node for one more sandbox or rollout, or None when no node has room. A node that
        holds the image wins over one with more room but no image; among equals, the one picked
        least recently."""
        candidates = [s for s in self.slots.values() if s.room > 0 and s.node_id not in exclude]
        if not candidates:
            return None
        return max(candidates, key=lambda s: (s.holds_image(image), s.room, -s.last_pick))

    def choose_any(self) -> NodeSlot | None:
        """The live node with the most room even if it has none (work its daemon queues), or None
        when every node is lost or draining."""
        candidates = [s for s in self.slots.values() if not (s.lost or s.draining)]
        return max(candidates, key=lambda s: (s.room, -s.last_pick)) if candidates else None

    def claim(self, slot: NodeSlot) -> None:
        slot.claims += 1
        slot.last_pick = next(self._picks)

    def release(self, slot: NodeSlot) -> None:
        slot.claims -= 1

    def refuse(self, slot: NodeSlot) -> None:
        """The node said no (its caps were reached before the poll showed it): no room until the
        next poll says otherwise."""
        slot.free_at_poll = 0
        slot.claims_at_poll = slot.claims
