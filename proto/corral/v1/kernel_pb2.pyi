from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KernelState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KERNEL_STATE_UNSPECIFIED: _ClassVar[KernelState]
    KERNEL_STATE_IDLE: _ClassVar[KernelState]
    KERNEL_STATE_BUSY: _ClassVar[KernelState]
    KERNEL_STATE_DEAD: _ClassVar[KernelState]

class StreamName(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STREAM_NAME_UNSPECIFIED: _ClassVar[StreamName]
    STREAM_NAME_STDOUT: _ClassVar[StreamName]
    STREAM_NAME_STDERR: _ClassVar[StreamName]
KERNEL_STATE_UNSPECIFIED: KernelState
KERNEL_STATE_IDLE: KernelState
KERNEL_STATE_BUSY: KernelState
KERNEL_STATE_DEAD: KernelState
STREAM_NAME_UNSPECIFIED: StreamName
STREAM_NAME_STDOUT: StreamName
STREAM_NAME_STDERR: StreamName

class KernelInfo(_message.Message):
    __slots__ = ("sandbox_id", "kernel_id", "state", "execution_count", "python", "restarts", "auto_restart")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    KERNEL_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_COUNT_FIELD_NUMBER: _ClassVar[int]
    PYTHON_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    AUTO_RESTART_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    kernel_id: str
    state: KernelState
    execution_count: int
    python: str
    restarts: int
    auto_restart: bool
    def __init__(self, sandbox_id: _Optional[str] = ..., kernel_id: _Optional[str] = ..., state: _Optional[_Union[KernelState, str]] = ..., execution_count: _Optional[int] = ..., python: _Optional[str] = ..., restarts: _Optional[int] = ..., auto_restart: _Optional[bool] = ...) -> None: ...

class StartKernelRequest(_message.Message):
    __slots__ = ("sandbox_id", "python", "cwd", "env", "user", "auto_restart")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PYTHON_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    AUTO_RESTART_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    python: str
    cwd: str
    env: _containers.ScalarMap[str, str]
    user: str
    auto_restart: bool
    def __init__(self, sandbox_id: _Optional[str] = ..., python: _Optional[str] = ..., cwd: _Optional[str] = ..., env: _Optional[_Mapping[str, str]] = ..., user: _Optional[str] = ..., auto_restart: _Optional[bool] = ...) -> None: ...

class StartKernelResponse(_message.Message):
    __slots__ = ("kernel",)
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    kernel: KernelInfo
    def __init__(self, kernel: _Optional[_Union[KernelInfo, _Mapping]] = ...) -> None: ...

class ExecuteRequest(_message.Message):
    __slots__ = ("sandbox_id", "kernel_id", "code", "timeout_ms")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    KERNEL_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    kernel_id: str
    code: str
    timeout_ms: int
    def __init__(self, sandbox_id: _Optional[str] = ..., kernel_id: _Optional[str] = ..., code: _Optional[str] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class KernelStream(_message.Message):
    __slots__ = ("name", "text")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    name: StreamName
    text: str
    def __init__(self, name: _Optional[_Union[StreamName, str]] = ..., text: _Optional[str] = ...) -> None: ...

class KernelDisplay(_message.Message):
    __slots__ = ("data", "truncated", "total_bytes")
    class DataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    DATA_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    data: _containers.ScalarMap[str, bytes]
    truncated: bool
    total_bytes: int
    def __init__(self, data: _Optional[_Mapping[str, bytes]] = ..., truncated: _Optional[bool] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class KernelError(_message.Message):
    __slots__ = ("ename", "evalue", "traceback", "truncated", "total_bytes")
    ENAME_FIELD_NUMBER: _ClassVar[int]
    EVALUE_FIELD_NUMBER: _ClassVar[int]
    TRACEBACK_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    ename: str
    evalue: str
    traceback: _containers.RepeatedScalarFieldContainer[str]
    truncated: bool
    total_bytes: int
    def __init__(self, ename: _Optional[str] = ..., evalue: _Optional[str] = ..., traceback: _Optional[_Iterable[str]] = ..., truncated: _Optional[bool] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class KernelDone(_message.Message):
    __slots__ = ("execution_count", "failed", "timed_out", "kernel_died", "duration_ms", "exit_code", "signal", "oom_killed", "truncated", "stdout_total_bytes", "stderr_total_bytes", "displays_dropped", "restarted", "restart_reason")
    EXECUTION_COUNT_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    KERNEL_DIED_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    OOM_KILLED_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    STDOUT_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    STDERR_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISPLAYS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    RESTARTED_FIELD_NUMBER: _ClassVar[int]
    RESTART_REASON_FIELD_NUMBER: _ClassVar[int]
    execution_count: int
    failed: bool
    timed_out: bool
    kernel_died: bool
    duration_ms: int
    exit_code: int
    signal: int
    oom_killed: bool
    truncated: bool
    stdout_total_bytes: int
    stderr_total_bytes: int
    displays_dropped: int
    restarted: bool
    restart_reason: str
    def __init__(self, execution_count: _Optional[int] = ..., failed: _Optional[bool] = ..., timed_out: _Optional[bool] = ..., kernel_died: _Optional[bool] = ..., duration_ms: _Optional[int] = ..., exit_code: _Optional[int] = ..., signal: _Optional[int] = ..., oom_killed: _Optional[bool] = ..., truncated: _Optional[bool] = ..., stdout_total_bytes: _Optional[int] = ..., stderr_total_bytes: _Optional[int] = ..., displays_dropped: _Optional[int] = ..., restarted: _Optional[bool] = ..., restart_reason: _Optional[str] = ...) -> None: ...

class KernelLateOutput(_message.Message):
    __slots__ = ("stdout", "stderr", "displays", "errors", "truncated", "stdout_total_bytes", "stderr_total_bytes", "dropped")
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    DISPLAYS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    STDOUT_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    STDERR_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    stdout: str
    stderr: str
    displays: _containers.RepeatedCompositeFieldContainer[KernelDisplay]
    errors: _containers.RepeatedCompositeFieldContainer[KernelError]
    truncated: bool
    stdout_total_bytes: int
    stderr_total_bytes: int
    dropped: int
    def __init__(self, stdout: _Optional[str] = ..., stderr: _Optional[str] = ..., displays: _Optional[_Iterable[_Union[KernelDisplay, _Mapping]]] = ..., errors: _Optional[_Iterable[_Union[KernelError, _Mapping]]] = ..., truncated: _Optional[bool] = ..., stdout_total_bytes: _Optional[int] = ..., stderr_total_bytes: _Optional[int] = ..., dropped: _Optional[int] = ...) -> None: ...

class ExecuteResponse(_message.Message):
    __slots__ = ("stream", "display", "result", "error", "done", "late_output")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    DISPLAY_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    LATE_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    stream: KernelStream
    display: KernelDisplay
    result: KernelDisplay
    error: KernelError
    done: KernelDone
    late_output: KernelLateOutput
    def __init__(self, stream: _Optional[_Union[KernelStream, _Mapping]] = ..., display: _Optional[_Union[KernelDisplay, _Mapping]] = ..., result: _Optional[_Union[KernelDisplay, _Mapping]] = ..., error: _Optional[_Union[KernelError, _Mapping]] = ..., done: _Optional[_Union[KernelDone, _Mapping]] = ..., late_output: _Optional[_Union[KernelLateOutput, _Mapping]] = ...) -> None: ...

class ExecuteGatheredRequest(_message.Message):
    __slots__ = ("sandbox_id", "kernel_id", "code", "timeout_ms")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    KERNEL_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    kernel_id: str
    code: str
    timeout_ms: int
    def __init__(self, sandbox_id: _Optional[str] = ..., kernel_id: _Optional[str] = ..., code: _Optional[str] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class ExecuteGatheredResponse(_message.Message):
    __slots__ = ("stdout", "stderr", "result", "displays", "error", "done", "truncated", "late_output")
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    DISPLAYS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    LATE_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    stdout: str
    stderr: str
    result: KernelDisplay
    displays: _containers.RepeatedCompositeFieldContainer[KernelDisplay]
    error: KernelError
    done: KernelDone
    truncated: bool
    late_output: KernelLateOutput
    def __init__(self, stdout: _Optional[str] = ..., stderr: _Optional[str] = ..., result: _Optional[_Union[KernelDisplay, _Mapping]] = ..., displays: _Optional[_Iterable[_Union[KernelDisplay, _Mapping]]] = ..., error: _Optional[_Union[KernelError, _Mapping]] = ..., done: _Optional[_Union[KernelDone, _Mapping]] = ..., truncated: _Optional[bool] = ..., late_output: _Optional[_Union[KernelLateOutput, _Mapping]] = ...) -> None: ...

class InterruptKernelRequest(_message.Message):
    __slots__ = ("sandbox_id", "kernel_id")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    KERNEL_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    kernel_id: str
    def __init__(self, sandbox_id: _Optional[str] = ..., kernel_id: _Optional[str] = ...) -> None: ...

class InterruptKernelResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RestartKernelRequest(_message.Message):
    __slots__ = ("sandbox_id", "kernel_id")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    KERNEL_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    kernel_id: str
    def __init__(self, sandbox_id: _Optional[str] = ..., kernel_id: _Optional[str] = ...) -> None: ...

class RestartKernelResponse(_message.Message):
    __slots__ = ("kernel",)
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    kernel: KernelInfo
    def __init__(self, kernel: _Optional[_Union[KernelInfo, _Mapping]] = ...) -> None: ...

class ShutdownKernelRequest(_message.Message):
    __slots__ = ("sandbox_id", "kernel_id")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    KERNEL_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    kernel_id: str
    def __init__(self, sandbox_id: _Optional[str] = ..., kernel_id: _Optional[str] = ...) -> None: ...

class ShutdownKernelResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListKernelsRequest(_message.Message):
    __slots__ = ("sandbox_id",)
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    def __init__(self, sandbox_id: _Optional[str] = ...) -> None: ...

class ListKernelsResponse(_message.Message):
    __slots__ = ("kernels",)
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    kernels: _containers.RepeatedCompositeFieldContainer[KernelInfo]
    def __init__(self, kernels: _Optional[_Iterable[_Union[KernelInfo, _Mapping]]] = ...) -> None: ...
