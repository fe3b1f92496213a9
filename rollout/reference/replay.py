"""The replay policy: plays each task's reference solution back, one tool call per turn, then a
submit call. Deterministic and instant, it drives the whole pipeline end to end without a model.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from corral.rollout.prompt import fill_prompt_fields
from corral.rollout.reference.bash_calls import as_bash_call
from corral.rollout.reference.policies import GenerateParams, PolicyError, PolicyOutput
from corral.rollout.reference.vocabularies import Vocabulary
from corral.rollout.tokenizer import IM_END, IM_START, ByteChatTokenizer
from corral.rollout.tool_calls import ToolCallFormat, render_tool_calls
from corral.rollout.types import ToolCall
from corral.v1 import rollout_pb2 as pb

_ASSISTANT_HEADER = f"{IM_START}assistant"


class _Entry:
    """One task as the replay policy recognises it."""

    def __init__(self, task: pb.Task) -> None:
        self.task_id = task.task_id
        contents = [(m.role, fill_prompt_fields(m.content, task.prompt.fields)) for m in task.prompt.messages]
        users = [content for role, content in contents if role == "user"]
        if not users or not users[0]:
            raise ValueError(f"task {task.task_id!r} has no non-empty user message to recognise it by")
        self.key = users[0]
        self.contents = [content for _, content in contents if content]
        # Assistant messages written into the prompt (few-shot examples) are not turns of ours.
        self.prompt_assistant_turns = sum(1 for role, _ in contents if role == "assistant")
        self.format = (
            ToolCallFormat.FENCED_BASH
            if task.tool_call_format == pb.TOOL_CALL_FORMAT_FENCED_BASH
            else ToolCallFormat.HERMES
        )
        self.calls = [_tool_call(task.task_id, i, call) for i, call in enumerate(task.reference_solution)]
        # Identity of what would be replayed, to tell a true ambiguity from duplicate tasks.
        self.signature = (self.format, tuple(c.arguments_json() + c.name for c in self.calls))


def _tool_call(task_id: str, index: int, call: pb.ToolCall) -> ToolCall:
    try:
        arguments = json.loads(call.arguments_json) if call.arguments_json else {}
    except json.JSONDecodeError as error:
        raise ValueError(f"task {task_id!r}: reference_solution[{index}].arguments_json is not JSON: {error}") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"task {task_id!r}: reference_solution[{index}].arguments_json is not a JSON object")
    return ToolCall(call.name, arguments)


class ReplayPolicy:
    """Recognises the task from the prompt and answers with the next call of its reference solution.

    - The task: the one whose first user message (prompt fields filled in) occurs in the decoded
      input. When several do, those whose every prompt message occurs win, then the longest first
      user message; tasks left tied that would replay different solutions make the request fail.
    - The turn k: occurrences of "<|im_start|>assistant" in the input, minus the generation prompt
      at the end, minus assistant messages that are part of the task's own prompt. Turn k answers
      reference_solution[k]; past the end, a submit call.
    - The answer: that one call rendered in the task's tool-call format (HERMES unless the task
      says FENCED_BASH), then <|im_end|>; logprob 0.0 per token, finish "stop" on <|im_end|>, or
      cut at max_new_tokens with finish "length".
    - With `submit_command`, the answers are those of a harness whose only tool is `bash`
      (mini-swe-agent's): editor calls become an equivalent bash command and the submit call a
      bash call running `submit_command` (mini's: `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`);
      see `bash_calls`. Behind the LLM gateway, which parses HERMES markup into OpenAI
      tool_calls, such a harness sees its own action format.
    - With `vocabulary` (rollout/reference/vocabularies), the answers are in that harness's own
      tools (a coding CLI's shell and edit tools, or several calls in one reply where the harness
      needs them, e.g. a read before an edit; its final answer a reply without tool calls);
      `workdir` is the directory the harness runs in, for tools that take absolute paths.

    Unknown prompts raise PolicyError (the server answers 400). The weight version is always 0;
    there are no weights to load.
    """

    name = "replay"

    def __init__(
        self,
        tasks: Iterable[pb.Task],
        tokenizer: ByteChatTokenizer | None = None,
        *,
        submit_command: str | None = None,
        vocabulary: Vocabulary | None = None,
        workdir: str = "/workspace",
    ) -> None:
        if submit_command is not None and not submit_command.strip():
            raise ValueError("submit_command must be a non-empty command")
        if submit_command is not None and vocabulary is not None:
            raise ValueError("give submit_command (mini-swe-agent's bash-only calls) or a vocabulary, not both")
        self.vocabulary = vocabulary
        self.workdir = workdir
        self.tokenizer = tokenizer or ByteChatTokenizer()
        self.submit_command = submit_command
        self.weight_version = 0
        self._entries = [_Entry(task) for task in tasks]
        self._end_id = self.tokenizer.special_ids[IM_END]

    def __len__(self) -> int:
        return len(self._entries)

    def find(self, text: str) -> tuple[_Entry, int]:
        """The task `text` (a decoded prompt) belongs to, and the index of the turn to answer."""
        matches = [entry for entry in self._entries if entry.key in text]
        if not matches:
            raise PolicyError(
                f"the replay policy knows no task whose first user message occurs in this prompt "
                f"({len(self._entries)} tasks loaded; prompt starts {text[:120]!r})"
            )
        if len(matches) > 1:
            full = [entry for entry in matches if all(content in text for content in entry.contents)]
            matches = full or matches
            longest = max(len(entry.key) for entry in matches)
            matches = [entry for entry in matches if len(entry.key) == longest]
            if len({entry.signature for entry in matches}) > 1:
                raise PolicyError(
                    "the prompt matches several replay tasks with different reference solutions: "
                    + ", ".join(repr(entry.task_id) for entry in matches[:5])
                )
        entry = matches[0]
        turn = text.count(_ASSISTANT_HEADER) - 1 - entry.prompt_assistant_turns
        return entry, max(turn, 0)

    def answer(self, input_ids: list[int]) -> tuple[str, list[int]]:
        """(task id, the full answer's ids) for a prompt."""
        entry, turn = self.find(self.tokenizer.decode(input_ids))
        call = entry.calls[turn] if turn < len(entry.calls) else ToolCall("submit", {})
        try:
            if self.submit_command is not None:
                call = as_bash_call(call, self.submit_command)
            answer = self.vocabulary.answer(call, self.workdir) if self.vocabulary is not None else call
            if isinstance(answer, str):
                text = answer
            else:
                text = render_tool_calls(answer if isinstance(answer, list) else [answer], entry.format)
        except ValueError as error:
            raise PolicyError(f"task {entry.task_id!r}, turn {turn}: {error}") from None
        return entry.task_id, self.tokenizer.encode(text) + [self._end_id]

    async def generate(self, input_ids: list[int], params: GenerateParams) -> PolicyOutput:
        _, ids = self.answer(input_ids)
        if len(ids) > params.max_new_tokens:
            ids = ids[: params.max_new_tokens]
            return PolicyOutput(ids, [0.0] * len(ids), "length", None)
        return PolicyOutput(ids, [0.0] * len(ids), "stop", self._end_id)

    async def load_weights(self, path: str, weight_version: int | None) -> int:
        raise PolicyError("the replay policy has no weights to update")
