"""Typed, immutable results of SDK calls: plain Python values, never protobuf messages.

Enums travel as short lower-case strings ("local", "running", "namespaces", ...); an enum value
this SDK does not know (a newer daemon) reads as "unknown".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from corral.sdk.errors import CommandExitError

BackendName = Literal["local", "docker", "singularity"]
SandboxState = Literal["starting", "running", "failed", "stopping", "unspecified", "unknown"]
IsolationLevel = Literal["none", "namespaces", "container", "unspecified", "unknown"]
LimitKind = Literal["memory", "pids", "cpu", "wall_clock", "network", "disk", "unspecified", "unknown"]
FileType = Literal["file", "directory", "symlink", "other", "unspecified", "unknown"]
OutputStreamName = Literal["stdout", "stderr"]
ShellTimeoutReason = Literal["timeout", "idle_timeout"]
KernelState = Literal["idle", "busy", "dead", "unspecified", "unknown"]


@dataclass(frozen=True)
class ResourceLimits:
    """Limits in force; 0 means the daemon applies none beyond its defaults."""

    memory_bytes: int
    pids: int
    cpu_millicores: int
    disk_bytes: int = 0  # the size of its writable space


@dataclass(frozen=True)
class LimitStatus:
    """Whether one kind of limit is really enforced, how (`mechanism`), or why not (`reason`);
    `approximated`: not enforced, but a weaker stand-in that `mechanism` names holds something
    like it (an rlimit per process, say)."""

    kind: LimitKind
    enforced: bool
    mechanism: str
    reason: str
    approximated: bool = False


@dataclass(frozen=True)
class Mount:
    """A host file or directory shown inside a sandbox (`create_sandbox(mounts=...)`), read-only
    unless `writable`. The daemon allows only host paths under the roots its configuration names
    (sandbox.bind_roots), else PermissionDenied; in SandboxInfo, `host_path` is resolved."""

    host_path: str
    sandbox_path: str
    writable: bool = False


@dataclass(frozen=True)
class SandboxInfo:
    id: str
    backend: str
    image: str
    state: SandboxState
    isolation: IsolationLevel
    limits: ResourceLimits
    limit_status: tuple[LimitStatus, ...]
    network: bool
    labels: Mapping[str, str]
    # The default cwd of commands, e.g. "/workspace".
    workdir: str
    created_at: datetime
    # Seconds without any call before the daemon destroys the sandbox; None: never.
    idle_timeout: float | None
    # Who its programs run as unless a call names another; "": the image's own user.
    user: str = ""
    # Its host bind mounts, ordered by sandbox path.
    mounts: tuple[Mount, ...] = ()
    # Its lease: the TTL last set (seconds) and when it expires; None both: no lease.
    lease_ttl: float | None = None
    lease_expires_at: datetime | None = None
    # The idempotency key it was created with; "": none.
    idempotency_key: str = ""
    # Its own block of host ids, where its programs run in a user namespace of their own (local,
    # apptainer): id n inside is host id host_id_first + n, for n < host_id_count (root inside
    # is host uid host_id_first). 0 both: no user namespace of its own (docker, podman).
    host_id_first: int = 0
    host_id_count: int = 0


@dataclass(frozen=True)
class SnapshotInfo:
    """A named snapshot of a sandbox's files (Sandbox.snapshot), which Client.fork_snapshot makes
    sandboxes from."""

    name: str
    sandbox_id: str  # the sandbox it was taken of (which may be gone)
    backend: str
    image: str
    size_bytes: int  # what it holds, shared with its sandbox and those made from it
    created_at: datetime
    labels: Mapping[str, str]


@dataclass(frozen=True)
class ExecResult:
    """How a command ended, with its (possibly truncated) output as bytes."""

    # 128 + signal when killed by a signal, as a shell reports it.
    exit_code: int
    # The signal that killed the main process; 0 when it exited by itself.
    signal: int
    stdout: bytes
    stderr: bytes
    timed_out: bool
    oom_killed: bool
    # True when stdout or stderr was longer than the output limit; each then holds the first and
    # the last half of the limit.
    truncated: bool
    duration_ms: int
    stdout_total_bytes: int
    stderr_total_bytes: int
    # The daemon killed the sandbox's processes, this command's among them, for writing past a
    # disk cap it watches (a daemon without root: docs/local-backend.md, "Limits without root").
    disk_cap_killed: bool = False

    @property
    def ok(self) -> bool:
        """The command exited 0 within its timeout."""
        return self.exit_code == 0 and not self.timed_out

    @property
    def text(self) -> str:
        """stdout decoded as UTF-8; undecodable bytes become U+FFFD."""
        return self.stdout.decode(errors="replace")

    def check(self) -> ExecResult:
        """Returns self when `ok`, else raises CommandExitError carrying this result."""
        if not self.ok:
            raise CommandExitError(self)
        return self


@dataclass(frozen=True)
class ExecStarted:
    """First event of a stream: the command is running. `pid` is daemon-side, for diagnostics."""

    pid: int


@dataclass(frozen=True)
class ExecOutput:
    """A piece of output, exactly as the command wrote it."""

    stream: OutputStreamName
    data: bytes


@dataclass(frozen=True)
class ExecKeepalive:
    """Sent after the requested interval without output, so idle streams stay visibly alive."""


@dataclass(frozen=True)
class ExecExited:
    """Last event of a stream: how the command ended (fields as in ExecResult)."""

    exit_code: int
    signal: int
    timed_out: bool
    oom_killed: bool
    # True when output beyond the output limit was not forwarded.
    truncated: bool
    duration_ms: int
    stdout_total_bytes: int
    stderr_total_bytes: int
    disk_cap_killed: bool = False


ExecEvent = ExecStarted | ExecOutput | ExecKeepalive | ExecExited


@dataclass(frozen=True)
class FileEntry:
    """One entry of a directory inside a sandbox."""

    name: str
    # Absolute path inside the sandbox.
    path: str
    type: FileType
    size_bytes: int
    # Permission bits, e.g. 0o755.
    mode: int
    modified_at: datetime
    # For symlinks, the target as stored (unresolved); None otherwise.
    symlink_target: str | None

    @property
    def is_dir(self) -> bool:
        return self.type == "directory"

    @property
    def is_file(self) -> bool:
        return self.type == "file"


@dataclass(frozen=True)
class BackendStatus:
    """Whether a backend works on this node, what isolation it gives and which limits it enforces."""

    backend: str
    available: bool
    # Why not, when unavailable; the tool it uses when available (e.g. "bubblewrap 0.8.0").
    detail: str
    isolation: IsolationLevel
    limits: tuple[LimitStatus, ...]


@dataclass(frozen=True)
class PoolInfo:
    """A warm pool: `ready` sandboxes (of `size` kept) that matching creates are served from."""

    name: str
    backend: str
    image: str
    size: int
    ready: int
    starting: int


@dataclass(frozen=True)
class DrainState:
    """A node's answer to Client.drain: whether it drains, and whether nothing is left on it."""

    draining: bool
    empty: bool


