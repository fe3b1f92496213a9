"""mini-swe-agent on corral: `CorralEnvironment`, an environment of mini-swe-agent's (its
`Environment` protocol) whose commands run in a corral sandbox.

From mini's YAML config, by class path (mini's `get_environment` imports it):

    environment:
      environment_class: corral.integrations.minisweagent.CorralEnvironment
      image: python:3.12        # docker; "host" or a root filesystem directory for local
      backend: docker
      cwd: /testbed
      timeout: 60

Each action runs as mini's DockerEnvironment runs it: one fresh `bash -lc COMMAND` (the
`interpreter`) per action, in `cwd`, with `env` and the host's `forward_env` variables, stdout and
stderr merged in the order written; the result and the timeout come back in mini's shapes, and a
first output line COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT (exit 0) raises mini's `Submitted`.
`persistent_shell: true` runs the actions in one corral shell session instead, so `cd` and
variables carry over from one action to the next (and a step costs a shell turn, not a process
start). Not the daemon's token: a TCP daemon's token comes from $CORRAL_TOKEN, so that it never
lands in a saved trajectory (`serialize`).

The sandbox is the environment's: `cleanup()` (or leaving a `with` block) destroys it, and so does
garbage collection or interpreter exit. A harness killed outright does none of these: the sandbox
carries the label corral.harness=mini-swe-agent and an idle timeout, after which the daemon
destroys it by itself.

`sandbox_id` attaches to an existing sandbox instead (a rollout's, when mini runs as a task's
harness: `corral.integrations.minisweagent_harness`): nothing is created, and `cleanup()` only
closes the persistent shell and the connection; the sandbox stays its owner's.
"""

from __future__ import annotations

import logging
import os
import platform
import shlex
import subprocess
import weakref
from types import TracebackType
from typing import Any

from minisweagent.exceptions import Submitted
from minisweagent.utils.serialize import recursive_merge
from pydantic import BaseModel, ConfigDict, model_validator

from corral.sdk import Client, CorralError, Sandbox, Shell

# What mini's environments look for on the first line of an action's output to end the episode.
SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
# The label every sandbox of this integration carries (`corral ls`, list_sandboxes(labels=...)).
HARNESS_LABEL = "corral.harness"
HARNESS_NAME = "mini-swe-agent"
# The session name of persistent-shell mode.
SHELL_NAME = "mini-swe-agent"
# Runs the rest of argv with stderr on stdout's pipe: one stream, in the order written, as mini's
# `subprocess.run(..., stderr=STDOUT)` around `docker exec` gets it.
_MERGED_OUTPUT = ("sh", "-c", 'exec 2>&1; exec "$@"', "sh")


class CorralEnvironmentConfig(BaseModel):
    """The options, named as in mini's DockerEnvironmentConfig where it has them."""

    # Unknown keys are refused: a misspelt option would otherwise be dropped without a word.
    model_config = ConfigDict(extra="forbid")

    image: str | None = None
    """The sandbox's image: an image name (docker), "host" or a root filesystem directory (local);
    None: the daemon's default image of the backend."""
    backend: str | None = None
    """"local", "docker" or "singularity"; None: the daemon's default backend."""
    cwd: str = ""
    """Where commands run; relative paths are relative to the sandbox's workdir, empty: the
    workdir itself (/workspace), the sandbox's writable directory."""
    env: dict[str, str] = {}
    """Variables set for every command."""
    forward_env: list[str] = []
    """Host variables passed on to every command when set on the host (read at each action; in
    persistent-shell mode, once, when the session opens). `env` wins over them."""
    timeout: int | float = 30
    """Seconds an action may run before it is killed (the whole process tree) and reported as
    timed out."""
    interpreter: list[str] = ["bash", "-lc"]
    """What each action runs under; the action's text is appended as its last argument (not used
    in persistent-shell mode, whose session is bash)."""
    persistent_shell: bool = False
    """Run every action in one shell session of the sandbox: cwd and variables carry over."""
    memory_bytes: int | None = None
    pids: int | None = None
    cpu_millicores: int | None = None
    disk_bytes: int | None = None
    """Limits of the sandbox; None: the daemon's defaults."""
    network: bool = False
    """Give the sandbox a network (corral's default is none: loopback only)."""
    output_limit: int | None = None
    """Bytes of output kept per action (its head and tail past that); None: the daemon's default
    (1 MiB)."""
    address: str | None = None
    """The daemon: "unix:///path", "host:port", ...; None: $CORRAL_ADDRESS, else $CORRAL_SOCKET,
    else the default socket."""
    labels: dict[str, str] = {}
    """More labels for the sandbox, beside corral.harness=mini-swe-agent."""
    idle_timeout: float = 1800.0
    """Seconds without calls after which the daemon destroys the sandbox by itself, so that a
    harness that died leaks nothing (it also bounds the wait for the model between two actions);
    0: the daemon's default (limits.idle_timeout_s)."""
    startup_timeout: float = 120.0
    """Seconds the sandbox may take to start, an image pull included."""
    sandbox_id: str | None = None
    """Attach to this existing sandbox instead of creating one; it is not destroyed on cleanup
    (its owner, e.g. the rollout pipeline, destroys it). The options that shape a new sandbox
    (image, backend, limits, network, labels, idle_timeout, startup_timeout) must then be left
    unset."""

    @model_validator(mode="after")
    def _attach_takes_no_sandbox_options(self) -> CorralEnvironmentConfig:
        if self.sandbox_id is not None:
            shaping = sorted(self.model_fields_set & _NEW_SANDBOX_OPTIONS)
            if shaping:
                raise ValueError(f"sandbox_id attaches to an existing sandbox; {', '.join(shaping)} cannot apply to it")
        return self


