"""INIT once, fork n: rollouts whose sandboxes would start and set up alike (the n samples of one
submission, or tasks that share a setup key) share one INIT. The sandbox is started and set up
once; ForkSandbox then makes one copy-on-write child of it per rollout, and the set-up parent is
destroyed as soon as the children exist. The pipeline (pipeline.py) runs the shared INIT; this
module decides who may share, and forks.

A fork copies files, not processes: a setup that leaves a process running, or whose outcome must
differ between samples, opts out with `TaskSetup.per_rollout`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from corral.rollout.evaluation import CANCELLED_CREATE_TIMEOUT_S, INIT_RETRY_BACKOFF_S, INIT_RETRY_MAX_BACKOFF_S
from corral.sdk import AsyncSandbox, CorralError, FailedPrecondition, InvalidArgument, NotFound
from corral.v1 import rollout_pb2 as pb

_log = logging.getLogger(__name__)

# The most children one ForkSandbox call makes: a larger group is split into several INITs.
MAX_SHARED = 64


class ForkUnavailable(Exception):
    """The backend cannot fork (FAILED_PRECONDITION): the rollouts fall back to INITs of their own."""


class ForkFailed(Exception):
    """Forking the set-up sandbox failed, retries included (filtered as FORK_FAILED)."""


class Member(Protocol):
    @property
    def finished(self) -> bool: ...


M = TypeVar("M", bound=Member)


def may_share(task: pb.Task, samples: int) -> bool:
    """Whether the rollouts of a submission may share their INIT: several samples, or a setup
    key, and a setup that did not opt out."""
    return not task.setup.per_rollout and (samples > 1 or bool(task.setup_key))


def sharing_key(task: pb.Task, submitter: str = "") -> bytes:
    """What tasks must have in common to share an INIT under their setup key: the key, every
    field that shapes the set-up sandbox, and their submitter (whose the sandboxes are: one
    submitter's rollouts never start from another's)."""
    shape = pb.Task(
        setup_key=task.setup_key,
        backend=task.backend,
        image=task.image,
        resources=task.resources,
        setup=task.setup,
        user=task.user,
        limits=pb.TaskLimits(
            action_timeout_ms=task.limits.action_timeout_ms, init_timeout_ms=task.limits.init_timeout_ms
        ),
    )
    return submitter.encode() + b"\0" + shape.SerializeToString(deterministic=True)


@dataclass(eq=False)
class SharedInit(Generic[M]):
    """One INIT shared by `members`. It takes members until the fork begins (`closed`), at most
    MAX_SHARED. `task` is the first member's: whose setup runs."""

    task: pb.Task
    members: list[M] = field(default_factory=list)
    # Its sharing key when later submissions may join it (tasks with a setup key), else None.
    key: bytes | None = None
    # The set-up sandbox's rollout label: a shared INIT is a live rollout of the pipeline's.
    init_id: str = ""
    # When a worker took it, when the node had room for it and its INIT began, when the setup
    # was done, and how long the fork took (None: no fork).
    taken_at: float | None = None
    started_at: float | None = None
    set_up_at: float | None = None
    fork_s: float | None = None
    # Members that were still waiting when the setup was done (the children forked).
    shared_by: int = 0
    fell_back: bool = False
    closed: bool = False
    # The INIT in progress (cancelled when no member is left to wait for it).
    active: asyncio.Task | None = None
    # The room of the node it holds for its set-up sandbox and the children still to be handed
    # to its members (the pipeline's SandboxRoom).
    room: int = 0

    def __post_init__(self) -> None:
        self.init_id = self.init_id or f"{self.task.task_id}/init/{secrets.token_hex(4)}"

    @property
    def full(self) -> bool:
        return self.closed or len(self.members) >= MAX_SHARED

    def waiting(self) -> list[M]:
        return [member for member in self.members if not member.finished]

    def close(self) -> list[M]:
        """Takes no more members; returns those still waiting."""
        self.closed = True
        return self.waiting()


async def _still_running(sandbox: AsyncSandbox) -> bool:
    with contextlib.suppress(CorralError):
        return (await sandbox.refresh()).state == "running"
    return False


async def fork_children(parent: AsyncSandbox, count: int, *, retries: int) -> tuple[list[AsyncSandbox], float]:
    """`count` forks of `parent` and the seconds the successful ForkSandbox call took. A node that
    refuses for now (no room, a child failing to start) is retried `retries` times with a doubling
    pause. Raises ForkUnavailable when the backend cannot fork (the daemon's FAILED_PRECONDITION
    while the parent runs), ForkFailed when it could not here.
    Cancelled midway, it lets the fork finish and destroys the children, so nothing is left."""
    attempts = retries + 1
    for attempt in range(1, attempts + 1):
        started = time.monotonic()
        forking = asyncio.ensure_future(parent.fork(count))
        try:
            return await asyncio.shield(forking), time.monotonic() - started
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                children = await asyncio.wait_for(forking, CANCELLED_CREATE_TIMEOUT_S)
                await asyncio.gather(*(c.destroy() for c in children), return_exceptions=True)
            raise
        except FailedPrecondition as error:
            # The daemon's answer for a backend that cannot fork at all, and for a parent that is
            # no longer running (reaped, failed): only the first is the backend's to remember.
            if await _still_running(parent):
                raise ForkUnavailable(str(error)) from error
            raise ForkFailed(f"forking the set-up sandbox failed: {error}") from error
        except (NotFound, InvalidArgument) as error:
            raise ForkFailed(f"forking the set-up sandbox failed: {error}") from error
        except CorralError as error:
            if attempt == attempts:
                raise ForkFailed(f"forking the set-up sandbox failed {attempts} times: {error}") from error
            _log.warning("forking sandbox %s failed (attempt %d of %d): %s", parent.id, attempt, attempts, error)
        await asyncio.sleep(min(INIT_RETRY_BACKOFF_S * 2 ** (attempt - 1), INIT_RETRY_MAX_BACKOFF_S))
    raise AssertionError("unreachable")
