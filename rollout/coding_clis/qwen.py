"""Qwen Code (`qwen`): OpenAI chat completions against the gateway (docs/coding-clis.md)."""

from __future__ import annotations

import json

from corral.rollout.coding_clis import CodingCli, HarnessParts

# Its home (settings, session files) on the sandbox's own /tmp: the image's home may be read-only.
HOME = "/tmp/qwen-home"

SETTINGS = {
    "security": {"auth": {"selectedType": "openai"}},
    "general": {"enableAutoUpdate": False, "chatRecording": False},
    "privacy": {"usageStatisticsEnabled": False},
    "telemetry": {"enabled": False},
    # Background agents that would call the model after (or beside) the task: memory extraction
    # and consolidation, skill review.
    "memory": {"enableManagedAutoMemory": False, "enableManagedAutoDream": False, "enableAutoSkill": False},
}


def parts(prefix: str) -> HarnessParts:
    binary = CLI.binary_path(prefix)
    return HarnessParts(
        command=["sh", "-c", f'exec {binary} --yolo -p "$CORRAL_TASK_PROMPT"'],
        env={
            "HOME": HOME,
            "OPENAI_MODEL": "corral",
            "QWEN_USAGE_STATISTICS_ENABLED": "0",
            "QWEN_TELEMETRY_ENABLED": "0",
        },
        files={f"{HOME}/.qwen/settings.json": json.dumps(SETTINGS, indent=2).encode()},
    )


CLI = CodingCli(
    name="qwen",
    package="@qwen-code/qwen-code",
    version="0.24.4",
    binary="qwen",
    api="chat",
    vocabulary="qwen",
    parts=parts,
)