@dataclass(frozen=True)
class NodeCapacity:
    """What a node runs and has room for (GetNodeInfo). One class of sandbox: slots count against
    daemon.max_sandboxes; `free_slots_default_limits` also counts the memory admission for
    sandboxes of the node's default limits."""

    max_sandboxes: int = 0
    running: int = 0
    starting: int = 0
    free_slots: int = 0
    free_slots_default_limits: int = 0
    # Sums of the live sandboxes' limits (memory: one without a limit counts as the whole node)
    # against what the node has (memory: MemTotal or the daemon's cgroup limit, the smaller; CPU:
    # the daemon's affinity capped by its cgroup quota; disk: free space of its state directory).
    memory_committed_bytes: int = 0
    memory_available_bytes: int = 0
    # What the memory admission lets the limits add up to; 0: no bound.
    memory_admitted_bytes: int = 0
    cpu_committed_millicores: int = 0
    cpu_available_millicores: int = 0
    disk_committed_bytes: int = 0
    disk_available_bytes: int = 0
    # "<backend>:<reference>" of the images the node holds ready, sorted.
    images_cached: tuple[str, ...] = ()


@dataclass(frozen=True)
class NodeInfo:
    version: str
    daemon_id: str
    default_backend: str
    backends: tuple[BackendStatus, ...]
    # "v1", "v2", "hybrid" or "none".
    cgroup_mode: str
    sandbox_count: int
    # The node's warm pools.
    pools: tuple[PoolInfo, ...] = ()
    capacity: NodeCapacity = field(default_factory=NodeCapacity)
    # Draining (Client.drain): it takes no new sandboxes or rollouts; `empty` once nothing is left.
    draining: bool = False
    empty: bool = False
    # The daemon runs without root (its backends' details say what that gives up).
    rootless: bool = False


@dataclass(frozen=True)
class ShellInfo:
    """One named shell session of a sandbox."""

    sandbox_id: str
    name: str
    # The daemon-side process id of the session's shell, for diagnostics.
    pid: int
    # Commands run in the session so far.
    turns: int
    # How many times the shell died (or could not be recovered) and was restarted.
    restarts: int


