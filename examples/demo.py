"""corral demo: start a daemon on a temporary socket, drive local sandboxes through the SDK,
print what happened, clean up; then run the bundled tasks (examples/tasks/) end to end through
an embedded daemon's rollout service with the built-in replay policy, and one deliberately broken
task (examples/broken/) to show how a failure is reported.

    make demo            (or: .venv/bin/python examples/demo.py)

Needs root (the local backend gives every sandbox its own uid, namespaces and cgroup) and
bubblewrap; `corral doctor` says what is missing.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from corral.cli.main import main as corral_cli
from corral.sdk import Client, CorralError

EXAMPLES = Path(__file__).resolve().parent


def start_daemon(root: Path) -> tuple[subprocess.Popen, str]:
    socket_path = root / "corral.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "corral.cli", "serve", "--socket", str(socket_path), "--state-dir", str(root / "state")],
        stdout=subprocess.DEVNULL,
        stderr=open(root / "daemon.log", "wb"),
    )
    deadline = time.monotonic() + 20
    while not socket_path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"the daemon did not start:\n{(root / 'daemon.log').read_text()}")
        time.sleep(0.05)
    return proc, f"unix://{socket_path}"


def show(title: str, value: object) -> None:
    print(f"  {title:<44} {value}")


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="corral-demo-") as tmp:
        root = Path(tmp)
        daemon, address = start_daemon(root)
        try:
            with Client(address) as client:
                info = client.node_info()
                local = next(b for b in info.backends if b.backend == "local")
                print(f"corral {info.version} daemon {info.daemon_id} on {address} (cgroups: {info.cgroup_mode})")
                if not local.available:
                    print(f"the local backend is unavailable here: {local.detail}")
                    return 1
                for limit in local.limits:
                    show(
                        f"limit {limit.kind}",
                        f"enforced by {limit.mechanism}"
                        if limit.enforced
                        else f"approximated by {limit.mechanism}; not enforced: {limit.reason}"
                        if limit.approximated
                        else f"NOT enforced: {limit.reason}",
                    )

                print("\nsandbox lifecycle")
                t0 = time.perf_counter()
                with client.create_sandbox(image="host", labels={"demo": "1"}) as sb:
                    r = sb.exec(["echo", "hello from", "corral"], timeout=10)
                    show("create + first command", f"{(time.perf_counter() - t0) * 1000:.1f} ms")
                    show(f"{sb.id}: echo", r.stdout)
                    show("whoami inside", sb.exec("id -u; hostname", timeout=10).stdout.split())
                    show("exit code of `exit 3`", sb.exec("exit 3", timeout=10).exit_code)

                    print("\nfiles")
                    sb.write_file("src/app.py", b"print(sum(range(10)))\n")
                    show("python3 src/app.py", sb.exec(["python3", "src/app.py"], timeout=10).stdout)
                    show("read back", sb.read_file("src/app.py"))
                    show("list /workspace/src", [e.name for e in sb.list_dir("src")])
                    local_dir = root / "upload" / "pkg"
                    local_dir.mkdir(parents=True)
                    (local_dir / "data.txt").write_text("uploaded as a tar stream\n")
                    sb.upload(str(local_dir), "/workspace/in")
                    show("uploaded file", sb.exec(["cat", "in/pkg/data.txt"], timeout=10).stdout)
                    out = root / "download"
                    out.mkdir()
                    sb.download("/workspace/src", str(out))
                    show("downloaded", sorted(str(p.relative_to(out)) for p in out.rglob("*")))

                    print("\nisolation")
                    show("cat /etc/shadow", sb.exec("cat /etc/shadow", timeout=10).stderr.strip())
                    show("touch /usr/x", sb.exec("touch /usr/x", timeout=10).stderr.strip())
                    net = sb.exec(
                        ["python3", "-c", "import socket; socket.create_connection(('127.0.0.1', 22), 1)"], timeout=10
                    )
                    show("network", "off (connect failed)" if net.exit_code else "ON")
                    show("processes visible", len(sb.exec("ps -e", timeout=10).stdout.splitlines()) - 1)

                    print("\nexec semantics")
                    t0 = time.perf_counter()
                    r = sb.exec("sleep 300 & setsid sleep 301 & echo partial; sleep 302", timeout=1)
                    show(
                        "timeout 1s on a tree of 3 processes",
                        f"timed_out={r.timed_out} signal={r.signal} output={r.stdout!r}",
                    )
                    show("survivors", sb.exec("ps -eo args | grep -c '[s]leep 30'", timeout=10).stdout.strip())
                    r = sb.exec("seq 1 3000000", timeout=30, output_limit=64)
                    show("20 MB of output, 64-byte cap", f"truncated={r.truncated} total={r.stdout_total_bytes}")
                    show("head and tail kept", r.stdout)
                    show("binary output", sb.exec(r"printf '\377\000\200'", timeout=10).stdout)
                    t0 = time.perf_counter()
                    sb.exec("sleep 100 & echo bg", timeout=30)
                    show("background child returns in", f"{(time.perf_counter() - t0) * 1000:.1f} ms")
                    print("\nshell session and kernel")
                    sh = sb.shell("main")
                    sh.run("cd /tmp && export GREETING=hello")
                    t0 = time.perf_counter()
                    turn = sh.run("echo $GREETING from $(pwd)", timeout=10)
                    show("state kept across turns", f"{turn.output!r} in {(time.perf_counter() - t0) * 1000:.1f} ms")
                    turn = sh.run("sleep 100; echo never", timeout=1)
                    show(
                        "a turn that times out",
                        f"timed_out={turn.timed_out} exit={turn.exit_code}, shell still usable: "
                        f"{sh.run('echo yes', timeout=10).output!r}",
                    )
                    try:
                        kernel = sb.kernel()
                        kernel.execute("import math; r = 2")
                        show("kernel state kept across cells", kernel.execute("math.pi * r ** 2").result_text)
                    except CorralError as err:  # the image's python has no ipykernel
                        show("kernel", f"unavailable: {err}")
                    print()
                    show("live sandboxes inside the `with` block", len(client.list_sandboxes(labels={"demo": "1"})))
                show("live sandboxes after it", len(client.list_sandboxes(labels={"demo": "1"})))
        finally:
            daemon.send_signal(signal.SIGTERM)
            code = daemon.wait(30)
        print(f"\ndaemon stopped (exit {code}); socket removed: {not (root / 'corral.sock').exists()}")
        if code != 0:
            return 1
        return run_rollouts(root)


def run_rollouts(root: Path) -> int:
    """`corral run` on the bundled tasks and on the broken one, each with an embedded daemon."""
    print(
        "\nrollouts: the bundled tasks with the replay policy (corral run examples/tasks/repair.jsonl --llm builtin:replay)"
    )
    results = root / "results.jsonl"
    code = corral_cli(
        ["run", str(EXAMPLES / "tasks" / "repair.jsonl"), "--llm", "builtin:replay", "--out", str(results)]
    )
    unsolved = [r["task_id"] for r in map(json.loads, results.read_text().splitlines()) if r["reward"] != 1.0]
    if code != 0 or unsolved:
        print(f"not every bundled task reached reward 1.0: {unsolved}")
        return 1
    print("\na deliberately broken task (examples/broken/): its reward rule cannot be applied")
    broken = root / "broken.jsonl"
    corral_cli(
        [
            "run",
            str(EXAMPLES / "broken" / "broken_task.jsonl"),
            "--llm",
            "builtin:replay",
            "--out",
            str(broken),
            "--no-progress",
        ]
    )
    [result] = [json.loads(line) for line in broken.read_text().splitlines()]
    show("status", result["status"])
    show("filter reason", result["filter_reason"])
    show("error", result["error"])
    show("turns the agent took (kept for inspection)", len(result["turns"]))
    return 0 if (result["status"], result["filter_reason"]) == ("filtered", "eval_infra") else 1


if __name__ == "__main__":
    sys.exit(main())
