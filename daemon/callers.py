"""Who is calling: each call's caller, and what it may see.

Every sandbox (with what hangs off it: shells, kernels, background processes, files, forks,
leases) and every named snapshot belongs to an owner: the uid that made it over the Unix socket
("uid:1001"), or "tcp" for the TCP listener's one token, "tcp:NAME" for a named token
(daemon.tcp.tokens_file). A caller sees and acts on its own only; anyone else's answers exactly
as a sandbox that does not exist (NOT_FOUND), so that nothing tells one user what another runs.
Root, members of `daemon.admin_group`, TCP callers where `daemon.tcp.admin` is set and named
tokens in `daemon.tcp.admins` are admins: they see and act on everything.

What changes the node itself rather than one caller's sandboxes (NODE_RPCS: draining it, the
LLM servers its rollouts generate from, the policy version they are measured against) is the
node's operator's: root, the admin group, the holder of the TCP listener's one token (who runs
the node in a cluster), admins and the daemon itself; a named token's holder is not, unless an
admin. Another caller of a shared socket is refused (PERMISSION_DENIED
naming the admin group to join: node_refusal).

The caller travels with the call in a context variable, set by the server's caller guard
(interceptors.caller_guard) around each handler, and read where ids are resolved
(SandboxManager.get and list, ForkManager's snapshots): so no handler passes it on, and none can
forget to. Work the daemon starts on its own (the idle reaper, warm pools, shutdown) runs outside
any call, as the daemon itself: an admin. So does the daemon's own client of its socket (the
rollout service, peer_front.PeerCredentials.pid is the daemon's), which makes a rollout's
sandboxes for the rollout's submitter (SandboxManager.rollout_owner).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from dataclasses import dataclass

# The RPCs that change the node for every caller (by method name), the operator's only.
NODE_RPCS = frozenset({"Drain", "RegisterLLM", "RemoveLLM", "SetPolicyVersion"})


@dataclass(frozen=True)
class Caller:
    owner: str  # what it makes belongs to this: "uid:N" or "tcp"
    admin: bool = False  # sees and acts on everything
    internal: bool = False  # the daemon itself (its rollout service, its own tasks)
    operator: bool = False  # may call NODE_RPCS (admins always may)

    def may_change_node(self) -> bool:
        return self.admin or self.operator

    def may_act_on(self, owner: str) -> bool:
        return self.admin or owner == self.owner


TCP_OWNER = "tcp"


def tcp_callers(token: str, named: dict[str, str], *, all_admin: bool, admins: list[str]) -> dict[str, Caller]:
    """Each TCP bearer token's caller: the single token's is "tcp", a named token's "tcp:NAME"
    (daemon.tcp.tokens_file); admins per daemon.tcp.admin (all) and daemon.tcp.admins (by name)."""
    # (The one token's holder runs the node, in a cluster: it may drain it and register LLM servers.)
    callers = {token: Caller(TCP_OWNER, admin=all_admin, operator=True)} if token else {}
    for secret, name in named.items():
        callers[secret] = Caller(f"{TCP_OWNER}:{name}", admin=all_admin or name in admins)
    return callers


def uid_owner(uid: int) -> str:
    return f"uid:{uid}"


def node_refusal(method: str, admin_group: str) -> str:
    """Why a caller who is not the node's operator may not call `method` (one of NODE_RPCS)."""
    who = f"root and members of group {admin_group!r} (daemon.admin_group)" if admin_group else "root"
    join = "" if admin_group else "; daemon.admin_group names a group whose members may too"
    return f"{method} changes the node for every user of this daemon: only {who} may call it{join}"


def the_daemon() -> Caller:
    """The daemon acting on its own: an admin, whose own creations belong to its uid."""
    return Caller(uid_owner(os.geteuid()), admin=True, internal=True)


_CALLER: contextvars.ContextVar[Caller | None] = contextvars.ContextVar("corral_caller", default=None)


def current_caller() -> Caller:
    """The caller of the call being served; the daemon itself outside any call."""
    return _CALLER.get() or the_daemon()


@contextlib.contextmanager
def calling_as(caller: Caller) -> Iterator[None]:
    """Serves what runs inside as `caller`'s (tasks started inside inherit it)."""
    token = _CALLER.set(caller)
    try:
        yield
    finally:
        # (A streaming handler's generator closed from another context cannot reset it; that
        # context ends with the call anyway.)
        with contextlib.suppress(ValueError):
            _CALLER.reset(token)
