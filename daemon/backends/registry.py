"""The backends this daemon knows, by name. Adding one: its own folder (a `Backend` with its
`Settings` and its `ManagedSandbox` in NAME/backend.py), one entry here, and a `BACKEND_<NAME>`
value in the `Backend` enum of proto/corral/v1/sandbox.proto (the SDK, the CLI and the servicer
take their names from that enum). Configuration sections, `corral doctor`, the default images and
the daemon's wiring all follow from this table; what else still names backends one by one is
listed in docs/architecture.md ("To add ... A backend").
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from .base import Backend
from .docker.backend import DockerBackend
from .local.backend import LocalBackend
from .singularity.backend import SingularityBackend

BACKENDS: Mapping[str, type[Backend]] = MappingProxyType(
    {backend.name: backend for backend in (LocalBackend, DockerBackend, SingularityBackend)}
)
