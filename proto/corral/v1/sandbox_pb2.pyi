from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Backend(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BACKEND_UNSPECIFIED: _ClassVar[Backend]
    BACKEND_LOCAL: _ClassVar[Backend]
    BACKEND_DOCKER: _ClassVar[Backend]
    BACKEND_SINGULARITY: _ClassVar[Backend]

class IsolationLevel(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ISOLATION_LEVEL_UNSPECIFIED: _ClassVar[IsolationLevel]
    ISOLATION_LEVEL_NONE: _ClassVar[IsolationLevel]
    ISOLATION_LEVEL_NAMESPACES: _ClassVar[IsolationLevel]
    ISOLATION_LEVEL_CONTAINER: _ClassVar[IsolationLevel]

class SandboxState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SANDBOX_STATE_UNSPECIFIED: _ClassVar[SandboxState]
    SANDBOX_STATE_STARTING: _ClassVar[SandboxState]
    SANDBOX_STATE_RUNNING: _ClassVar[SandboxState]
    SANDBOX_STATE_FAILED: _ClassVar[SandboxState]
    SANDBOX_STATE_STOPPING: _ClassVar[SandboxState]

class LimitKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LIMIT_KIND_UNSPECIFIED: _ClassVar[LimitKind]
    LIMIT_KIND_MEMORY: _ClassVar[LimitKind]
    LIMIT_KIND_PIDS: _ClassVar[LimitKind]
    LIMIT_KIND_CPU: _ClassVar[LimitKind]
    LIMIT_KIND_WALL_CLOCK: _ClassVar[LimitKind]
    LIMIT_KIND_NETWORK: _ClassVar[LimitKind]
    LIMIT_KIND_DISK: _ClassVar[LimitKind]

class OutputStream(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTPUT_STREAM_UNSPECIFIED: _ClassVar[OutputStream]
    OUTPUT_STREAM_STDOUT: _ClassVar[OutputStream]
    OUTPUT_STREAM_STDERR: _ClassVar[OutputStream]

class FileType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FILE_TYPE_UNSPECIFIED: _ClassVar[FileType]
    FILE_TYPE_FILE: _ClassVar[FileType]
    FILE_TYPE_DIRECTORY: _ClassVar[FileType]
    FILE_TYPE_SYMLINK: _ClassVar[FileType]
    FILE_TYPE_OTHER: _ClassVar[FileType]
BACKEND_UNSPECIFIED: Backend
BACKEND_LOCAL: Backend
BACKEND_DOCKER: Backend
BACKEND_SINGULARITY: Backend
ISOLATION_LEVEL_UNSPECIFIED: IsolationLevel
ISOLATION_LEVEL_NONE: IsolationLevel
ISOLATION_LEVEL_NAMESPACES: IsolationLevel
ISOLATION_LEVEL_CONTAINER: IsolationLevel
SANDBOX_STATE_UNSPECIFIED: SandboxState
SANDBOX_STATE_STARTING: SandboxState
SANDBOX_STATE_RUNNING: SandboxState
SANDBOX_STATE_FAILED: SandboxState
SANDBOX_STATE_STOPPING: SandboxState
LIMIT_KIND_UNSPECIFIED: LimitKind
LIMIT_KIND_MEMORY: LimitKind
LIMIT_KIND_PIDS: LimitKind
LIMIT_KIND_CPU: LimitKind
LIMIT_KIND_WALL_CLOCK: LimitKind
LIMIT_KIND_NETWORK: LimitKind
LIMIT_KIND_DISK: LimitKind
OUTPUT_STREAM_UNSPECIFIED: OutputStream
OUTPUT_STREAM_STDOUT: OutputStream
OUTPUT_STREAM_STDERR: OutputStream
FILE_TYPE_UNSPECIFIED: FileType
FILE_TYPE_FILE: FileType
FILE_TYPE_DIRECTORY: FileType
FILE_TYPE_SYMLINK: FileType
FILE_TYPE_OTHER: FileType

class ResourceLimits(_message.Message):
    __slots__ = ("memory_bytes", "pids", "cpu_millicores", "disk_bytes")
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PIDS_FIELD_NUMBER: _ClassVar[int]
    CPU_MILLICORES_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    memory_bytes: int
    pids: int
    cpu_millicores: int
    disk_bytes: int
    def __init__(self, memory_bytes: _Optional[int] = ..., pids: _Optional[int] = ..., cpu_millicores: _Optional[int] = ..., disk_bytes: _Optional[int] = ...) -> None: ...

class LimitStatus(_message.Message):
    __slots__ = ("kind", "enforced", "mechanism", "reason", "approximated")
    KIND_FIELD_NUMBER: _ClassVar[int]
    ENFORCED_FIELD_NUMBER: _ClassVar[int]
    MECHANISM_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    APPROXIMATED_FIELD_NUMBER: _ClassVar[int]
    kind: LimitKind
    enforced: bool
    mechanism: str
    reason: str
    approximated: bool
    def __init__(self, kind: _Optional[_Union[LimitKind, str]] = ..., enforced: _Optional[bool] = ..., mechanism: _Optional[str] = ..., reason: _Optional[str] = ..., approximated: _Optional[bool] = ...) -> None: ...

class Sandbox(_message.Message):
    __slots__ = ("sandbox_id", "backend", "image", "state", "isolation", "limits", "limit_status", "network", "labels", "created_at_unix_ms", "workdir", "idle_timeout_ms", "user", "mounts", "lease_ttl_ms", "lease_expires_at_unix_ms", "idempotency_key", "host_id_first", "host_id_count")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ISOLATION_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    LIMIT_STATUS_FIELD_NUMBER: _ClassVar[int]
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    WORKDIR_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    MOUNTS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIRST_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_COUNT_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    backend: Backend
    image: str
    state: SandboxState
    isolation: IsolationLevel
    limits: ResourceLimits
    limit_status: _containers.RepeatedCompositeFieldContainer[LimitStatus]
    network: bool
    labels: _containers.ScalarMap[str, str]
    created_at_unix_ms: int
    workdir: str
    idle_timeout_ms: int
    user: str
    mounts: _containers.RepeatedCompositeFieldContainer[BindMount]
    lease_ttl_ms: int
    lease_expires_at_unix_ms: int
    idempotency_key: str
    host_id_first: int
    host_id_count: int
    def __init__(self, sandbox_id: _Optional[str] = ..., backend: _Optional[_Union[Backend, str]] = ..., image: _Optional[str] = ..., state: _Optional[_Union[SandboxState, str]] = ..., isolation: _Optional[_Union[IsolationLevel, str]] = ..., limits: _Optional[_Union[ResourceLimits, _Mapping]] = ..., limit_status: _Optional[_Iterable[_Union[LimitStatus, _Mapping]]] = ..., network: _Optional[bool] = ..., labels: _Optional[_Mapping[str, str]] = ..., created_at_unix_ms: _Optional[int] = ..., workdir: _Optional[str] = ..., idle_timeout_ms: _Optional[int] = ..., user: _Optional[str] = ..., mounts: _Optional[_Iterable[_Union[BindMount, _Mapping]]] = ..., lease_ttl_ms: _Optional[int] = ..., lease_expires_at_unix_ms: _Optional[int] = ..., idempotency_key: _Optional[str] = ..., host_id_first: _Optional[int] = ..., host_id_count: _Optional[int] = ...) -> None: ...

class BindMount(_message.Message):
    __slots__ = ("host_path", "sandbox_path", "writable")
    HOST_PATH_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_PATH_FIELD_NUMBER: _ClassVar[int]
    WRITABLE_FIELD_NUMBER: _ClassVar[int]
    host_path: str
    sandbox_path: str
    writable: bool
    def __init__(self, host_path: _Optional[str] = ..., sandbox_path: _Optional[str] = ..., writable: _Optional[bool] = ...) -> None: ...

class CreateSandboxRequest(_message.Message):
    __slots__ = ("backend", "image", "limits", "network", "env", "labels", "idle_timeout_ms", "user", "mounts", "lease_ttl_ms", "idempotency_key")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    MOUNTS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    backend: Backend
    image: str
    limits: ResourceLimits
    network: bool
    env: _containers.ScalarMap[str, str]
    labels: _containers.ScalarMap[str, str]
    idle_timeout_ms: int
    user: str
    mounts: _containers.RepeatedCompositeFieldContainer[BindMount]
    lease_ttl_ms: int
    idempotency_key: str
    def __init__(self, backend: _Optional[_Union[Backend, str]] = ..., image: _Optional[str] = ..., limits: _Optional[_Union[ResourceLimits, _Mapping]] = ..., network: _Optional[bool] = ..., env: _Optional[_Mapping[str, str]] = ..., labels: _Optional[_Mapping[str, str]] = ..., idle_timeout_ms: _Optional[int] = ..., user: _Optional[str] = ..., mounts: _Optional[_Iterable[_Union[BindMount, _Mapping]]] = ..., lease_ttl_ms: _Optional[int] = ..., idempotency_key: _Optional[str] = ...) -> None: ...

class CreateSandboxResponse(_message.Message):
    __slots__ = ("sandbox",)
    SANDBOX_FIELD_NUMBER: _ClassVar[int]
    sandbox: Sandbox
    def __init__(self, sandbox: _Optional[_Union[Sandbox, _Mapping]] = ...) -> None: ...

class GetSandboxRequest(_message.Message):
    __slots__ = ("sandbox_id",)
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    def __init__(self, sandbox_id: _Optional[str] = ...) -> None: ...

class GetSandboxResponse(_message.Message):
    __slots__ = ("sandbox",)
    SANDBOX_FIELD_NUMBER: _ClassVar[int]
    sandbox: Sandbox
    def __init__(self, sandbox: _Optional[_Union[Sandbox, _Mapping]] = ...) -> None: ...

class ListSandboxesRequest(_message.Message):
    __slots__ = ("labels",)
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    LABELS_FIELD_NUMBER: _ClassVar[int]
    labels: _containers.ScalarMap[str, str]
    def __init__(self, labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ListSandboxesResponse(_message.Message):
    __slots__ = ("sandboxes",)
    SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    sandboxes: _containers.RepeatedCompositeFieldContainer[Sandbox]
    def __init__(self, sandboxes: _Optional[_Iterable[_Union[Sandbox, _Mapping]]] = ...) -> None: ...

class DestroySandboxRequest(_message.Message):
    __slots__ = ("sandbox_id",)
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    def __init__(self, sandbox_id: _Optional[str] = ...) -> None: ...

class DestroySandboxResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ForkSandboxRequest(_message.Message):
    __slots__ = ("sandbox_id", "count", "labels", "snapshot", "lease_ttl_ms")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    count: int
    labels: _containers.ScalarMap[str, str]
    snapshot: str
    lease_ttl_ms: int
    def __init__(self, sandbox_id: _Optional[str] = ..., count: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ..., snapshot: _Optional[str] = ..., lease_ttl_ms: _Optional[int] = ...) -> None: ...

class ForkSandboxResponse(_message.Message):
    __slots__ = ("sandboxes",)
    SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    sandboxes: _containers.RepeatedCompositeFieldContainer[Sandbox]
    def __init__(self, sandboxes: _Optional[_Iterable[_Union[Sandbox, _Mapping]]] = ...) -> None: ...

class Snapshot(_message.Message):
    __slots__ = ("name", "sandbox_id", "backend", "image", "size_bytes", "created_at_unix_ms", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    name: str
    sandbox_id: str
    backend: Backend
    image: str
    size_bytes: int
    created_at_unix_ms: int
    labels: _containers.ScalarMap[str, str]
    def __init__(self, name: _Optional[str] = ..., sandbox_id: _Optional[str] = ..., backend: _Optional[_Union[Backend, str]] = ..., image: _Optional[str] = ..., size_bytes: _Optional[int] = ..., created_at_unix_ms: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SnapshotSandboxRequest(_message.Message):
    __slots__ = ("sandbox_id", "name")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    name: str
    def __init__(self, sandbox_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class SnapshotSandboxResponse(_message.Message):
    __slots__ = ("snapshot",)
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    snapshot: Snapshot
    def __init__(self, snapshot: _Optional[_Union[Snapshot, _Mapping]] = ...) -> None: ...

class ListSnapshotsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSnapshotsResponse(_message.Message):
    __slots__ = ("snapshots",)
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    snapshots: _containers.RepeatedCompositeFieldContainer[Snapshot]
    def __init__(self, snapshots: _Optional[_Iterable[_Union[Snapshot, _Mapping]]] = ...) -> None: ...

class DeleteSnapshotRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteSnapshotResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Argv(_message.Message):
    __slots__ = ("args",)
    ARGS_FIELD_NUMBER: _ClassVar[int]
    args: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, args: _Optional[_Iterable[str]] = ...) -> None: ...

class Command(_message.Message):
    __slots__ = ("argv", "shell", "stdin", "env", "cwd", "timeout_ms", "output_limit_bytes", "user")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ARGV_FIELD_NUMBER: _ClassVar[int]
    SHELL_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    argv: Argv
    shell: str
    stdin: bytes
    env: _containers.ScalarMap[str, str]
    cwd: str
    timeout_ms: int
    output_limit_bytes: int
    user: str
    def __init__(self, argv: _Optional[_Union[Argv, _Mapping]] = ..., shell: _Optional[str] = ..., stdin: _Optional[bytes] = ..., env: _Optional[_Mapping[str, str]] = ..., cwd: _Optional[str] = ..., timeout_ms: _Optional[int] = ..., output_limit_bytes: _Optional[int] = ..., user: _Optional[str] = ...) -> None: ...

class ExitStatus(_message.Message):
    __slots__ = ("exit_code", "signal", "timed_out", "oom_killed", "duration_ms", "disk_cap_killed")
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    OOM_KILLED_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    DISK_CAP_KILLED_FIELD_NUMBER: _ClassVar[int]
    exit_code: int
    signal: int
    timed_out: bool
    oom_killed: bool
    duration_ms: int
    disk_cap_killed: bool
    def __init__(self, exit_code: _Optional[int] = ..., signal: _Optional[int] = ..., timed_out: _Optional[bool] = ..., oom_killed: _Optional[bool] = ..., duration_ms: _Optional[int] = ..., disk_cap_killed: _Optional[bool] = ...) -> None: ...

class ExecRequest(_message.Message):
    __slots__ = ("sandbox_id", "command")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    command: Command
    def __init__(self, sandbox_id: _Optional[str] = ..., command: _Optional[_Union[Command, _Mapping]] = ...) -> None: ...

class ExecResponse(_message.Message):
    __slots__ = ("status", "stdout", "stderr", "truncated", "stdout_total_bytes", "stderr_total_bytes")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    STDOUT_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    STDERR_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    status: ExitStatus
    stdout: bytes
    stderr: bytes
    truncated: bool
    stdout_total_bytes: int
    stderr_total_bytes: int
    def __init__(self, status: _Optional[_Union[ExitStatus, _Mapping]] = ..., stdout: _Optional[bytes] = ..., stderr: _Optional[bytes] = ..., truncated: _Optional[bool] = ..., stdout_total_bytes: _Optional[int] = ..., stderr_total_bytes: _Optional[int] = ...) -> None: ...

class ExecStreamRequest(_message.Message):
    __slots__ = ("sandbox_id", "command", "keepalive_interval_ms")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    command: Command
    keepalive_interval_ms: int
    def __init__(self, sandbox_id: _Optional[str] = ..., command: _Optional[_Union[Command, _Mapping]] = ..., keepalive_interval_ms: _Optional[int] = ...) -> None: ...

class ExecStreamResponse(_message.Message):
    __slots__ = ("started", "output", "keepalive", "exited")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_FIELD_NUMBER: _ClassVar[int]
    EXITED_FIELD_NUMBER: _ClassVar[int]
    started: ExecStarted
    output: ExecOutput
    keepalive: ExecKeepalive
    exited: ExecExited
    def __init__(self, started: _Optional[_Union[ExecStarted, _Mapping]] = ..., output: _Optional[_Union[ExecOutput, _Mapping]] = ..., keepalive: _Optional[_Union[ExecKeepalive, _Mapping]] = ..., exited: _Optional[_Union[ExecExited, _Mapping]] = ...) -> None: ...

class ExecStarted(_message.Message):
    __slots__ = ("pid",)
    PID_FIELD_NUMBER: _ClassVar[int]
    pid: int
    def __init__(self, pid: _Optional[int] = ...) -> None: ...

class ExecOutput(_message.Message):
    __slots__ = ("stream", "data")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    stream: OutputStream
    data: bytes
    def __init__(self, stream: _Optional[_Union[OutputStream, str]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ExecKeepalive(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExecExited(_message.Message):
    __slots__ = ("status", "truncated", "stdout_total_bytes", "stderr_total_bytes")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    STDOUT_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    STDERR_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    status: ExitStatus
    truncated: bool
    stdout_total_bytes: int
    stderr_total_bytes: int
    def __init__(self, status: _Optional[_Union[ExitStatus, _Mapping]] = ..., truncated: _Optional[bool] = ..., stdout_total_bytes: _Optional[int] = ..., stderr_total_bytes: _Optional[int] = ...) -> None: ...

class ReadFileRequest(_message.Message):
    __slots__ = ("sandbox_id", "path", "offset", "limit_bytes")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    path: str
    offset: int
    limit_bytes: int
    def __init__(self, sandbox_id: _Optional[str] = ..., path: _Optional[str] = ..., offset: _Optional[int] = ..., limit_bytes: _Optional[int] = ...) -> None: ...

class ReadFileResponse(_message.Message):
    __slots__ = ("data", "size_bytes", "truncated")
    DATA_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    size_bytes: int
    truncated: bool
    def __init__(self, data: _Optional[bytes] = ..., size_bytes: _Optional[int] = ..., truncated: _Optional[bool] = ...) -> None: ...

class WriteFileRequest(_message.Message):
    __slots__ = ("sandbox_id", "path", "data", "mode", "make_parents")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    MAKE_PARENTS_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    path: str
    data: bytes
    mode: int
    make_parents: bool
    def __init__(self, sandbox_id: _Optional[str] = ..., path: _Optional[str] = ..., data: _Optional[bytes] = ..., mode: _Optional[int] = ..., make_parents: _Optional[bool] = ...) -> None: ...

class WriteFileResponse(_message.Message):
    __slots__ = ("bytes_written",)
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    bytes_written: int
    def __init__(self, bytes_written: _Optional[int] = ...) -> None: ...

class FileInfo(_message.Message):
    __slots__ = ("name", "path", "type", "size_bytes", "mode", "modified_unix_ms", "symlink_target")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    MODIFIED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    SYMLINK_TARGET_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    type: FileType
    size_bytes: int
    mode: int
    modified_unix_ms: int
    symlink_target: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., type: _Optional[_Union[FileType, str]] = ..., size_bytes: _Optional[int] = ..., mode: _Optional[int] = ..., modified_unix_ms: _Optional[int] = ..., symlink_target: _Optional[str] = ...) -> None: ...

class ListDirRequest(_message.Message):
    __slots__ = ("sandbox_id", "path")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    path: str
    def __init__(self, sandbox_id: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class ListDirResponse(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[FileInfo]
    def __init__(self, entries: _Optional[_Iterable[_Union[FileInfo, _Mapping]]] = ...) -> None: ...

class UploadRequest(_message.Message):
    __slots__ = ("start", "chunk")
    START_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    start: UploadStart
    chunk: bytes
    def __init__(self, start: _Optional[_Union[UploadStart, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class UploadStart(_message.Message):
    __slots__ = ("sandbox_id", "path")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    path: str
    def __init__(self, sandbox_id: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class UploadResponse(_message.Message):
    __slots__ = ("archive_bytes",)
    ARCHIVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    archive_bytes: int
    def __init__(self, archive_bytes: _Optional[int] = ...) -> None: ...

class DownloadRequest(_message.Message):
    __slots__ = ("sandbox_id", "path")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    path: str
    def __init__(self, sandbox_id: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class DownloadResponse(_message.Message):
    __slots__ = ("chunk",)
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    chunk: bytes
    def __init__(self, chunk: _Optional[bytes] = ...) -> None: ...

class GetNodeInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("sandbox_id", "ttl_ms")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    ttl_ms: int
    def __init__(self, sandbox_id: _Optional[str] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class RenewLeaseResponse(_message.Message):
    __slots__ = ("sandbox",)
    SANDBOX_FIELD_NUMBER: _ClassVar[int]
    sandbox: Sandbox
    def __init__(self, sandbox: _Optional[_Union[Sandbox, _Mapping]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("drain",)
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    drain: bool
    def __init__(self, drain: _Optional[bool] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("draining", "empty")
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    EMPTY_FIELD_NUMBER: _ClassVar[int]
    draining: bool
    empty: bool
    def __init__(self, draining: _Optional[bool] = ..., empty: _Optional[bool] = ...) -> None: ...

class BackendInfo(_message.Message):
    __slots__ = ("backend", "available", "detail", "isolation", "limits")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    ISOLATION_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    backend: Backend
    available: bool
    detail: str
    isolation: IsolationLevel
    limits: _containers.RepeatedCompositeFieldContainer[LimitStatus]
    def __init__(self, backend: _Optional[_Union[Backend, str]] = ..., available: _Optional[bool] = ..., detail: _Optional[str] = ..., isolation: _Optional[_Union[IsolationLevel, str]] = ..., limits: _Optional[_Iterable[_Union[LimitStatus, _Mapping]]] = ...) -> None: ...

class GetNodeInfoResponse(_message.Message):
    __slots__ = ("version", "daemon_id", "default_backend", "backends", "cgroup_mode", "sandbox_count", "pools", "capacity", "draining", "empty", "rootless")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DAEMON_ID_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_BACKEND_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    CGROUP_MODE_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_COUNT_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    EMPTY_FIELD_NUMBER: _ClassVar[int]
    ROOTLESS_FIELD_NUMBER: _ClassVar[int]
    version: str
    daemon_id: str
    default_backend: Backend
    backends: _containers.RepeatedCompositeFieldContainer[BackendInfo]
    cgroup_mode: str
    sandbox_count: int
    pools: _containers.RepeatedCompositeFieldContainer[PoolInfo]
    capacity: NodeCapacity
    draining: bool
    empty: bool
    rootless: bool
    def __init__(self, version: _Optional[str] = ..., daemon_id: _Optional[str] = ..., default_backend: _Optional[_Union[Backend, str]] = ..., backends: _Optional[_Iterable[_Union[BackendInfo, _Mapping]]] = ..., cgroup_mode: _Optional[str] = ..., sandbox_count: _Optional[int] = ..., pools: _Optional[_Iterable[_Union[PoolInfo, _Mapping]]] = ..., capacity: _Optional[_Union[NodeCapacity, _Mapping]] = ..., draining: _Optional[bool] = ..., empty: _Optional[bool] = ..., rootless: _Optional[bool] = ...) -> None: ...

class NodeCapacity(_message.Message):
    __slots__ = ("max_sandboxes", "running", "starting", "free_slots", "free_slots_default_limits", "memory_committed_bytes", "memory_available_bytes", "memory_admitted_bytes", "cpu_committed_millicores", "cpu_available_millicores", "disk_committed_bytes", "disk_available_bytes", "images_cached")
    MAX_SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    STARTING_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_DEFAULT_LIMITS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_COMMITTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_AVAILABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_ADMITTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CPU_COMMITTED_MILLICORES_FIELD_NUMBER: _ClassVar[int]
    CPU_AVAILABLE_MILLICORES_FIELD_NUMBER: _ClassVar[int]
    DISK_COMMITTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_AVAILABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    IMAGES_CACHED_FIELD_NUMBER: _ClassVar[int]
    max_sandboxes: int
    running: int
    starting: int
    free_slots: int
    free_slots_default_limits: int
    memory_committed_bytes: int
    memory_available_bytes: int
    memory_admitted_bytes: int
    cpu_committed_millicores: int
    cpu_available_millicores: int
    disk_committed_bytes: int
    disk_available_bytes: int
    images_cached: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, max_sandboxes: _Optional[int] = ..., running: _Optional[int] = ..., starting: _Optional[int] = ..., free_slots: _Optional[int] = ..., free_slots_default_limits: _Optional[int] = ..., memory_committed_bytes: _Optional[int] = ..., memory_available_bytes: _Optional[int] = ..., memory_admitted_bytes: _Optional[int] = ..., cpu_committed_millicores: _Optional[int] = ..., cpu_available_millicores: _Optional[int] = ..., disk_committed_bytes: _Optional[int] = ..., disk_available_bytes: _Optional[int] = ..., images_cached: _Optional[_Iterable[str]] = ...) -> None: ...

class PoolInfo(_message.Message):
    __slots__ = ("name", "backend", "image", "size", "ready", "starting")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    STARTING_FIELD_NUMBER: _ClassVar[int]
    name: str
    backend: Backend
    image: str
    size: int
    ready: int
    starting: int
    def __init__(self, name: _Optional[str] = ..., backend: _Optional[_Union[Backend, str]] = ..., image: _Optional[str] = ..., size: _Optional[int] = ..., ready: _Optional[int] = ..., starting: _Optional[int] = ...) -> None: ...