@dataclass(frozen=True)
class ShellResult:
    """How one command in a shell session ended, with its output.

    `output` is stdout and stderr in the order the command wrote them, as the terminal showed
    them, raw bytes (no CRLF translation); with `separate_stderr`, stdout alone, and stderr is in
    `stderr`.
    """

    output: bytes
    # The command's $?: 130 after an interrupt, 128 + n after signal n.
    exit_code: int
    # The timeout or the idle timeout expired and the command was interrupted; the shell stays usable.
    timed_out: bool
    # Which limit expired when timed_out, else None.
    timeout_reason: ShellTimeoutReason | None
    # True when the output was longer than the output limit; `output` then holds its first and
    # last halves.
    truncated: bool
    output_total_bytes: int
    duration_ms: int
    # The shell died or could not be recovered and was restarted before or during this command:
    # cwd, variables and functions are back to the session's starting state.
    shell_restarted: bool
    # `output` without ANSI escape sequences, when the run asked for `strip_ansi`; else None.
    output_plain: bytes | None
    # What the command wrote to stderr, when the run asked for `separate_stderr`; else None.
    # Capped like `output` (`truncated` covers both).
    stderr: bytes | None = None
    stderr_total_bytes: int = 0
    # The daemon killed the sandbox's processes, this command's among them, for writing past a
    # disk cap it watches (as ExecResult.disk_cap_killed).
    disk_cap_killed: bool = False

    @property
    def ok(self) -> bool:
        """The command exited 0 within its timeout."""
        return self.exit_code == 0 and not self.timed_out

    @property
    def text(self) -> str:
        """`output` decoded as UTF-8; undecodable bytes become U+FFFD."""
        return self.output.decode(errors="replace")

    def check(self) -> ShellResult:
        """Returns self when `ok`, else raises CommandExitError carrying this result."""
        if not self.ok:
            raise CommandExitError(self)
        return self


@dataclass(frozen=True)
class KernelInfo:
    """One IPython kernel of a sandbox."""

    sandbox_id: str
    # Daemon-assigned, e.g. "k-1a2b3c4d"; stays the same across restarts.
    id: str
    state: KernelState
    # Cells executed since the last (re)start.
    execution_count: int
    # The python executable inside the sandbox.
    python: str
    # Times it was restarted: by `restart()` or by a cell that found it dead.
    restarts: int = 0
    # A cell that finds the kernel dead restarts it first (`AsyncSandbox.kernel(auto_restart=)`).
    auto_restart: bool = True


@dataclass(frozen=True)
class KernelErrorInfo:
    """The exception a cell raised."""

    ename: str
    # The message; past the output cap (1 MiB by default) its first and last halves (`truncated`).
    evalue: str
    # Traceback lines, with the kernel's ANSI colours; longer than the output cap together, the
    # lines of its first and last halves (`truncated`).
    traceback: list[str]
    truncated: bool = False
    # UTF-8 bytes of the name, message and traceback before any cut.
    total_bytes: int = 0


@dataclass(frozen=True)
class KernelLateOutput:
    """Output of earlier cells that arrived after their results (printed or displayed by threads
    or child processes they left running, or the rest of a cell whose caller went away), delivered
    with the next cell: as `KernelResult.late_output`, or as the first event of `execute_stream`.
    It is not part of that cell's own output."""

    # Text printed to stdout / stderr; beyond the output cap (1 MiB by default) its first and last halves.
    stdout: str
    stderr: str
    # display_data and execute_result outputs (MIME bundles as in KernelResult), in order.
    displays: list[dict[str, bytes]]
    errors: list[KernelErrorInfo]
    # Text past the cap was cut out of the middle, or displays and errors were dropped (`dropped`).
    truncated: bool
    # UTF-8 bytes printed, including those cut out.
    stdout_total_bytes: int
    stderr_total_bytes: int
    # Displays and errors dropped whole.
    dropped: int


