"""A minimal agent harness for the harness-task tests: it talks to the LLM gateway with plain urllib
(OPENAI_BASE_URL, OPENAI_API_KEY) and runs the bash calls the model makes, until it calls submit.

    python3 replay_harness.py MODE

MODE:
- sdk: runs bash calls in the sandbox through corral's SDK (CORRAL_ADDRESS, CORRAL_SANDBOX_ID): a
  harness on the host.
- local: runs bash calls itself (a harness inside the sandbox), after checking that the LLM server
  at PROBE_URL, reachable on the node, is not reachable from here (exit 5 if it is).
- exit3: prints to stderr and exits 3 without calling the model.
- hang: writes its pid to PID_FILE and sleeps.
- crash: destroys its sandbox (through the SDK), then exits 1: a sandbox that failed under it.
- rewrite: one call, then a second whose history is not the first's (a changed system message),
  then goes on solving with the new history.

Standard library only (it may run with a sandbox's python3), except `sdk`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

SYSTEM = "You repair Python code."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Runs a shell command in the task's working directory.",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
        },
    },
    {
        "type": "function",
        "function": {"name": "submit", "description": "Ends the task.", "parameters": {"type": "object"}},
    },
]


def chat(messages: list[dict]) -> dict:
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps({"model": os.environ["CORRAL_MODEL"], "messages": messages, "tools": TOOLS}).encode(),
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.load(response)["choices"][0]["message"]
    except urllib.error.HTTPError as error:
        print(f"gateway answered {error.code}: {error.read().decode()}", file=sys.stderr)
        sys.exit(1)


def bash_runner(mode: str):
    if mode == "sdk":
        from corral.sdk import Client

        client = Client(os.environ["CORRAL_ADDRESS"])
        sandbox = client.get_sandbox(os.environ["CORRAL_SANDBOX_ID"])

        def run_in_sandbox(command: str) -> str:
            result = sandbox.exec(command)
            return (result.stdout + result.stderr).decode()

        return run_in_sandbox

    def run_here(command: str) -> str:
        done = subprocess.run(command, shell=True, capture_output=True, cwd=os.environ["CORRAL_WORKDIR"])
        return (done.stdout + done.stderr).decode()

    return run_here


def solve(messages: list[dict], run_bash) -> None:
    while True:
        reply = chat(messages)
        messages.append(reply)
        for call in reply.get("tool_calls") or []:
            name = call["function"]["name"]
            arguments = json.loads(call["function"]["arguments"] or "{}")
            if name == "submit":
                sys.exit(0)
            output = run_bash(arguments["command"]) if name == "bash" else f"unknown tool {name}"
            messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": output})


def probe_is_unreachable() -> bool:
    try:
        urllib.request.urlopen(os.environ["PROBE_URL"], timeout=3)
    except (urllib.error.URLError, OSError):
        return True
    return False


def main() -> None:
    mode = sys.argv[1]
    prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": os.environ["CORRAL_TASK_PROMPT"]}]
    if mode == "exit3":
        print("the harness gives up", file=sys.stderr)
        sys.exit(3)
    if mode == "crash":
        from corral.sdk import Client

        Client(os.environ["CORRAL_ADDRESS"]).get_sandbox(os.environ["CORRAL_SANDBOX_ID"]).destroy()
        sys.exit(1)
    if mode == "hang":
        with open(os.environ["PID_FILE"], "w") as pid_file:
            pid_file.write(str(os.getpid()))
        time.sleep(600)
    if mode == "local" and not probe_is_unreachable():
        print(f"{os.environ['PROBE_URL']} is reachable from the sandbox", file=sys.stderr)
        sys.exit(5)
    if mode == "rewrite":
        first = chat(list(prompt))
        assert first.get("tool_calls"), first
        # A summarising harness: the history starts over with another system message.
        rewritten = [{"role": "system", "content": SYSTEM + " Summary: nothing done yet."}, prompt[1]]
        solve(rewritten, bash_runner("sdk"))
    solve(prompt, bash_runner(mode))


if __name__ == "__main__":
    main()
