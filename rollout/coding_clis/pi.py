"""Pi (`pi`, @mariozechner/pi-coding-agent): OpenAI chat completions against the gateway
(docs/coding-clis.md).

Pi takes its providers from `models.json` in its agent directory, whose `baseUrl` is a literal:
the gateway's URL is known only when the harness starts ($OPENAI_BASE_URL), so the command writes
that file first (a small Node program written with the task's files; Node is what runs Pi).
"""

from __future__ import annotations

import json
import shlex

from corral.rollout.coding_clis import CodingCli, HarnessParts

# Its agent directory (models.json, settings.json, sessions) on the sandbox's own /tmp.
AGENT_DIR = "/tmp/pi-agent"
PROVIDER = "corral"

SETTINGS = {
    # No install/update ping (PI_TELEMETRY=0 says it too) and no summarising the history behind
    # the harness's back: a compaction would be a second, rewritten history for the gateway.
    "enableInstallTelemetry": False,
    "compaction": {"enabled": False},
}

# models.json from the harness's variables: one provider speaking chat completions to the gateway,
# the key read from $OPENAI_API_KEY when Pi calls it (an `apiKey` naming a variable).
CONFIGURE = f"""\
import {{ writeFileSync }} from "node:fs";
const model = {{ id: process.env.CORRAL_MODEL, reasoning: false, input: ["text"] }};
const provider = {{
  baseUrl: process.env.OPENAI_BASE_URL,
  api: "openai-completions",
  apiKey: "OPENAI_API_KEY",
  compat: {{ supportsDeveloperRole: false, supportsReasoningEffort: false }},
  models: [model],
}};
writeFileSync("{AGENT_DIR}/models.json", JSON.stringify({{ providers: {{ {PROVIDER}: provider }} }}));
"""


def parts(prefix: str) -> HarnessParts:
    run = [
        CLI.binary_path(prefix),
        "-p",
        "--mode",
        "json",
        "--no-session",
        "--provider",
        PROVIDER,
    ]
    script = f'node {AGENT_DIR}/configure.mjs && exec {shlex.join(run)} --model "$CORRAL_MODEL" "$CORRAL_TASK_PROMPT"'
    return HarnessParts(
        command=["sh", "-c", script],
        env={
            "PI_CODING_AGENT_DIR": AGENT_DIR,
            "PI_OFFLINE": "1",
            "PI_TELEMETRY": "0",
            "PI_SKIP_VERSION_CHECK": "1",
        },
        files={
            f"{AGENT_DIR}/configure.mjs": CONFIGURE.encode(),
            f"{AGENT_DIR}/settings.json": json.dumps(SETTINGS, indent=2).encode(),
        },
    )


CLI = CodingCli(
    name="pi",
    package="@mariozechner/pi-coding-agent",
    version="0.73.1",
    binary="pi",
    api="chat",
    vocabulary="pi",
    parts=parts,
)
