"""A reference solution's tool calls as a harness with one `bash` tool makes them (mini-swe-agent's
shape): corral's editor calls become an equivalent command, and the final submit becomes the
harness's own submit command (mini's: `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`).

The editor's command is a small Python program given the call's arguments as JSON, so that what is
replayed does what corral's editor tool does (str_replace needs `old_str` exactly once; insert after
line `insert_line`, 0 at the top; create writes `file_text`; view prints numbered lines) and exits 1
with the editor's complaint otherwise.
"""

from __future__ import annotations

import json
import shlex

from corral.rollout.types import ToolCall

# Paths are relative to the command's working directory, as the editor's are to the workdir.
_EDITOR_PROGRAM = """\
import json, sys
a = json.loads(sys.argv[1]); c = a["command"]; p = a["path"]
def fail(m): sys.exit("editor: " + m)
if c == "create":
    open(p, "w").write(a["file_text"]); print("Created " + p + "."); sys.exit()
t = open(p).read()
if c == "view":
    lo, hi = a.get("view_range") or [1, -1]; ls = t.splitlines()
    for n, l in enumerate(ls[lo - 1:None if hi == -1 else hi], lo): print("%6d\\t%s" % (n, l))
    sys.exit()
if c == "str_replace":
    o = a["old_str"]; k = t.count(o) if o else 0
    if k != 1: fail("old_str occurs %d times in %s; it must occur exactly once" % (k, p))
    t = t.replace(o, a.get("new_str", ""), 1)
elif c == "insert":
    ls = t.splitlines(keepends=True); i = a["insert_line"]; s = a["new_str"]
    if not 0 <= i <= len(ls): fail("insert_line %d is outside the file (0 to %d)" % (i, len(ls)))
    if i and not ls[i - 1].endswith("\\n"): ls[i - 1] += "\\n"
    ls.insert(i, s if s.endswith("\\n") else s + "\\n"); t = "".join(ls)
else: fail("unknown command " + repr(c))
open(p, "w").write(t); print("Edited " + p + ".")
"""


def as_bash_call(call: ToolCall, submit_command: str) -> ToolCall:
    """`call` as a `bash` call; ValueError for a tool with no bash form (corral's python kernel,
    whose variables persist between calls)."""
    if call.name == "bash":
        return ToolCall("bash", {"command": str(call.arguments.get("command", ""))})
    if call.name == "submit":
        return ToolCall("bash", {"command": submit_command})
    if call.name == "editor":
        arguments = json.dumps(call.arguments, ensure_ascii=False)
        return ToolCall("bash", {"command": f"python3 -c {shlex.quote(_EDITOR_PROGRAM)} {shlex.quote(arguments)}"})
    raise ValueError(f"a harness with only a bash tool cannot replay a {call.name!r} call")