@dataclass(frozen=True)
class KernelResult:
    """Everything one cell produced, gathered.

    Rich outputs are MIME bundles: MIME type to content; text types (text/plain, text/html,
    application/json, ...) are UTF-8 bytes, binary types (image/png, ...) the decoded bytes.
    """

    # Everything printed to stdout / stderr, concatenated. Beyond the output cap (1 MiB by
    # default): its first and last halves (`truncated`).
    stdout: str
    stderr: str
    # The value of the cell's last expression, when there was one. Each text value past the output
    # cap keeps its first and last halves, and past 16 MiB together the rest is dropped
    # (`result_truncated`, `result_total_bytes`).
    result: dict[str, bytes] | None
    # display_data outputs, in order (up to 16 MiB of data: `displays_dropped` counts the rest).
    displays: list[dict[str, bytes]]
    # Set when the cell raised (sys.exit() too: IPython catches SystemExit, the kernel goes on).
    error: KernelErrorInfo | None
    # 0 when the cell did not run (the kernel had died before it).
    execution_count: int
    # The timeout expired and the kernel was interrupted; the kernel stays usable.
    timed_out: bool
    # The kernel process is gone: it died while running the cell, the cell called exit(), or (for
    # a kernel started with auto_restart=False) it had died since the previous cell, and this cell
    # did not run. `exit_code`, `signal` and `oom_killed` say why. The next cell restarts it
    # (`restarted`); with auto_restart=False, `Kernel.restart()` brings it back.
    kernel_died: bool
    duration_ms: int
    # stdout or stderr was longer than the output cap, displays were dropped, or the value or the
    # error was cut.
    truncated: bool = False
    # UTF-8 bytes printed to stdout / stderr, including those cut out.
    stdout_total_bytes: int = 0
    stderr_total_bytes: int = 0
    displays_dropped: int = 0
    # When kernel_died: the kernel's exit code (128 + signal when killed by one) and the signal.
    exit_code: int = 0
    signal: int = 0
    # The out-of-memory killer killed a process of the sandbox during the cell (memory limit).
    oom_killed: bool = False
    # The kernel was dead when the cell came and was restarted before it ran: every variable and
    # import of the earlier cells is gone. `restart_reason`: why it had died, in words.
    restarted: bool = False
    restart_reason: str = ""
    # The value was cut (see `result`), and the bytes of all its data before the cut.
    result_truncated: bool = False
    result_total_bytes: int = 0
    # Output of earlier cells that arrived after their results, or None.
    late_output: KernelLateOutput | None = None

    @property
    def ok(self) -> bool:
        """The cell ran to the end without raising, timing out or killing the kernel."""
        return self.error is None and not self.timed_out and not self.kernel_died

    @property
    def result_text(self) -> str | None:
        """The last expression's text/plain representation (e.g. "42"), or None."""
        if self.result is None or "text/plain" not in self.result:
            return None
        return self.result["text/plain"].decode(errors="replace")


@dataclass(frozen=True)
class KernelStreamEvent:
    """Text the cell printed."""

    name: OutputStreamName
    text: str


@dataclass(frozen=True)
class KernelDisplayEvent:
    """A display_data output (MIME bundle as in KernelResult)."""

    data: dict[str, bytes]


@dataclass(frozen=True)
class KernelResultEvent:
    """The value of the cell's last expression (MIME bundle, cut, as in KernelResult)."""

    data: dict[str, bytes]
    truncated: bool = False
    total_bytes: int = 0


@dataclass(frozen=True)
class KernelErrorEvent:
    """The cell raised (fields as in KernelErrorInfo)."""

    ename: str
    evalue: str
    traceback: list[str]
    truncated: bool = False
    total_bytes: int = 0


@dataclass(frozen=True)
class KernelDoneEvent:
    """Last event of a cell: how it ended (fields as in KernelResult)."""

    execution_count: int
    # The cell raised (a KernelErrorEvent came before this one).
    failed: bool
    timed_out: bool
    kernel_died: bool
    duration_ms: int
    # Output past the cap was not sent: each of stdout and stderr is streamed up to the output cap
    # (1 MiB by default), displays up to 16 MiB; the totals count everything.
    truncated: bool = False
    stdout_total_bytes: int = 0
    stderr_total_bytes: int = 0
    displays_dropped: int = 0
    exit_code: int = 0
    signal: int = 0
    oom_killed: bool = False
    restarted: bool = False
    restart_reason: str = ""


KernelEvent = (
    KernelLateOutput | KernelStreamEvent | KernelDisplayEvent | KernelResultEvent | KernelErrorEvent | KernelDoneEvent
)


# -- rollouts ----------------------------------------------------------------------------------

RolloutStatus = Literal["completed", "filtered", "cancelled", "unspecified", "unknown"]
# Why an infrastructure failure filtered a rollout (never a reward).
FilterReason = Literal[
    "sandbox_start",
    "backend_crash",
    "llm_unreachable",
    "eval_infra",
    "shutdown",
    "staleness",
    "stage_timeout",
    "harness_failed",
    "history_rewritten",
    "fork_failed",
    "node_lost",
    "unspecified",
    "unknown",
]
FinishReason = Literal["submitted", "max_turns", "context_full", "timeout", "unparsable", "unspecified", "unknown"]
# Where a rollout's evaluation ran (docs/rollouts.md, "Evaluation the agent cannot influence"):
# the agent's own sandbox, a fork of the set-up sandbox's snapshot, a new sandbox set up again;
# "unspecified" when none ran.
EvalSandbox = Literal["in_place", "snapshot_fork", "new", "unspecified", "unknown"]
LLMProtocolName = Literal["sglang", "vllm"]


