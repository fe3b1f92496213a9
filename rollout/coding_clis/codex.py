"""Codex CLI (`@openai/codex`, a native binary from a platform package) as a harness task.

It speaks only OpenAI's Responses API (`wire_api = "responses"`): the gateway's `/v1/responses`.
What 0.171.0 sends, logged against the gateway: every call streamed (`stream: true`), the whole
history each time with `store: false` and no `previous_response_id`, `include:
["reasoning.encrypted_content"]` (the gateway returns no reasoning items, so none come back),
`reasoning.effort`, `text.verbosity`, `prompt_cache_key` and `client_metadata`; no websocket
upgrade, no title or compaction calls in a short task.

Its tools come from the model's entry in the catalog Codex bundles: an unknown model name gets
fallback metadata (exec_command and write_stdin, no apply_patch, and a warning), so the harness
names a bundled model, `MODEL`, whose entry gives Codex's own system prompt for it and the tools
exec_command {cmd, workdir, yield_time_ms, ...}, write_stdin, request_user_input, view_image and
apply_patch as a custom (freeform) tool taking Codex's patch format. The gateway serves whatever
the request names; the name only picks Codex's prompt and tools. Turned off, because the gateway
refuses them or they reach the network: web search (a server-side tool), the sub-agent tools (a
`namespace` tool type), the goal tools, plugins and apps (a `git ls-remote` of GitHub at start),
analytics, feedback, OpenTelemetry export and the update check.

Codex's own sandbox (landlock/seccomp, or bwrap) is off with its approvals
(`--dangerously-bypass-approvals-and-sandbox`, meant for externally sandboxed environments): the
task's sandbox is the boundary, and Codex's would have to nest inside it. Its home is
$CODEX_HOME in the sandbox's /tmp (Codex warns that it makes no PATH aliases for helper binaries
under a temporary directory: `apply_patch` stays a tool, not a command). `--ephemeral` keeps no
session files; stdin is /dev/null, since `codex exec` otherwise waits to read more of the prompt
from it.

A reply cut at the task's max_new_tokens_per_turn comes back `incomplete` (OpenAI's
max_output_tokens), on which Codex ends its run with an error (exit 1: the rollout is
harness_failed), as it would against OpenAI; give Codex tasks a per-turn budget its replies fit.
"""

from __future__ import annotations

from corral.rollout.coding_clis import CodingCli, HarnessParts

CODEX_HOME = "/tmp/codex-home"
# A model in Codex 0.171.0's bundled catalog (`codex debug models`).
MODEL = "gpt-5.5"

CONFIG = f"""\
model = "{MODEL}"
model_provider = "corral"
check_for_update_on_startup = false
web_search = "disabled"

[model_providers.corral]
name = "corral"
# base_url is the rollout's gateway, given on the command line ($OPENAI_BASE_URL).
env_key = "OPENAI_API_KEY"
wire_api = "responses"

[analytics]
enabled = false

[feedback]
enabled = false

[otel]
exporter = "none"
trace_exporter = "none"
metrics_exporter = "none"

[agents]
enabled = false

[features]
goals = false
plugins = false
remote_plugin = false
apps = false
"""


def parts(prefix: str) -> HarnessParts:
    binary = CLI.binary_path(prefix)
    command = (
        f"exec {binary} exec --strict-config --ephemeral --skip-git-repo-check --color never"
        " --dangerously-bypass-approvals-and-sandbox"
        ' -C "$CORRAL_WORKDIR" -c "model_providers.corral.base_url=\\"$OPENAI_BASE_URL\\""'
        ' "$CORRAL_TASK_PROMPT" </dev/null'
    )
    return HarnessParts(
        command=["sh", "-c", command],
        env={"CODEX_HOME": CODEX_HOME},
        files={f"{CODEX_HOME}/config.toml": CONFIG.encode()},
    )


CLI = CodingCli(
    name="codex",
    package="@openai/codex",
    version="0.171.0",
    binary="codex",
    api="responses",
    vocabulary="codex",
    parts=parts,
)
