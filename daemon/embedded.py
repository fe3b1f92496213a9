"""A daemon inside the calling process, on a private socket in a temporary directory: what
`corral run` and `make demo` use when no daemon address is given, so that one command runs
rollouts on a fresh machine.

It is the same `Daemon` that `corral serve` runs (same backends, same RolloutService), only
started and stopped by an `async with`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

from corral.daemon.backends.base import Backend
from corral.daemon.config import Config, load_config, validate
from corral.daemon.interceptors import CallerOf
from corral.daemon.server import Daemon


@contextlib.asynccontextmanager
async def embedded_daemon(
    config: Config | None = None,
    *,
    backend_classes: Mapping[str, type[Backend]] | None = None,
    caller_of: CallerOf | None = None,
    **rollout: Any,
) -> AsyncIterator[str]:
    """Starts a daemon (configuration: `config`, else the defaults and the environment) on a
    socket in a fresh temporary directory and yields its address. `rollout` overrides keys of the
    [rollout] section (e.g. tokenizer="byte", run_workers=8); `backend_classes` replaces the
    backend registry (tests: corral.daemon.testing.fake_backends()), `caller_of` how callers are
    told apart (tests: corral.daemon.testing.callers_by_token). Everything it made is removed
    on exit."""
    config = config or load_config(environ={})
    with tempfile.TemporaryDirectory(prefix="corral-embedded-") as root:
        config = dataclasses.replace(
            config,
            daemon=dataclasses.replace(
                config.daemon, socket=str(Path(root) / "corral.sock"), state_dir=str(Path(root) / "state")
            ),
            rollout=dataclasses.replace(config.rollout, **rollout),
        )
        validate(config)
        daemon = Daemon(config, backend_classes=backend_classes, caller_of=caller_of)
        try:
            await daemon.start()
            yield f"unix://{daemon.socket_path}"
        finally:
            await daemon.stop()
