"""Existing agent harnesses running on corral sandboxes, each through the harness's own interface.

- `minisweagent`: `CorralEnvironment`, a mini-swe-agent environment (extra `corral[minisweagent]`).
- `minisweagent_harness`: mini-swe-agent as a harness task's command, through the LLM gateway.

Each module imports its harness package, so it is imported on demand; integrations build on the
SDK only (corral.sdk), like any other client of the daemon.
"""
