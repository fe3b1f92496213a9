"""corral.cli: the `corral` command line, the application layer on top of every other package.

- `daemon_commands`: `corral serve` (the node daemon) and `corral doctor`.
- `sandbox_commands`: `corral sandbox create|ls|rm`, `exec`, `cp`, `shell` (SDK clients).
- `run`: `corral run TASKS.jsonl` (rollouts, with an embedded daemon when no address is given).
- `main`: the parser that joins them.
"""
