"""Writes corral tasks (a tasks JSONL file) as rows veRL's RLHFDataset reads.

    python examples/verl/make_dataset.py examples/tasks/repair.jsonl train.parquet   # or train.jsonl

Each row: "prompt" (the task's chat messages, fields filled in: what veRL shows as raw_prompt and
measures against data.max_prompt_length), "data_source" "corral", "agent_name" "corral" (the agent
loop; drop it to use rollout.agent.default_agent_loop), and "extra_info" with "index",
"task_id" and "corral_task" (the whole task as JSON text: text survives parquet unchanged, where
nested structs would be unified across rows).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from corral.rollout.tasks import render_messages
from corral.sdk import load_tasks
from corral.sdk.tasks import task_to_json


def rows(tasks_path: str, agent_name: str = "corral") -> list[dict]:
    return [
        {
            "data_source": "corral",
            "agent_name": agent_name,
            "prompt": render_messages(task),
            "extra_info": {"index": index, "task_id": task.task_id, "corral_task": task_to_json(task)},
        }
        for index, task in enumerate(load_tasks(tasks_path))
    ]


def write(records: list[dict], out: str) -> None:
    if out.endswith(".parquet"):
        import pandas  # installed with verl (pyarrow too)

        pandas.DataFrame(records).to_parquet(out, index=False)
    elif out.endswith((".jsonl", ".json")):
        Path(out).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    else:
        raise SystemExit(f"{out}: write .parquet or .jsonl")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tasks", help="a corral tasks JSONL file")
    parser.add_argument("out", help="the veRL dataset to write: .parquet or .jsonl")
    parser.add_argument("--agent-name", default="corral", help="corral (tools mode) or corral_service")
    args = parser.parse_args()
    records = rows(args.tasks, args.agent_name)
    write(records, args.out)
    print(f"{args.out}: {len(records)} rows")


if __name__ == "__main__":
    main()
