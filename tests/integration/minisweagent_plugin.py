"""A pytest plugin that runs mini-swe-agent's own test modules against corral.

Loaded into a pytest run inside a checkout of mini-swe-agent (`-p minisweagent_plugin`, with this
folder on PYTHONPATH; tests/integration/test_minisweagent.py starts that run): after collection, the
names LocalEnvironment, DockerEnvironment and SingularityEnvironment in each collected module are
bound to a factory of corral's CorralEnvironment, so mini's tests, unchanged, build their
environments on a corral sandbox. The factory drops the options about mini's own engines (the docker
executable, run arguments, ...) and takes the backend, the image and the daemon from
CORRAL_MINI_BACKEND, CORRAL_MINI_IMAGE and CORRAL_ADDRESS; CORRAL_MINI_SHELL=1 runs the actions in
persistent-shell mode.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from corral.integrations.minisweagent import CorralEnvironment

SWAPPED = ("LocalEnvironment", "DockerEnvironment", "SingularityEnvironment")
# mini's options about its engines, which a corral sandbox has no use for.
ENGINE_OPTIONS = {"executable", "run_args", "container_timeout", "pull_timeout", "global_args", "exec_args"}


def corral_environment(**options: Any) -> CorralEnvironment:
    options = {key: value for key, value in options.items() if key not in ENGINE_OPTIONS}
    # mini's tests name public images (python:3.11); the sandbox runs the backend's test image.
    options["image"] = os.environ["CORRAL_MINI_IMAGE"]
    options["backend"] = os.environ["CORRAL_MINI_BACKEND"]
    options.setdefault("persistent_shell", os.environ.get("CORRAL_MINI_SHELL") == "1")
    return CorralEnvironment(**options)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    modules = {id(module): module for item in items if (module := getattr(item, "module", None)) is not None}
    for module in modules.values():
        for name in SWAPPED:
            if hasattr(module, name):
                setattr(module, name, corral_environment)
