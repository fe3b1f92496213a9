"""Claude Code (`@anthropic-ai/claude-code`, binary `claude`): Anthropic's Messages API, pointed at
the gateway by the harness's ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY (sent as x-api-key).

Its npm package's postinstall copies a native binary from the platform package
(`@anthropic-ai/claude-code-linux-x64`) over `bin/claude.exe`; an install that skipped install
scripts must run it (`npm rebuild @anthropic-ai/claude-code`).

Headless: `-p` with the task's prompt, `--output-format stream-json --verbose` (the harness's
output tail shows the transcript), `--dangerously-skip-permissions` (no approval prompts; as root,
which a sandbox's user is, Claude Code refuses it unless IS_SANDBOX=1), `--no-session-persistence`,
and `--model` the gateway's model name, which Claude Code writes into its system prompt.
CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 turns off the auto-updater, telemetry, error reporting
and every other request but the model's (DISABLE_* below say the same on their own); its
configuration lives in the sandbox's /tmp. Run this way it makes one Messages call per turn and
no side calls (no count_tokens, no title or quota calls): with the sandbox's network off, the only
connection it opens is to the gateway.

Its requests are large: a system prompt of about 7 KB and 12 tools of about 31 KB of JSON, about
49,000 ids in its first prompt with the byte tokenizer, so its tasks need max_total_tokens well
above the default 32768 (the tests use 131072).
"""

from __future__ import annotations

import shlex

from corral.rollout.coding_clis import CodingCli, HarnessParts

ENV = {
    "IS_SANDBOX": "1",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "CLAUDE_CONFIG_DIR": "/tmp/claude-config",
}


def parts(prefix: str) -> HarnessParts:
    binary = shlex.quote(CLI.binary_path(prefix))
    command = (
        f'exec {binary} -p "$CORRAL_TASK_PROMPT" --model "$CORRAL_MODEL" --output-format stream-json --verbose '
        "--dangerously-skip-permissions --no-session-persistence"
    )
    return HarnessParts(command=["sh", "-c", command], env=ENV)


CLI = CodingCli(
    name="claude",
    package="@anthropic-ai/claude-code",
    version="2.1.332",
    binary="claude",
    api="messages",
    vocabulary="claude",
    parts=parts,
)
