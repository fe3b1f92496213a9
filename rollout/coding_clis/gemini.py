"""Gemini CLI (`gemini`), headless: `-p` with the task's prompt, `--output-format json`, approvals
off (`--approval-mode yolo`), the workdir trusted without asking (`--skip-trust`), its own sandbox
off. It speaks Gemini's generateContent API (streamGenerateContent?alt=sse) to
$GOOGLE_GEMINI_BASE_URL with $GEMINI_API_KEY as x-goog-api-key.

`--model` names the model (the gateway's name, $CORRAL_MODEL): with a model named, the CLI skips
its model router, which otherwise first asks a classifier model how hard the prompt is (a
generateContent call with a JSON response schema, which the gateway refuses: the CLI then falls
back to its default model). Its other side calls stay off
by their defaults here: the next-speaker check (`model.skipNextSpeakerCheck`), the edit corrector
(`tools.disableLLMCorrection`), loop detection by LLM (after 30 turns in one prompt: beyond the
tasks' limits) and compression (at half the context window of a model it does not know: 1M tokens).
Usage statistics, telemetry, update checks and IDE integration are off in its settings file,
written under GEMINI_CLI_HOME (the sandbox's /tmp), where it also keeps its history.
"""

from __future__ import annotations

import json
import shlex

from corral.rollout.coding_clis import CodingCli, HarnessParts

# GEMINI_CLI_HOME stands in for the home directory: settings in $GEMINI_CLI_HOME/.gemini/.
HOME = "/tmp/corral-gemini-cli"

SETTINGS = {
    "general": {"enableAutoUpdate": False, "enableAutoUpdateNotification": False},
    "privacy": {"usageStatisticsEnabled": False},
    "telemetry": {"enabled": False},
    "ide": {"enabled": False},
    "tools": {"sandbox": False},
    "security": {"auth": {"selectedType": "gemini-api-key"}},
    "model": {"skipNextSpeakerCheck": True},
}


def parts(prefix: str) -> HarnessParts:
    binary = shlex.quote(CLI.binary_path(prefix))
    return HarnessParts(
        [
            "sh",
            "-c",
            f'exec {binary} --model "$CORRAL_MODEL" --approval-mode yolo --skip-trust --output-format json '
            '-p "$CORRAL_TASK_PROMPT"',
        ],
        env={"GEMINI_CLI_HOME": HOME},
        files={f"{HOME}/.gemini/settings.json": json.dumps(SETTINGS, indent=2).encode()},
    )


CLI = CodingCli(
    name="gemini",
    package="@google/gemini-cli",
    version="0.61.0",
    binary="gemini",
    api="gemini",
    vocabulary="gemini",
    parts=parts,
)
