"""The backend registry, the contract's Backend enum and the SDK's names agree: a backend added to
one and not the others fails here, not as an INTERNAL error on the wire."""

from __future__ import annotations

from typing import get_args

from corral.daemon.backends.registry import BACKENDS
from corral.daemon.config import load_config
from corral.sdk.enums import BACKEND_NUMBERS
from corral.sdk.types import BackendName


def test_every_registered_backend_is_in_the_contract_and_the_sdk() -> None:
    assert set(BACKENDS) == set(BACKEND_NUMBERS) == set(get_args(BackendName))


def test_every_backend_has_a_configuration_section_of_its_own_settings() -> None:
    config = load_config(environ={})
    for name, backend in BACKENDS.items():
        assert backend.name == name
        assert isinstance(config.backend(name), backend.Settings)
        config.backend(name).validate()  # the defaults are valid
