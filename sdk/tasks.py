"""Rollout tasks as the SDK takes them: `corral.v1.Task` messages, or dicts / JSON text in the
proto3 JSON mapping (what a tasks JSONL file holds, one task per line).

The daemon checks a task when it is submitted (INVALID_ARGUMENT with the reason); this module only
parses.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from corral.sdk.errors import InvalidArgument
from corral.v1 import rollout_pb2 as pb

TaskLike = pb.Task | Mapping[str, Any] | str


def task_from(task: TaskLike) -> pb.Task:
    """A Task message from a message, a dict in the proto3 JSON mapping, or JSON text."""
    if isinstance(task, pb.Task):
        return task
    try:
        if isinstance(task, str):
            return json_format.Parse(task, pb.Task())
        return json_format.ParseDict(dict(task), pb.Task())
    except (json_format.ParseError, TypeError, ValueError) as error:
        raise InvalidArgument(f"not a corral task: {error}") from None


def iter_tasks(lines: Iterable[str], *, source: str = "<tasks>") -> Iterator[pb.Task]:
    """Tasks from JSONL lines; blank lines and lines starting with # are skipped. A bad line is an
    InvalidArgument naming the source and line number."""
    for number, line in enumerate(lines, start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            yield task_from(line)
        except InvalidArgument as error:
            raise InvalidArgument(f"{source}:{number}: {error}") from None


def load_tasks(*paths: str | os.PathLike[str]) -> list[pb.Task]:
    """Every task in one or more JSONL files, in order."""
    tasks: list[pb.Task] = []
    for path in paths:
        tasks += iter_tasks(Path(path).read_text(encoding="utf-8").splitlines(), source=str(path))
    return tasks


def task_to_json(task: pb.Task) -> str:
    """One JSONL line for a task."""
    return json.dumps(json_format.MessageToDict(task, preserving_proto_field_name=True), ensure_ascii=False)