@dataclass(frozen=True)
class ToolCallRecord:
    name: str
    # The arguments as a JSON object (text, as the model wrote them after parsing).
    arguments_json: str


@dataclass(frozen=True)
class RolloutTurn:
    """One agent turn: the ids the LLM generated (with logprobs and the weight version that made
    them), the tool calls parsed from them, and the ids appended after them (template and
    observation, loss mask 0)."""

    rollout_id: str
    index: int
    generated_ids: list[int]
    generated_logprobs: list[float]
    weight_version: int
    tool_calls: list[ToolCallRecord]
    observation_ids: list[int]
    format_error: bool
    llm_finish_reason: str
    llm_address: str
    llm_time_ms: int
    tool_time_ms: int


@dataclass(frozen=True)
class RolloutSample:
    """One more token sequence of a harness rollout whose history was not append-only; laid out
    as RolloutResult's trajectory fields."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float]
    weight_versions: list[int]
    turns: list[RolloutTurn]


@dataclass(frozen=True)
class GatewayCounters:
    """What the LLM gateway saw of a harness rollout."""

    calls: int
    # Calls whose re-rendered prompt equalled the recorded ids plus the new messages.
    prefix_hits: int
    # Calls whose re-rendering differed: the recorded ids were kept.
    splices: int
    # New samples started because the history was not append-only.
    splits: int
    # Samples delivered with response_mask all 0 (history policy "mask").
    masked_samples: int
    # Calls whose reply the harness dropped (it sent the same conversation again).
    discarded: int


@dataclass(frozen=True)
class RolloutResult:
    """A finished rollout. Use `reward` only when `status == "completed"`; a "filtered" result is
    an infrastructure failure (`filter_reason`, `error`), not a zero reward.

    The trajectory is token-exact: prompt_ids + response_ids is the sequence the LLM saw, built by
    appending exactly what it generated and the ids of each observation. response_mask (1 for
    generated tokens), response_logprobs and weight_versions (-1 where mask is 0) have one entry
    per response id.
    """

    rollout_id: str
    task_id: str
    group_id: str
    sample_index: int
    status: RolloutStatus
    filter_reason: FilterReason | None
    error: str
    reward: float
    finish_reason: FinishReason | None
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float]
    weight_versions: list[int]
    turns: list[RolloutTurn]
    # The conversation as text: [{"role": ..., "content": ...}], the prompt first.
    messages: list[dict[str, str]]
    # Seconds: "init_queue", "init", "fork", "run_queue", "run", "eval_queue", "eval", "total".
    # With INIT once, "init" is the INIT shared with others and "fork" what made this sandbox. A
    # clean evaluation's parts, within "eval": "eval_change" (reading the agent's change) and
    # "eval_sandbox" (getting the clean sandbox).
    timings: Mapping[str, float]
    format_errors: int
    eval_output: bytes
    metadata: Mapping[str, str]
    # A harness rollout's samples after the first (in the fields above), when its history was not
    # append-only.
    extra_samples: list[RolloutSample] = field(default_factory=list)
    # Set for harness rollouts.
    gateway: GatewayCounters | None = None
    # INIT once (docs/rollouts.md): how many rollouts shared this one's INIT (0: its own), and
    # whether it was to share one but the backend cannot fork.
    init_shared_by: int = 0
    init_fell_back: bool = False
    eval_sandbox: EvalSandbox = "unspecified"

    @property
    def completed(self) -> bool:
        return self.status == "completed"


@dataclass(frozen=True)
class LLMServerInfo:
    address: str
    protocol: LLMProtocolName | Literal["unknown"]
    weight: int
    model: str
    in_flight: int
    healthy: bool
    requests: int
    failures: int


@dataclass(frozen=True)
class StageStats:
    queued: int
    in_flight: int
    workers: int
    completed: int
    throughput_per_s: float


@dataclass(frozen=True)
class RolloutStats:
    init: StageStats
    run: StageStats
    eval: StageStats
    llm_servers: list[LLMServerInfo]
    policy_version: int
    results_completed: int
    results_filtered: int
    results_cancelled: int
