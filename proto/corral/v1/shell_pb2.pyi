from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TerminalSize(_message.Message):
    __slots__ = ("rows", "cols")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    COLS_FIELD_NUMBER: _ClassVar[int]
    rows: int
    cols: int
    def __init__(self, rows: _Optional[int] = ..., cols: _Optional[int] = ...) -> None: ...

class ShellInfo(_message.Message):
    __slots__ = ("sandbox_id", "name", "pid", "turns", "restarts")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    name: str
    pid: int
    turns: int
    restarts: int
    def __init__(self, sandbox_id: _Optional[str] = ..., name: _Optional[str] = ..., pid: _Optional[int] = ..., turns: _Optional[int] = ..., restarts: _Optional[int] = ...) -> None: ...

class OpenShellRequest(_message.Message):
    __slots__ = ("sandbox_id", "name", "env", "cwd", "size", "program", "user")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    name: str
    env: _containers.ScalarMap[str, str]
    cwd: str
    size: TerminalSize
    program: str
    user: str
    def __init__(self, sandbox_id: _Optional[str] = ..., name: _Optional[str] = ..., env: _Optional[_Mapping[str, str]] = ..., cwd: _Optional[str] = ..., size: _Optional[_Union[TerminalSize, _Mapping]] = ..., program: _Optional[str] = ..., user: _Optional[str] = ...) -> None: ...

class OpenShellResponse(_message.Message):
    __slots__ = ("shell",)
    SHELL_FIELD_NUMBER: _ClassVar[int]
    shell: ShellInfo
    def __init__(self, shell: _Optional[_Union[ShellInfo, _Mapping]] = ...) -> None: ...

class RunInShellRequest(_message.Message):
    __slots__ = ("sandbox_id", "name", "command", "timeout_ms", "idle_timeout_ms", "output_limit_bytes", "strip_ansi", "separate_stderr")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    STRIP_ANSI_FIELD_NUMBER: _ClassVar[int]
    SEPARATE_STDERR_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    name: str
    command: str
    timeout_ms: int
    idle_timeout_ms: int
    output_limit_bytes: int
    strip_ansi: bool
    separate_stderr: bool
    def __init__(self, sandbox_id: _Optional[str] = ..., name: _Optional[str] = ..., command: _Optional[str] = ..., timeout_ms: _Optional[int] = ..., idle_timeout_ms: _Optional[int] = ..., output_limit_bytes: _Optional[int] = ..., strip_ansi: _Optional[bool] = ..., separate_stderr: _Optional[bool] = ...) -> None: ...

class RunInShellResponse(_message.Message):
    __slots__ = ("output", "exit_code", "timed_out", "timeout_reason", "truncated", "output_total_bytes", "duration_ms", "shell_restarted", "output_plain", "stderr", "stderr_total_bytes", "disk_cap_killed")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_REASON_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    SHELL_RESTARTED_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_PLAIN_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    STDERR_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_CAP_KILLED_FIELD_NUMBER: _ClassVar[int]
    output: bytes
    exit_code: int
    timed_out: bool
    timeout_reason: str
    truncated: bool
    output_total_bytes: int
    duration_ms: int
    shell_restarted: bool
    output_plain: bytes
    stderr: bytes
    stderr_total_bytes: int
    disk_cap_killed: bool
    def __init__(self, output: _Optional[bytes] = ..., exit_code: _Optional[int] = ..., timed_out: _Optional[bool] = ..., timeout_reason: _Optional[str] = ..., truncated: _Optional[bool] = ..., output_total_bytes: _Optional[int] = ..., duration_ms: _Optional[int] = ..., shell_restarted: _Optional[bool] = ..., output_plain: _Optional[bytes] = ..., stderr: _Optional[bytes] = ..., stderr_total_bytes: _Optional[int] = ..., disk_cap_killed: _Optional[bool] = ...) -> None: ...

