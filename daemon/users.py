"""Who a sandbox's programs run as, inside it: a user given by name or uid (CreateSandbox's and
each call's `user`), resolved against the image's own /etc/passwd.

Every backend maps these inside ids to unprivileged host ids of the sandbox's own (docs/backends.md
says how, per backend), so "root" here is root inside the sandbox only. Inside ids are limited to
the range every sandbox has mapped (INSIDE_ID_COUNT)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from corral.sdk.errors import FailedPrecondition, InvalidArgument

# Inside uids and gids 0 .. INSIDE_ID_COUNT - 1 exist in every sandbox (the size of the host id
# range each sandbox gets); 65534 is nobody.
INSIDE_ID_COUNT = 65536
MAX_USER_SPEC = 64
# A user as a name (POSIX portable characters, as useradd takes them), a uid, or uid:gid.
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*\$?")
_IDS = re.compile(r"([0-9]+)(?::([0-9]+))?")


@dataclass(frozen=True)
class SandboxUser:
    uid: int
    gid: int
    name: str  # "" for a uid the image's passwd does not name
    home: str  # "/" when the image says none

    def home_or(self, fallback: str) -> str:
        """The home a call as this user gets: its own, or `fallback` for a uid the image does not
        name or a home of "/" (where a user could not write its dotfiles)."""
        return self.home if self.name and self.home not in ("", "/") else fallback


ROOT = SandboxUser(0, 0, "root", "/root")


def check_user_spec(spec: str) -> str:
    """The spec as given, or INVALID_ARGUMENT naming what is wrong with it ("" = the default)."""
    if spec == "":
        return spec
    if len(spec) > MAX_USER_SPEC:
        raise InvalidArgument(f"user must be at most {MAX_USER_SPEC} characters, got {len(spec)}")
    ids = _IDS.fullmatch(spec)
    if ids is not None:
        for value in ids.groups():
            if value is not None and int(value) >= INSIDE_ID_COUNT:
                raise InvalidArgument(f"user ids must be below {INSIDE_ID_COUNT}, got {spec!r}")
        return spec
    if not _NAME.fullmatch(spec):
        raise InvalidArgument(f"user must be a user name, a uid or uid:gid, got {spec!r}")
    return spec


def _entries(text: str, fields: int) -> list[list[str]]:
    rows = []
    for line in text.splitlines():
        parts = line.split(":")
        if len(parts) >= fields and not line.startswith(("#", "+", "-")):
            rows.append(parts)
    return rows


def _id(value: str) -> int | None:
    return int(value) if value.isdigit() and int(value) < INSIDE_ID_COUNT else None


def resolve_user(spec: str, passwd: str) -> SandboxUser:
    """The inside user `spec` names (checked by check_user_spec first), looked up in the image's
    passwd text, with the entry's primary group. A name the image lacks is FAILED_PRECONDITION; a
    uid needs no entry (its gid is then the uid, as with Docker's `--user`)."""
    spec = check_user_spec(spec)
    users = _entries(passwd, 7)
    ids = _IDS.fullmatch(spec)
    if ids is not None:
        uid = int(ids.group(1))
        entry = next((u for u in users if _id(u[2]) == uid), None)
        if ids.group(2) is not None:
            gid = int(ids.group(2))
        elif entry is not None and _id(entry[3]) is not None:
            gid = int(entry[3])
        else:
            gid = uid
        return SandboxUser(uid, gid, entry[0] if entry else "", (entry[5] or "/") if entry else "/")
    entry = next((u for u in users if u[0] == spec), None)
    if entry is None:
        if spec == "root":
            return ROOT  # an image without /etc/passwd still has root
        raise FailedPrecondition(f"the image has no user {spec!r} (not in its /etc/passwd)")
    found_uid, found_gid = _id(entry[2]), _id(entry[3])
    if found_uid is None or found_gid is None:
        raise FailedPrecondition(f"user {spec!r} of the image has ids outside 0..{INSIDE_ID_COUNT - 1}")
    return SandboxUser(found_uid, found_gid, entry[0], entry[5] or "/")
