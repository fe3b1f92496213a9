"""A pytest plugin that runs mini-swe-agent's own test modules against corral.

Loaded into a pytest run inside a checkout of mini-swe-agent (`-p minisweagent_plugin`, with this
folder on PYTHONPATH; tests/integration/test_minisweagent.py starts that run): after collection, the
names LocalEnvironment, DockerEnvironment and SingularityEnvironment in each collected module are
bound to a factory of corral's CorralEnvironment, so mini's tests, unchanged, build their
environments on a corral sandbox. The factory drops the options about mini's own engines (the docker
executable, run arguments, ...) and takes the backend, the image and the daemon from
CORRAL_MINI_BACKEND, CORRAL_MINI_IMAGE and CORRAL_ADDRESS; CORRAL_MINI_SHELL=1 runs the actions in
persistent-shell mode.

The tests that inspect the host (or mini's own engine) instead of the environment are marked as
strict expected failures, each with its reason (HOST_TESTS; README-harness-tests.md beside this file
lists them): the run passes when everything else passes and these fail, and any other failure, or
one of these passing, fails it. The podman cases of test_docker.py are deselected: with the
engine executable dropped they repeat the docker cases.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from corral.integrations.minisweagent import CorralEnvironment

SWAPPED = ("LocalEnvironment", "DockerEnvironment", "SingularityEnvironment")
# mini's options about its engines, which a corral sandbox has no use for.
ENGINE_OPTIONS = {"executable", "run_args", "container_timeout", "pull_timeout", "global_args", "exec_args"}

# mini-swe-agent 2.4.6's tests that read the host instead of the environment they made, by name
# (without parameters), with the reason; the same on every backend and mode.
HOST_TESTS = {
    # test_local.py: a tempfile.TemporaryDirectory() on the host as the environment's cwd
    "test_local_environment_custom_cwd": "cwd is a temporary directory made on the host",
    "test_local_environment_cwd_parameter_override": "cwd is a temporary directory made on the host",
    "test_local_environment_file_operations": "cwd is a host temporary directory; reads the file on the host",
    "test_local_environment_timeout_kills_child_process": "runs a script from a host temporary directory, "
    "then reads the child's pid file and probes that pid on the host",
    # test_local.py: LocalEnvironment inherits the harness process's cwd and environment
    "test_local_environment_default_cwd": "expects the harness process's os.getcwd() as the default cwd",
    "test_local_environment_existing_env_variables": "expects the harness process's os.environ inside",
    # test_docker.py: DockerEnvironment's own container
    "test_docker_environment_custom_container_timeout": "runs `docker exec` into env.container_id",
}


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
    # test_docker.py runs each test once per engine executable (docker, podman); on corral the
    # executable is dropped, so the podman case would repeat the docker case word for word.
    repeated = [item for item in items if _engine(item) == "podman"]
    if repeated:
        config.hook.pytest_deselected(items=repeated)
        items[:] = [item for item in items if _engine(item) != "podman"]
    for item in items:
        reason = HOST_TESTS.get(getattr(item, "originalname", item.name))
        if reason is not None:
            item.add_marker(pytest.mark.xfail(reason=f"inspects the host: {reason}", strict=True))


def _engine(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("executable") if callspec is not None else None