class CloseShellRequest(_message.Message):
    __slots__ = ("sandbox_id", "name")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    name: str
    def __init__(self, sandbox_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class CloseShellResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListShellsRequest(_message.Message):
    __slots__ = ("sandbox_id",)
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    def __init__(self, sandbox_id: _Optional[str] = ...) -> None: ...

class ListShellsResponse(_message.Message):
    __slots__ = ("shells",)
    SHELLS_FIELD_NUMBER: _ClassVar[int]
    shells: _containers.RepeatedCompositeFieldContainer[ShellInfo]
    def __init__(self, shells: _Optional[_Iterable[_Union[ShellInfo, _Mapping]]] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("start", "input", "resize", "signal")
    START_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    RESIZE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    start: AttachStart
    input: bytes
    resize: TerminalSize
    signal: int
    def __init__(self, start: _Optional[_Union[AttachStart, _Mapping]] = ..., input: _Optional[bytes] = ..., resize: _Optional[_Union[TerminalSize, _Mapping]] = ..., signal: _Optional[int] = ...) -> None: ...

class AttachStart(_message.Message):
    __slots__ = ("sandbox_id", "size", "term", "program", "user")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    size: TerminalSize
    term: str
    program: str
    user: str
    def __init__(self, sandbox_id: _Optional[str] = ..., size: _Optional[_Union[TerminalSize, _Mapping]] = ..., term: _Optional[str] = ..., program: _Optional[str] = ..., user: _Optional[str] = ...) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("output", "exited")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    EXITED_FIELD_NUMBER: _ClassVar[int]
    output: bytes
    exited: AttachExited
    def __init__(self, output: _Optional[bytes] = ..., exited: _Optional[_Union[AttachExited, _Mapping]] = ...) -> None: ...

class AttachExited(_message.Message):
    __slots__ = ("exit_code",)
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    exit_code: int
    def __init__(self, exit_code: _Optional[int] = ...) -> None: ...

class ProcessInfo(_message.Message):
    __slots__ = ("sandbox_id", "process_id", "argv", "pid", "running", "exit_code", "output_end", "output_start")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    ARGV_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_END_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_START_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    process_id: str
    argv: _containers.RepeatedScalarFieldContainer[str]
    pid: int
    running: bool
    exit_code: int
    output_end: int
    output_start: int
    def __init__(self, sandbox_id: _Optional[str] = ..., process_id: _Optional[str] = ..., argv: _Optional[_Iterable[str]] = ..., pid: _Optional[int] = ..., running: _Optional[bool] = ..., exit_code: _Optional[int] = ..., output_end: _Optional[int] = ..., output_start: _Optional[int] = ...) -> None: ...

class StartProcessRequest(_message.Message):
    __slots__ = ("sandbox_id", "argv", "shell", "env", "cwd", "user", "size", "term", "interactive", "buffer_bytes")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    ARGV_FIELD_NUMBER: _ClassVar[int]
    SHELL_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    INTERACTIVE_FIELD_NUMBER: _ClassVar[int]
    BUFFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    argv: _containers.RepeatedScalarFieldContainer[str]
    shell: str
    env: _containers.ScalarMap[str, str]
    cwd: str
    user: str
    size: TerminalSize
    term: str
    interactive: bool
    buffer_bytes: int
    def __init__(self, sandbox_id: _Optional[str] = ..., argv: _Optional[_Iterable[str]] = ..., shell: _Optional[str] = ..., env: _Optional[_Mapping[str, str]] = ..., cwd: _Optional[str] = ..., user: _Optional[str] = ..., size: _Optional[_Union[TerminalSize, _Mapping]] = ..., term: _Optional[str] = ..., interactive: _Optional[bool] = ..., buffer_bytes: _Optional[int] = ...) -> None: ...

class StartProcessResponse(_message.Message):
    __slots__ = ("process",)
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    process: ProcessInfo
    def __init__(self, process: _Optional[_Union[ProcessInfo, _Mapping]] = ...) -> None: ...

class ReadProcessOutputRequest(_message.Message):
    __slots__ = ("sandbox_id", "process_id", "offset", "max_bytes", "wait_ms")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    process_id: str
    offset: int
    max_bytes: int
    wait_ms: int
    def __init__(self, sandbox_id: _Optional[str] = ..., process_id: _Optional[str] = ..., offset: _Optional[int] = ..., max_bytes: _Optional[int] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class ReadProcessOutputResponse(_message.Message):
    __slots__ = ("data", "offset", "dropped_bytes", "next_offset", "process")
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DROPPED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NEXT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    offset: int
    dropped_bytes: int
    next_offset: int
    process: ProcessInfo
    def __init__(self, data: _Optional[bytes] = ..., offset: _Optional[int] = ..., dropped_bytes: _Optional[int] = ..., next_offset: _Optional[int] = ..., process: _Optional[_Union[ProcessInfo, _Mapping]] = ...) -> None: ...

class WriteProcessInputRequest(_message.Message):
    __slots__ = ("sandbox_id", "process_id", "data")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    process_id: str
    data: bytes
    def __init__(self, sandbox_id: _Optional[str] = ..., process_id: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class WriteProcessInputResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SignalProcessRequest(_message.Message):
    __slots__ = ("sandbox_id", "process_id", "signal")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    process_id: str
    signal: int
    def __init__(self, sandbox_id: _Optional[str] = ..., process_id: _Optional[str] = ..., signal: _Optional[int] = ...) -> None: ...

class SignalProcessResponse(_message.Message):
    __slots__ = ("process",)
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    process: ProcessInfo
    def __init__(self, process: _Optional[_Union[ProcessInfo, _Mapping]] = ...) -> None: ...

class WaitProcessRequest(_message.Message):
    __slots__ = ("sandbox_id", "process_id", "timeout_ms")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    process_id: str
    timeout_ms: int
    def __init__(self, sandbox_id: _Optional[str] = ..., process_id: _Optional[str] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class WaitProcessResponse(_message.Message):
    __slots__ = ("process",)
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    process: ProcessInfo
    def __init__(self, process: _Optional[_Union[ProcessInfo, _Mapping]] = ...) -> None: ...

class CloseProcessRequest(_message.Message):
    __slots__ = ("sandbox_id", "process_id")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    process_id: str
    def __init__(self, sandbox_id: _Optional[str] = ..., process_id: _Optional[str] = ...) -> None: ...

class CloseProcessResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListProcessesRequest(_message.Message):
    __slots__ = ("sandbox_id",)
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    def __init__(self, sandbox_id: _Optional[str] = ...) -> None: ...

class ListProcessesResponse(_message.Message):
    __slots__ = ("processes",)
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    processes: _containers.RepeatedCompositeFieldContainer[ProcessInfo]
    def __init__(self, processes: _Optional[_Iterable[_Union[ProcessInfo, _Mapping]]] = ...) -> None: ...
