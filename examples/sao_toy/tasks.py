"""The toy task set: six one-line repairs in a sandbox, each fixed by a short `sed` command that
depends on the prompt.

Each variant's calc.py defines one function whose operator is wrong. The user message says which
function, which operator it uses and which it must use; the fix is

    ```bash
    sed -i 's/-/+/' calc.py
    ```
    SUBMIT

with the two operators of the variant. A hidden check (copied in only after the agent stops)
imports calc.py and tests the function on two pairs of numbers; the reward is its exit status. No
single command fixes every variant (the right operator differs), so the policy has to read the
prompt; and nothing is graded without the sandbox: the command really runs there, the check
really imports the edited file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from corral.rollout.tokenizer import ByteChatTokenizer
from corral.rollout.tool_calls import ToolCallFormat
from corral.rollout.tools import tool_instructions
from corral.v1 import rollout_pb2 as pb

SYSTEM = "You fix Python code in the shell."
TOOLS = ("bash", "submit")
# The checks' inputs: together they tell all six operators apart.
CHECK_PAIRS = ((7, 3), (12, 5))


@dataclass(frozen=True)
class Variant:
    name: str  # the function, and the task id
    wrong: str  # the operator calc.py uses
    right: str  # the operator it must use

    @property
    def user(self) -> str:
        return f"{self.name}() in calc.py uses {self.wrong} instead of {self.right}."

    @property
    def command(self) -> str:
        # The first occurrence on a line: the def line has none of the operators.
        return f"sed -i 's/{self.wrong}/{self.right}/' calc.py"

    @property
    def solution(self) -> str:
        """The reference reply, as the fenced-bash format writes it (without the end-of-turn token)."""
        return f"```bash\n{self.command}\n```\nSUBMIT"


# Each variant's wrong operator is its own, so reading it in the prompt tells the variant apart.
VARIANTS = (
    Variant("add", "-", "+"),
    Variant("sub", "&", "-"),
    Variant("mul", "+", "*"),
    Variant("mod", "<", "%"),
    Variant("xor", "|", "^"),
    Variant("bor", "%", "|"),
)


def make_task(variant: Variant, *, max_turns: int = 2, max_new_tokens: int = 64, temperature: float = 1.0) -> pb.Task:
    task = pb.Task(task_id=variant.name, tool_call_format=pb.TOOL_CALL_FORMAT_FENCED_BASH)
    task.tools.extend(TOOLS)
    task.limits.max_turns = max_turns
    task.limits.max_new_tokens_per_turn = max_new_tokens
    task.limits.action_timeout_ms = 3_000
    task.sampling.temperature = temperature
    task.setup.files.add(
        path="calc.py", content=f"def {variant.name}(a, b):\n    return a {variant.wrong} b\n".encode()
    )
    task.prompt.messages.add(role="system", content=SYSTEM)
    task.prompt.messages.add(role="user", content=variant.user)
    checks = "\n".join(f"assert calc.{variant.name}({a}, {b}) == {a} {variant.right} {b}" for a, b in CHECK_PAIRS)
    task.evaluation.files.add(path="check_hidden.py", content=f"import calc\n{checks}\n".encode())
    task.evaluation.commands.append("python3 check_hidden.py")
    task.evaluation.exit_status.SetInParent()
    task.reference_solution.append(pb.ToolCall(name="bash", arguments_json=json.dumps({"command": variant.command})))
    task.reference_solution.append(pb.ToolCall(name="submit", arguments_json="{}"))
    task.metadata["variant"] = variant.name
    return task


def prompt_ids(variant: Variant, tokenizer: ByteChatTokenizer | None = None) -> list[int]:
    """The ids the agent loop sends for the first turn: the system message with the daemon's tool
    instructions appended, the user message, the generation prompt (see AgentLoop._with_instructions).
    train.py checks them against the first real rollout's prompt_ids."""
    tokenizer = tokenizer or ByteChatTokenizer()
    system = f"{SYSTEM}\n\n{tool_instructions(TOOLS, ToolCallFormat.FENCED_BASH)}"
    return tokenizer.encode_prompt([{"role": "system", "content": system}, {"role": "user", "content": variant.user}])


def solution_ids(variant: Variant, tokenizer: ByteChatTokenizer | None = None) -> list[int]:
    """The reference reply's ids, ending with <|im_end|> (what stops the generation)."""
    tokenizer = tokenizer or ByteChatTokenizer()
    return tokenizer.encode(variant.solution) + [tokenizer.end_of_turn_ids[0]]
