"""Existing agent harnesses running on corral sandboxes, each through the harness's own interface.

- `minisweagent`: `CorralEnvironment`, a mini-swe-agent environment (extra `corral[minisweagent]`).

Each module imports its harness package, so it is imported on demand; integrations build on the
SDK only (corral.sdk), like any other client of the daemon.
"""
