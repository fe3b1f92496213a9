"""A reference solution's tool calls as a harness with one `bash` tool makes them (mini-swe-agent's
shape): corral's editor calls become an equivalent command, and the final submit becomes the
harness's own submit command (mini's: `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`).

The editor's command is a one-line Python program per editor command, with the call's arguments as
its argv, so that what is replayed does what corral's editor tool does (str_replace needs `old_str`
exactly once; insert after line `insert_line`, 0 at the top; create writes `file_text`; view prints
numbered lines) and exits 1 with the editor's complaint otherwise.
"""

from __future__ import annotations

import shlex
from typing import Any

from corral.rollout.types import ToolCall

# One short program per editor command, its arguments in argv: a replayed answer stays well within a
# turn's token budget (each byte is a token of the byte tokenizer). Paths are relative to the
# command's working directory, as the editor's are to the workdir.
_EDITOR_PROGRAMS = {
    "str_replace": (
        "import sys;p,o,n=sys.argv[1:];t=open(p).read();k=t.count(o)if o else 0;"
        'k==1 or sys.exit("editor: old_str occurs %d times in %s; it must occur exactly once"%(k,p));'
        'open(p,"w").write(t.replace(o,n,1));print("Edited",p)'
    ),
    "create": 'import sys;p,t=sys.argv[1:];open(p,"w").write(t);print("Created",p)',
    "insert": (
        "import sys;p,i,s=sys.argv[1:];i=int(i);l=open(p).read().splitlines(True);"
        '0<=i<=len(l) or sys.exit("editor: insert_line %d is outside the file (0 to %d)"%(i,len(l)));'
        'l[:i]=[x if x.endswith("\\n")else x+"\\n" for x in l[:i]];'
        'l.insert(i,s if s.endswith("\\n")else s+"\\n");open(p,"w").write("".join(l));print("Edited",p)'
    ),
    "view": (
        "import sys;p,a,b=sys.argv[1:];a,b=int(a),int(b);"
        '[print("%6d\\t%s"%(n,x))for n,x in enumerate(open(p).read().splitlines()[a-1:None if b==-1 else b],a)]'
    ),
}


def _editor_argv(arguments: dict[str, Any]) -> list[str]:
    """The program's arguments for one editor call (KeyError for a missing one)."""
    command, path = arguments["command"], str(arguments["path"])
    if command == "str_replace":
        return [path, str(arguments["old_str"]), str(arguments.get("new_str", ""))]
    if command == "create":
        return [path, str(arguments["file_text"])]
    if command == "insert":
        return [path, str(int(arguments["insert_line"])), str(arguments["new_str"])]
    first, last = arguments.get("view_range") or (1, -1)
    return [path, str(int(first)), str(int(last))]


def as_bash_call(call: ToolCall, submit_command: str) -> ToolCall:
    """`call` as a `bash` call; ValueError for a tool with no bash form (corral's python kernel,
    whose variables persist between calls)."""
    if call.name == "bash":
        return ToolCall("bash", {"command": str(call.arguments.get("command", ""))})
    if call.name == "submit":
        return ToolCall("bash", {"command": submit_command})
    if call.name == "editor":
        program = _EDITOR_PROGRAMS.get(str(call.arguments.get("command")))
        if program is None:
            raise ValueError(f"the editor has no command {call.arguments.get('command')!r}")
        try:
            argv = _editor_argv(call.arguments)
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"the editor call's arguments are incomplete: {error}") from None
        return ToolCall("bash", {"command": shlex.join(["python3", "-c", program, *argv])})
    raise ValueError(f"a harness with only a bash tool cannot replay a {call.name!r} call")
