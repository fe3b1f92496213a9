"""One call of every RPC that names a sandbox (or something of one: a shell, a kernel, a background
process, a snapshot), for the ownership tests: a caller who does not own the target must get
NOT_FOUND from each, worded as for an id that does not exist. Raw stubs, so that no SDK check
stands between the request and the daemon. Run in-process (tests/unit/test_ownership.py) and
from another user's process (tests/integration/test_shared_daemon.py, as a script)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc

from corral.v1 import kernel_pb2 as kpb
from corral.v1 import kernel_pb2_grpc, sandbox_pb2_grpc, shell_pb2_grpc
from corral.v1 import sandbox_pb2 as pb
from corral.v1 import shell_pb2 as spb
from tests.transfer_messages import tar_of, upload_messages


@dataclass(frozen=True)
class Target:
    """What the owner made, by id: the probes aim at these."""

    sandbox_id: str
    kernel_id: str
    process_id: str
    snapshot: str


@dataclass(frozen=True)
class Stubs:
    sandbox: sandbox_pb2_grpc.SandboxServiceStub
    shell: shell_pb2_grpc.ShellServiceStub
    kernel: kernel_pb2_grpc.KernelServiceStub

    @classmethod
    def on(cls, channel: grpc.Channel) -> Stubs:
        return cls(
            sandbox_pb2_grpc.SandboxServiceStub(channel),
            shell_pb2_grpc.ShellServiceStub(channel),
            kernel_pb2_grpc.KernelServiceStub(channel),
        )


Probe = Callable[[Stubs, Target], object]


def _drain(stream) -> None:
    for _ in stream:
        pass


def _attach(sandbox_id: str) -> Iterator[spb.AttachRequest]:
    yield spb.AttachRequest(start=spb.AttachStart(sandbox_id=sandbox_id))


def _probes() -> dict[str, Probe]:
    command = pb.Command(argv=pb.Argv(args=["true"]))
    return {
        "GetSandbox": lambda s, t: s.sandbox.GetSandbox(pb.GetSandboxRequest(sandbox_id=t.sandbox_id)),
        "Exec": lambda s, t: s.sandbox.Exec(pb.ExecRequest(sandbox_id=t.sandbox_id, command=command)),
        "ExecStream": lambda s, t: _drain(
            s.sandbox.ExecStream(pb.ExecStreamRequest(sandbox_id=t.sandbox_id, command=command))
        ),
        "ReadFile": lambda s, t: s.sandbox.ReadFile(pb.ReadFileRequest(sandbox_id=t.sandbox_id, path="secret.txt")),
        "WriteFile": lambda s, t: s.sandbox.WriteFile(
            pb.WriteFileRequest(sandbox_id=t.sandbox_id, path="planted.txt", data=b"x")
        ),
        "ListDir": lambda s, t: s.sandbox.ListDir(pb.ListDirRequest(sandbox_id=t.sandbox_id, path=".")),
        "Upload": lambda s, t: s.sandbox.Upload(upload_messages(t.sandbox_id, "up", tar_of({"planted.txt": b"x"}))),
        "Download": lambda s, t: _drain(
            s.sandbox.Download(pb.DownloadRequest(sandbox_id=t.sandbox_id, path="secret.txt"))
        ),
        "RenewLease": lambda s, t: s.sandbox.RenewLease(pb.RenewLeaseRequest(sandbox_id=t.sandbox_id, ttl_ms=60_000)),
        "ForkSandbox": lambda s, t: s.sandbox.ForkSandbox(pb.ForkSandboxRequest(sandbox_id=t.sandbox_id, count=1)),
        "ForkSandbox(snapshot)": lambda s, t: s.sandbox.ForkSandbox(
            pb.ForkSandboxRequest(snapshot=t.snapshot, count=1)
        ),
        "SnapshotSandbox": lambda s, t: s.sandbox.SnapshotSandbox(
            pb.SnapshotSandboxRequest(sandbox_id=t.sandbox_id, name="stolen")
        ),
        "DeleteSnapshot": lambda s, t: s.sandbox.DeleteSnapshot(pb.DeleteSnapshotRequest(name=t.snapshot)),
        "OpenShell": lambda s, t: s.shell.OpenShell(spb.OpenShellRequest(sandbox_id=t.sandbox_id)),
        "RunInShell": lambda s, t: s.shell.RunInShell(spb.RunInShellRequest(sandbox_id=t.sandbox_id, command="true")),
        "ListShells": lambda s, t: s.shell.ListShells(spb.ListShellsRequest(sandbox_id=t.sandbox_id)),
        "CloseShell": lambda s, t: s.shell.CloseShell(spb.CloseShellRequest(sandbox_id=t.sandbox_id)),
        "Attach": lambda s, t: _drain(s.shell.Attach(_attach(t.sandbox_id))),
        "StartProcess": lambda s, t: s.shell.StartProcess(
            spb.StartProcessRequest(sandbox_id=t.sandbox_id, argv=["sleep", "1"])
        ),
        "ReadProcessOutput": lambda s, t: s.shell.ReadProcessOutput(
            spb.ReadProcessOutputRequest(sandbox_id=t.sandbox_id, process_id=t.process_id)
        ),
        "WriteProcessInput": lambda s, t: s.shell.WriteProcessInput(
            spb.WriteProcessInputRequest(sandbox_id=t.sandbox_id, process_id=t.process_id, data=b"x")
        ),
        "SignalProcess": lambda s, t: s.shell.SignalProcess(
            spb.SignalProcessRequest(sandbox_id=t.sandbox_id, process_id=t.process_id, signal=15)
        ),
        "WaitProcess": lambda s, t: s.shell.WaitProcess(
            spb.WaitProcessRequest(sandbox_id=t.sandbox_id, process_id=t.process_id, timeout_ms=1)
        ),
        "CloseProcess": lambda s, t: s.shell.CloseProcess(
            spb.CloseProcessRequest(sandbox_id=t.sandbox_id, process_id=t.process_id)
        ),
        "ListProcesses": lambda s, t: s.shell.ListProcesses(spb.ListProcessesRequest(sandbox_id=t.sandbox_id)),
        "StartKernel": lambda s, t: s.kernel.StartKernel(kpb.StartKernelRequest(sandbox_id=t.sandbox_id)),
        "Execute": lambda s, t: _drain(
            s.kernel.Execute(kpb.ExecuteRequest(sandbox_id=t.sandbox_id, kernel_id=t.kernel_id, code="1"))
        ),
        "ExecuteGathered": lambda s, t: s.kernel.ExecuteGathered(
            kpb.ExecuteGatheredRequest(sandbox_id=t.sandbox_id, kernel_id=t.kernel_id, code="1")
        ),
        "InterruptKernel": lambda s, t: s.kernel.InterruptKernel(
            kpb.InterruptKernelRequest(sandbox_id=t.sandbox_id, kernel_id=t.kernel_id)
        ),
        "RestartKernel": lambda s, t: s.kernel.RestartKernel(
            kpb.RestartKernelRequest(sandbox_id=t.sandbox_id, kernel_id=t.kernel_id)
        ),
        "ListKernels": lambda s, t: s.kernel.ListKernels(kpb.ListKernelsRequest(sandbox_id=t.sandbox_id)),
        "ShutdownKernel": lambda s, t: s.kernel.ShutdownKernel(
            kpb.ShutdownKernelRequest(sandbox_id=t.sandbox_id, kernel_id=t.kernel_id)
        ),
        # Last: were it to succeed, the target would be gone for the probes after it.
        "DestroySandbox": lambda s, t: s.sandbox.DestroySandbox(pb.DestroySandboxRequest(sandbox_id=t.sandbox_id)),
    }


PROBES = _probes()


def probe_all(channel: grpc.Channel, target: Target, token: str = "") -> dict[str, tuple[str, str]]:
    """Each probe's answer: (status code name, details); ("OK", "") when the call succeeded.
    `token`: sent as the bearer token (unit tests tell callers apart by it:
    corral.daemon.testing.callers_by_token)."""
    if token:
        channel = grpc.intercept_channel(channel, _BearerToken(token))
    stubs = Stubs.on(channel)
    answers = {}
    for name, probe in PROBES.items():
        try:
            probe(stubs, target)
            answers[name] = ("OK", "")
        except grpc.RpcError as err:
            answers[name] = (err.code().name, err.details() or "")
    return answers


class _BearerToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, token: str) -> None:
        self.metadata = (("authorization", f"Bearer {token}"),)

    def _details(self, details):
        return details._replace(metadata=(*(details.metadata or ()), *self.metadata))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._details(details), requests)


def not_found_details(sandbox_id: str) -> str:
    """What the daemon says of a sandbox id that does not exist (daemon/sandboxes.py)."""
    return f"no sandbox {sandbox_id!r} on this node"


def make_target(address: str) -> Target:
    """As the owner: a sandbox holding secret.txt, a background process, a kernel and a snapshot."""
    from corral.sdk import Client

    with Client(address) as client:
        sandbox = client.create_sandbox()
        sandbox.write_file("secret.txt", b"the owner's")
        process = sandbox.start_process(["sleep", "600"])
        kernel = sandbox.kernel()
        snapshot = f"snap-{sandbox.id}"
        sandbox.snapshot(snapshot)
        return Target(sandbox.id, kernel.id, process.id, snapshot)


def listing(address: str) -> dict[str, list[str]]:
    """What the caller's lists show: its sandboxes' ids and its snapshots' names."""
    from corral.sdk import Client

    with Client(address) as client:
        return {
            "sandboxes": sorted(sb.id for sb in client.list_sandboxes()),
            "snapshots": sorted(s.name for s in client.list_snapshots()),
        }


def refusal(address: str) -> dict[str, str]:
    """What a caller the socket refuses is told (the error's class and message)."""
    from corral.sdk import Client
    from corral.sdk.errors import CorralError

    try:
        with Client(address, timeout=10) as client:
            client.list_sandboxes()
    except CorralError as err:
        return {"error": type(err).__name__, "message": str(err), "hint": str(getattr(err, "hint", ""))}
    return {"error": "", "message": "", "hint": ""}


if __name__ == "__main__":  # a script, for callers in processes of other users
    action, address = sys.argv[1], sys.argv[2]
    if action == "make":
        answer: object = make_target(address).__dict__
    elif action == "probe":
        with grpc.insecure_channel(address) as channel:
            answer = probe_all(channel, Target(**json.loads(sys.argv[3])))
    elif action == "list":
        answer = listing(address)
    else:
        answer = refusal(address)
    print(json.dumps(answer))
