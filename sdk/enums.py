"""How the SDK spells the contract's enum values: the value name without its type prefix, in lower
case (BACKEND_LOCAL <-> "local", SANDBOX_STATE_RUNNING <-> "running").

Backend names come from the proto enum itself, so a backend added to the contract is known to the
SDK's requests, the CLI and the daemon's servicer without another edit (the `BackendName` Literal
of `corral.sdk.types`, for type checkers, is the one other place; a unit test ties them).
"""

from __future__ import annotations

import types
from collections.abc import Mapping

from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper

from corral.sdk.errors import InvalidArgument
from corral.v1 import sandbox_pb2 as pb


def enum_name(enum_type: EnumTypeWrapper, prefix: str, number: int) -> str:
    """BACKEND_LOCAL -> "local"; a number this SDK does not know (newer daemon) -> "unknown"."""
    try:
        return enum_type.Name(number).removeprefix(prefix).lower()
    except ValueError:
        return "unknown"


# "local" -> BACKEND_LOCAL, for every backend the contract names.
BACKEND_NUMBERS: Mapping[str, pb.Backend] = types.MappingProxyType(
    {
        name.removeprefix("BACKEND_").lower(): number
        for name, number in pb.Backend.items()
        if number != pb.BACKEND_UNSPECIFIED
    }
)
BACKEND_NAMES: tuple[str, ...] = tuple(BACKEND_NUMBERS)


def backend_number(backend: str | None) -> pb.Backend:
    """The contract's number of a backend name; None -> BACKEND_UNSPECIFIED (the daemon's default)."""
    if backend is None:
        return pb.BACKEND_UNSPECIFIED
    number = BACKEND_NUMBERS.get(backend)
    if number is None:
        raise InvalidArgument(f"unknown backend {backend!r}; choose one of {sorted(BACKEND_NUMBERS)} or None")
    return number


def backend_name(number: int) -> str:
    """The name of a backend number ("unknown" for one this SDK does not know)."""
    return enum_name(pb.Backend, "BACKEND_", number)