# The options that only shape a sandbox this environment creates.
_NEW_SANDBOX_OPTIONS = frozenset(
    {
        "image",
        "backend",
        "memory_bytes",
        "pids",
        "cpu_millicores",
        "disk_bytes",
        "network",
        "labels",
        "idle_timeout",
        "startup_timeout",
    }
)


class CorralEnvironment:
    """mini-swe-agent's Environment protocol over one corral sandbox (see the module's doc)."""

    def __init__(
        self, *, config_class: type = CorralEnvironmentConfig, logger: logging.Logger | None = None, **kwargs: Any
    ) -> None:
        self.logger = logger or logging.getLogger("minisweagent.environment")
        self.config = config_class(**kwargs)
        self._client = Client(self.config.address)
        attached = self.config.sandbox_id is not None
        try:
            self._sandbox = self._client.get_sandbox(self.config.sandbox_id) if attached else self._create_sandbox()
        except BaseException:
            self._client.close()
            raise
        # One mutable slot, so that the finalizer sees the shell opened below.
        self._shells: list[Shell] = []
        # Runs once: on cleanup(), when this object is collected, or at interpreter exit.
        self._release = weakref.finalize(
            self, _release, self._client, None if attached else self._sandbox, self._shells, self.logger
        )
        self._shell: Shell | None = None
        if self.config.persistent_shell:
            try:
                self._shell = self._sandbox.shell(SHELL_NAME, env=self._command_env(), cwd=self.config.cwd or None)
            except BaseException:
                self.cleanup()
                raise
            self._shells.append(self._shell)
        verb = "Attached to" if attached else "Started"
        self.logger.info(f"{verb} corral sandbox {self._sandbox.id} ({self._sandbox.info.backend})")

    @property
    def sandbox(self) -> Sandbox:
        """The corral sandbox the actions run in (files, shells, kernels: the whole SDK)."""
        return self._sandbox

    def execute(self, action: dict, cwd: str = "", *, timeout: int | float | None = None) -> dict[str, Any]:
        """Runs `action["command"]` and returns mini's result: {"output", "returncode",
        "exception_info"}; a timeout or a failed call gives returncode -1, the output so far and
        "exception_info" with an "extra" saying which exception, as mini's environments do.
        Raises `Submitted` when the output's first line is COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT
        and the command exited 0."""
        command = action.get("command", "")
        limit = timeout or self.config.timeout
        try:
            if self._shell is not None:
                output = self._run_in_shell(self._shell, command, cwd, limit)
            else:
                output = self._exec(command, cwd, limit)
        except CorralError as error:
            output = _failure(error, "")
        self._check_finished(output)
        return output

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return recursive_merge(self.config.model_dump(), platform.uname()._asdict(), kwargs)

    def serialize(self) -> dict:
        return {
            "info": {
                "config": {
                    "environment": self.config.model_dump(mode="json"),
                    "environment_type": f"{type(self).__module__}.{type(self).__name__}",
                }
            }
        }

    def cleanup(self) -> None:
        """Destroys the sandbox (an attached one: closes the persistent shell only) and closes the
        connection; calling it again does nothing."""
        self._release()

    def __enter__(self) -> CorralEnvironment:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.cleanup()

    def _create_sandbox(self) -> Sandbox:
        config = self.config
        return self._client.create_sandbox(
            image=config.image,
            backend=config.backend,
            memory_bytes=config.memory_bytes,
            pids=config.pids,
            cpu_millicores=config.cpu_millicores,
            disk_bytes=config.disk_bytes,
            network=config.network,
            labels={**config.labels, HARNESS_LABEL: HARNESS_NAME},
            idle_timeout=config.idle_timeout or None,
            timeout=config.startup_timeout,
        )

    def _command_env(self) -> dict[str, str]:
        forwarded = {key: value for key in self.config.forward_env if (value := os.environ.get(key)) is not None}
        return {**forwarded, **self.config.env}

    def _exec(self, command: str, cwd: str, limit: float) -> dict[str, Any]:
        result = self._sandbox.exec(
            [*_MERGED_OUTPUT, *self.config.interpreter, command],
            env=self._command_env(),
            cwd=cwd or self.config.cwd or None,
            timeout=limit,
            output_limit=self.config.output_limit,
        )
        text = _decode(result.stdout)
        if result.timed_out:
            return _failure(subprocess.TimeoutExpired(command, limit, output=text), text)
        return _completed(text, result.exit_code, result.truncated, result.stdout_total_bytes)

    def _run_in_shell(self, shell: Shell, command: str, cwd: str, limit: float) -> dict[str, Any]:
        if cwd:  # the session moves there and stays there, as `cd` in it would
            moved = shell.run(f"cd -- {shlex.quote(cwd)}", timeout=limit)
            if not moved.ok:
                return _completed(_decode(moved.output), moved.exit_code, moved.truncated, moved.output_total_bytes)
        result = shell.run(command, timeout=limit, output_limit=self.config.output_limit)
        text = _decode(result.output)
        if result.timed_out:
            output = _failure(subprocess.TimeoutExpired(command, limit, output=text), text)
        else:
            output = _completed(text, result.exit_code, result.truncated, result.output_total_bytes)
        if result.shell_restarted:
            # Not mini's key: the session's cwd and variables are back to their starting state.
            output.setdefault("extra", {})["shell_restarted"] = True
        return output

    def _check_finished(self, output: dict[str, Any]) -> None:
        """Raises mini's Submitted, carrying the rest of the output as the submission, when the
        action printed the submit marker first and exited 0."""
        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if output["returncode"] == 0 and lines and lines[0].strip() == SUBMIT_MARKER:
            submission = "".join(lines[1:])
            raise Submitted(
                {
                    "role": "exit",
                    "content": submission,
                    "extra": {"exit_status": "Submitted", "submission": submission},
                }
            )


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def _completed(text: str, returncode: int, truncated: bool, total_bytes: int) -> dict[str, Any]:
    output: dict[str, Any] = {"output": text, "returncode": returncode, "exception_info": ""}
    if truncated:
        # Not mini's key: the middle of a long output was dropped (see output_limit).
        output["extra"] = {"truncated": True, "output_total_bytes": total_bytes}
    return output


def _failure(error: Exception, text: str) -> dict[str, Any]:
    """mini's shape of an action that raised (its timeout: subprocess.TimeoutExpired)."""
    return {
        "output": text,
        "returncode": -1,
        "exception_info": f"An error occurred while executing the command: {error}",
        "extra": {"exception_type": type(error).__name__, "exception": str(error)},
    }


def _release(client: Client, owned: Sandbox | None, shells: list[Shell], logger: logging.Logger) -> None:
    """Destroys the sandbox when it is this environment's (`owned`), else closes its shell."""
    what = f"corral sandbox {owned.id}" if owned is not None else "the persistent shell"
    try:
        if owned is not None:
            owned.destroy()
        else:
            for shell in shells:
                shell.close()
    except CorralError as error:  # the idle timeout, or the owner, still destroys it
        logger.warning(f"could not release {what}: {error}")
    finally:
        client.close()
