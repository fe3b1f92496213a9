from corral.v1 import sandbox_pb2 as _sandbox_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HarnessPlace(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HARNESS_PLACE_UNSPECIFIED: _ClassVar[HarnessPlace]
    HARNESS_PLACE_HOST: _ClassVar[HarnessPlace]
    HARNESS_PLACE_SANDBOX: _ClassVar[HarnessPlace]

class HistoryPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HISTORY_POLICY_UNSPECIFIED: _ClassVar[HistoryPolicy]
    HISTORY_POLICY_SPLIT: _ClassVar[HistoryPolicy]
    HISTORY_POLICY_MASK: _ClassVar[HistoryPolicy]
    HISTORY_POLICY_FAIL: _ClassVar[HistoryPolicy]

class ToolCallFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOOL_CALL_FORMAT_UNSPECIFIED: _ClassVar[ToolCallFormat]
    TOOL_CALL_FORMAT_HERMES: _ClassVar[ToolCallFormat]
    TOOL_CALL_FORMAT_FENCED_BASH: _ClassVar[ToolCallFormat]

class EvaluationIsolation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVALUATION_ISOLATION_UNSPECIFIED: _ClassVar[EvaluationIsolation]
    EVALUATION_ISOLATION_CLEAN_SANDBOX: _ClassVar[EvaluationIsolation]
    EVALUATION_ISOLATION_IN_PLACE: _ClassVar[EvaluationIsolation]

class RolloutStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLLOUT_STATUS_UNSPECIFIED: _ClassVar[RolloutStatus]
    ROLLOUT_STATUS_COMPLETED: _ClassVar[RolloutStatus]
    ROLLOUT_STATUS_FILTERED: _ClassVar[RolloutStatus]
    ROLLOUT_STATUS_CANCELLED: _ClassVar[RolloutStatus]

class FilterReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FILTER_REASON_UNSPECIFIED: _ClassVar[FilterReason]
    FILTER_REASON_SANDBOX_START: _ClassVar[FilterReason]
    FILTER_REASON_BACKEND_CRASH: _ClassVar[FilterReason]
    FILTER_REASON_LLM_UNREACHABLE: _ClassVar[FilterReason]
    FILTER_REASON_EVAL_INFRA: _ClassVar[FilterReason]
    FILTER_REASON_SHUTDOWN: _ClassVar[FilterReason]
    FILTER_REASON_STALENESS: _ClassVar[FilterReason]
    FILTER_REASON_STAGE_TIMEOUT: _ClassVar[FilterReason]
    FILTER_REASON_HARNESS_FAILED: _ClassVar[FilterReason]
    FILTER_REASON_HISTORY_REWRITTEN: _ClassVar[FilterReason]
    FILTER_REASON_FORK_FAILED: _ClassVar[FilterReason]
    FILTER_REASON_NODE_LOST: _ClassVar[FilterReason]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_SUBMITTED: _ClassVar[FinishReason]
    FINISH_REASON_MAX_TURNS: _ClassVar[FinishReason]
    FINISH_REASON_CONTEXT_FULL: _ClassVar[FinishReason]
    FINISH_REASON_TIMEOUT: _ClassVar[FinishReason]
    FINISH_REASON_UNPARSABLE: _ClassVar[FinishReason]

class EvalSandbox(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVAL_SANDBOX_UNSPECIFIED: _ClassVar[EvalSandbox]
    EVAL_SANDBOX_IN_PLACE: _ClassVar[EvalSandbox]
    EVAL_SANDBOX_SNAPSHOT_FORK: _ClassVar[EvalSandbox]
    EVAL_SANDBOX_NEW: _ClassVar[EvalSandbox]

class LLMProtocol(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LLM_PROTOCOL_UNSPECIFIED: _ClassVar[LLMProtocol]
    LLM_PROTOCOL_SGLANG: _ClassVar[LLMProtocol]
    LLM_PROTOCOL_VLLM: _ClassVar[LLMProtocol]
HARNESS_PLACE_UNSPECIFIED: HarnessPlace
HARNESS_PLACE_HOST: HarnessPlace
HARNESS_PLACE_SANDBOX: HarnessPlace
HISTORY_POLICY_UNSPECIFIED: HistoryPolicy
HISTORY_POLICY_SPLIT: HistoryPolicy
HISTORY_POLICY_MASK: HistoryPolicy
HISTORY_POLICY_FAIL: HistoryPolicy
TOOL_CALL_FORMAT_UNSPECIFIED: ToolCallFormat
TOOL_CALL_FORMAT_HERMES: ToolCallFormat
TOOL_CALL_FORMAT_FENCED_BASH: ToolCallFormat
EVALUATION_ISOLATION_UNSPECIFIED: EvaluationIsolation
EVALUATION_ISOLATION_CLEAN_SANDBOX: EvaluationIsolation
EVALUATION_ISOLATION_IN_PLACE: EvaluationIsolation
ROLLOUT_STATUS_UNSPECIFIED: RolloutStatus
ROLLOUT_STATUS_COMPLETED: RolloutStatus
ROLLOUT_STATUS_FILTERED: RolloutStatus
ROLLOUT_STATUS_CANCELLED: RolloutStatus
FILTER_REASON_UNSPECIFIED: FilterReason
FILTER_REASON_SANDBOX_START: FilterReason
FILTER_REASON_BACKEND_CRASH: FilterReason
FILTER_REASON_LLM_UNREACHABLE: FilterReason
FILTER_REASON_EVAL_INFRA: FilterReason
FILTER_REASON_SHUTDOWN: FilterReason
FILTER_REASON_STALENESS: FilterReason
FILTER_REASON_STAGE_TIMEOUT: FilterReason
FILTER_REASON_HARNESS_FAILED: FilterReason
FILTER_REASON_HISTORY_REWRITTEN: FilterReason
FILTER_REASON_FORK_FAILED: FilterReason
FILTER_REASON_NODE_LOST: FilterReason
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_SUBMITTED: FinishReason
FINISH_REASON_MAX_TURNS: FinishReason
FINISH_REASON_CONTEXT_FULL: FinishReason
FINISH_REASON_TIMEOUT: FinishReason
FINISH_REASON_UNPARSABLE: FinishReason
EVAL_SANDBOX_UNSPECIFIED: EvalSandbox
EVAL_SANDBOX_IN_PLACE: EvalSandbox
EVAL_SANDBOX_SNAPSHOT_FORK: EvalSandbox
EVAL_SANDBOX_NEW: EvalSandbox
LLM_PROTOCOL_UNSPECIFIED: LLMProtocol
LLM_PROTOCOL_SGLANG: LLMProtocol
LLM_PROTOCOL_VLLM: LLMProtocol

class Task(_message.Message):
    __slots__ = ("task_id", "backend", "image", "resources", "setup", "prompt", "tools", "tool_call_format", "limits", "evaluation", "sampling", "reference_solution", "metadata", "user", "harness", "setup_key")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    SETUP_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_FORMAT_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    EVALUATION_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_SOLUTION_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    HARNESS_FIELD_NUMBER: _ClassVar[int]
    SETUP_KEY_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    backend: _sandbox_pb2.Backend
    image: str
    resources: _sandbox_pb2.ResourceLimits
    setup: TaskSetup
    prompt: TaskPrompt
    tools: _containers.RepeatedScalarFieldContainer[str]
    tool_call_format: ToolCallFormat
    limits: TaskLimits
    evaluation: TaskEvaluation
    sampling: SamplingParams
    reference_solution: _containers.RepeatedCompositeFieldContainer[ToolCall]
    metadata: _containers.ScalarMap[str, str]
    user: str
    harness: TaskHarness
    setup_key: str
    def __init__(self, task_id: _Optional[str] = ..., backend: _Optional[_Union[_sandbox_pb2.Backend, str]] = ..., image: _Optional[str] = ..., resources: _Optional[_Union[_sandbox_pb2.ResourceLimits, _Mapping]] = ..., setup: _Optional[_Union[TaskSetup, _Mapping]] = ..., prompt: _Optional[_Union[TaskPrompt, _Mapping]] = ..., tools: _Optional[_Iterable[str]] = ..., tool_call_format: _Optional[_Union[ToolCallFormat, str]] = ..., limits: _Optional[_Union[TaskLimits, _Mapping]] = ..., evaluation: _Optional[_Union[TaskEvaluation, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., reference_solution: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., metadata: _Optional[_Mapping[str, str]] = ..., user: _Optional[str] = ..., harness: _Optional[_Union[TaskHarness, _Mapping]] = ..., setup_key: _Optional[str] = ...) -> None: ...

class TaskHarness(_message.Message):
    __slots__ = ("command", "env", "place", "workdir", "history_policy")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    PLACE_FIELD_NUMBER: _ClassVar[int]
    WORKDIR_FIELD_NUMBER: _ClassVar[int]
    HISTORY_POLICY_FIELD_NUMBER: _ClassVar[int]
    command: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.ScalarMap[str, str]
    place: HarnessPlace
    workdir: str
    history_policy: HistoryPolicy
    def __init__(self, command: _Optional[_Iterable[str]] = ..., env: _Optional[_Mapping[str, str]] = ..., place: _Optional[_Union[HarnessPlace, str]] = ..., workdir: _Optional[str] = ..., history_policy: _Optional[_Union[HistoryPolicy, str]] = ...) -> None: ...

class TaskFile(_message.Message):
    __slots__ = ("path", "content", "mode")
    PATH_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    path: str
    content: bytes
    mode: int
    def __init__(self, path: _Optional[str] = ..., content: _Optional[bytes] = ..., mode: _Optional[int] = ...) -> None: ...

class TaskSetup(_message.Message):
    __slots__ = ("files", "commands", "per_rollout")
    FILES_FIELD_NUMBER: _ClassVar[int]
    COMMANDS_FIELD_NUMBER: _ClassVar[int]
    PER_ROLLOUT_FIELD_NUMBER: _ClassVar[int]
    files: _containers.RepeatedCompositeFieldContainer[TaskFile]
    commands: _containers.RepeatedScalarFieldContainer[str]
    per_rollout: bool
    def __init__(self, files: _Optional[_Iterable[_Union[TaskFile, _Mapping]]] = ..., commands: _Optional[_Iterable[str]] = ..., per_rollout: _Optional[bool] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class TaskPrompt(_message.Message):
    __slots__ = ("messages", "fields")
    class FieldsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    fields: _containers.ScalarMap[str, str]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., fields: _Optional[_Mapping[str, str]] = ...) -> None: ...

class TaskLimits(_message.Message):
    __slots__ = ("max_turns", "max_new_tokens_per_turn", "max_total_tokens", "action_timeout_ms", "init_timeout_ms", "run_timeout_ms", "eval_timeout_ms", "max_observation_bytes")
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_PER_TURN_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACTION_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    INIT_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    RUN_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    EVAL_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_OBSERVATION_BYTES_FIELD_NUMBER: _ClassVar[int]
    max_turns: int
    max_new_tokens_per_turn: int
    max_total_tokens: int
    action_timeout_ms: int
    init_timeout_ms: int
    run_timeout_ms: int
    eval_timeout_ms: int
    max_observation_bytes: int
    def __init__(self, max_turns: _Optional[int] = ..., max_new_tokens_per_turn: _Optional[int] = ..., max_total_tokens: _Optional[int] = ..., action_timeout_ms: _Optional[int] = ..., init_timeout_ms: _Optional[int] = ..., run_timeout_ms: _Optional[int] = ..., eval_timeout_ms: _Optional[int] = ..., max_observation_bytes: _Optional[int] = ...) -> None: ...

class TaskEvaluation(_message.Message):
    __slots__ = ("files", "commands", "isolation", "change", "exit_status", "printed_number", "junit", "expected_observations")
    FILES_FIELD_NUMBER: _ClassVar[int]
    COMMANDS_FIELD_NUMBER: _ClassVar[int]
    ISOLATION_FIELD_NUMBER: _ClassVar[int]
    CHANGE_FIELD_NUMBER: _ClassVar[int]
    EXIT_STATUS_FIELD_NUMBER: _ClassVar[int]
    PRINTED_NUMBER_FIELD_NUMBER: _ClassVar[int]
    JUNIT_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    files: _containers.RepeatedCompositeFieldContainer[TaskFile]
    commands: _containers.RepeatedScalarFieldContainer[str]
    isolation: EvaluationIsolation
    change: TaskChange
    exit_status: ExitStatusReward
    printed_number: PrintedNumberReward
    junit: JUnitReward
    expected_observations: ExpectedObservationsReward
    def __init__(self, files: _Optional[_Iterable[_Union[TaskFile, _Mapping]]] = ..., commands: _Optional[_Iterable[str]] = ..., isolation: _Optional[_Union[EvaluationIsolation, str]] = ..., change: _Optional[_Union[TaskChange, _Mapping]] = ..., exit_status: _Optional[_Union[ExitStatusReward, _Mapping]] = ..., printed_number: _Optional[_Union[PrintedNumberReward, _Mapping]] = ..., junit: _Optional[_Union[JUnitReward, _Mapping]] = ..., expected_observations: _Optional[_Union[ExpectedObservationsReward, _Mapping]] = ...) -> None: ...

class TaskChange(_message.Message):
    __slots__ = ("root", "extra_paths", "protected_paths")
    ROOT_FIELD_NUMBER: _ClassVar[int]
    EXTRA_PATHS_FIELD_NUMBER: _ClassVar[int]
    PROTECTED_PATHS_FIELD_NUMBER: _ClassVar[int]
    root: str
    extra_paths: _containers.RepeatedScalarFieldContainer[str]
    protected_paths: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, root: _Optional[str] = ..., extra_paths: _Optional[_Iterable[str]] = ..., protected_paths: _Optional[_Iterable[str]] = ...) -> None: ...

class ExitStatusReward(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrintedNumberReward(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class JUnitReward(_message.Message):
    __slots__ = ("report_path", "tests", "all_must_pass")
    REPORT_PATH_FIELD_NUMBER: _ClassVar[int]
    TESTS_FIELD_NUMBER: _ClassVar[int]
    ALL_MUST_PASS_FIELD_NUMBER: _ClassVar[int]
    report_path: str
    tests: _containers.RepeatedScalarFieldContainer[str]
    all_must_pass: bool
    def __init__(self, report_path: _Optional[str] = ..., tests: _Optional[_Iterable[str]] = ..., all_must_pass: _Optional[bool] = ...) -> None: ...

class ExpectedObservationsReward(_message.Message):
    __slots__ = ("expected", "partial_credit")
    class ExpectedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_CREDIT_FIELD_NUMBER: _ClassVar[int]
    expected: _containers.ScalarMap[str, str]
    partial_credit: bool
    def __init__(self, expected: _Optional[_Mapping[str, str]] = ..., partial_credit: _Optional[bool] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "stop")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("name", "arguments_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    arguments_json: str
    def __init__(self, name: _Optional[str] = ..., arguments_json: _Optional[str] = ...) -> None: ...

class Turn(_message.Message):
    __slots__ = ("index", "generated_ids", "generated_logprobs", "weight_version", "tool_calls", "observation_ids", "format_error", "llm_finish_reason", "llm_time_ms", "tool_time_ms", "rollout_id", "llm_address")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    GENERATED_IDS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_IDS_FIELD_NUMBER: _ClassVar[int]
    FORMAT_ERROR_FIELD_NUMBER: _ClassVar[int]
    LLM_FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LLM_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    TOOL_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    LLM_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    index: int
    generated_ids: _containers.RepeatedScalarFieldContainer[int]
    generated_logprobs: _containers.RepeatedScalarFieldContainer[float]
    weight_version: int
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    observation_ids: _containers.RepeatedScalarFieldContainer[int]
    format_error: bool
    llm_finish_reason: str
    llm_time_ms: int
    tool_time_ms: int
    rollout_id: str
    llm_address: str
    def __init__(self, index: _Optional[int] = ..., generated_ids: _Optional[_Iterable[int]] = ..., generated_logprobs: _Optional[_Iterable[float]] = ..., weight_version: _Optional[int] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., observation_ids: _Optional[_Iterable[int]] = ..., format_error: _Optional[bool] = ..., llm_finish_reason: _Optional[str] = ..., llm_time_ms: _Optional[int] = ..., tool_time_ms: _Optional[int] = ..., rollout_id: _Optional[str] = ..., llm_address: _Optional[str] = ...) -> None: ...

class GatewayCounters(_message.Message):
    __slots__ = ("calls", "prefix_hits", "splices", "splits", "masked_samples", "discarded")
    CALLS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HITS_FIELD_NUMBER: _ClassVar[int]
    SPLICES_FIELD_NUMBER: _ClassVar[int]
    SPLITS_FIELD_NUMBER: _ClassVar[int]
    MASKED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    DISCARDED_FIELD_NUMBER: _ClassVar[int]
    calls: int
    prefix_hits: int
    splices: int
    splits: int
    masked_samples: int
    discarded: int
    def __init__(self, calls: _Optional[int] = ..., prefix_hits: _Optional[int] = ..., splices: _Optional[int] = ..., splits: _Optional[int] = ..., masked_samples: _Optional[int] = ..., discarded: _Optional[int] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("prompt_ids", "response_ids", "response_mask", "response_logprobs", "weight_versions", "turns")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_MASK_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    response_ids: _containers.RepeatedScalarFieldContainer[int]
    response_mask: _containers.RepeatedScalarFieldContainer[int]
    response_logprobs: _containers.RepeatedScalarFieldContainer[float]
    weight_versions: _containers.RepeatedScalarFieldContainer[int]
    turns: _containers.RepeatedCompositeFieldContainer[Turn]
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., response_ids: _Optional[_Iterable[int]] = ..., response_mask: _Optional[_Iterable[int]] = ..., response_logprobs: _Optional[_Iterable[float]] = ..., weight_versions: _Optional[_Iterable[int]] = ..., turns: _Optional[_Iterable[_Union[Turn, _Mapping]]] = ...) -> None: ...

class StageTimings(_message.Message):
    __slots__ = ("init_queue_ms", "init_ms", "run_queue_ms", "run_ms", "eval_queue_ms", "eval_ms", "total_ms", "fork_ms", "init_shared_by", "init_fell_back", "eval_change_ms", "eval_sandbox_ms", "eval_sandbox")
    INIT_QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    INIT_MS_FIELD_NUMBER: _ClassVar[int]
    RUN_QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    RUN_MS_FIELD_NUMBER: _ClassVar[int]
    EVAL_QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    EVAL_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    FORK_MS_FIELD_NUMBER: _ClassVar[int]
    INIT_SHARED_BY_FIELD_NUMBER: _ClassVar[int]
    INIT_FELL_BACK_FIELD_NUMBER: _ClassVar[int]
    EVAL_CHANGE_MS_FIELD_NUMBER: _ClassVar[int]
    EVAL_SANDBOX_MS_FIELD_NUMBER: _ClassVar[int]
    EVAL_SANDBOX_FIELD_NUMBER: _ClassVar[int]
    init_queue_ms: int
    init_ms: int
    run_queue_ms: int
    run_ms: int
    eval_queue_ms: int
    eval_ms: int
    total_ms: int
    fork_ms: int
    init_shared_by: int
    init_fell_back: bool
    eval_change_ms: int
    eval_sandbox_ms: int
    eval_sandbox: EvalSandbox
    def __init__(self, init_queue_ms: _Optional[int] = ..., init_ms: _Optional[int] = ..., run_queue_ms: _Optional[int] = ..., run_ms: _Optional[int] = ..., eval_queue_ms: _Optional[int] = ..., eval_ms: _Optional[int] = ..., total_ms: _Optional[int] = ..., fork_ms: _Optional[int] = ..., init_shared_by: _Optional[int] = ..., init_fell_back: _Optional[bool] = ..., eval_change_ms: _Optional[int] = ..., eval_sandbox_ms: _Optional[int] = ..., eval_sandbox: _Optional[_Union[EvalSandbox, str]] = ...) -> None: ...

class RolloutResult(_message.Message):
    __slots__ = ("rollout_id", "task_id", "group_id", "sample_index", "status", "filter_reason", "error", "reward", "finish_reason", "prompt_ids", "response_ids", "response_mask", "response_logprobs", "weight_versions", "turns", "messages", "timings", "format_errors", "eval_output", "metadata", "extra_samples", "gateway")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    FILTER_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_MASK_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    FORMAT_ERRORS_FIELD_NUMBER: _ClassVar[int]
    EVAL_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    EXTRA_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    task_id: str
    group_id: str
    sample_index: int
    status: RolloutStatus
    filter_reason: FilterReason
    error: str
    reward: float
    finish_reason: FinishReason
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    response_ids: _containers.RepeatedScalarFieldContainer[int]
    response_mask: _containers.RepeatedScalarFieldContainer[int]
    response_logprobs: _containers.RepeatedScalarFieldContainer[float]
    weight_versions: _containers.RepeatedScalarFieldContainer[int]
    turns: _containers.RepeatedCompositeFieldContainer[Turn]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    timings: StageTimings
    format_errors: int
    eval_output: bytes
    metadata: _containers.ScalarMap[str, str]
    extra_samples: _containers.RepeatedCompositeFieldContainer[Sample]
    gateway: GatewayCounters
    def __init__(self, rollout_id: _Optional[str] = ..., task_id: _Optional[str] = ..., group_id: _Optional[str] = ..., sample_index: _Optional[int] = ..., status: _Optional[_Union[RolloutStatus, str]] = ..., filter_reason: _Optional[_Union[FilterReason, str]] = ..., error: _Optional[str] = ..., reward: _Optional[float] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., response_ids: _Optional[_Iterable[int]] = ..., response_mask: _Optional[_Iterable[int]] = ..., response_logprobs: _Optional[_Iterable[float]] = ..., weight_versions: _Optional[_Iterable[int]] = ..., turns: _Optional[_Iterable[_Union[Turn, _Mapping]]] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., timings: _Optional[_Union[StageTimings, _Mapping]] = ..., format_errors: _Optional[int] = ..., eval_output: _Optional[bytes] = ..., metadata: _Optional[_Mapping[str, str]] = ..., extra_samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ..., gateway: _Optional[_Union[GatewayCounters, _Mapping]] = ...) -> None: ...

class LLMServer(_message.Message):
    __slots__ = ("address", "protocol", "weight", "in_flight", "healthy", "requests", "failures", "model")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    address: str
    protocol: LLMProtocol
    weight: int
    in_flight: int
    healthy: bool
    requests: int
    failures: int
    model: str
    def __init__(self, address: _Optional[str] = ..., protocol: _Optional[_Union[LLMProtocol, str]] = ..., weight: _Optional[int] = ..., in_flight: _Optional[int] = ..., healthy: _Optional[bool] = ..., requests: _Optional[int] = ..., failures: _Optional[int] = ..., model: _Optional[str] = ...) -> None: ...

class RegisterLLMRequest(_message.Message):
    __slots__ = ("address", "protocol", "weight", "model")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    address: str
    protocol: LLMProtocol
    weight: int
    model: str
    def __init__(self, address: _Optional[str] = ..., protocol: _Optional[_Union[LLMProtocol, str]] = ..., weight: _Optional[int] = ..., model: _Optional[str] = ...) -> None: ...

class RegisterLLMResponse(_message.Message):
    __slots__ = ("server",)
    SERVER_FIELD_NUMBER: _ClassVar[int]
    server: LLMServer
    def __init__(self, server: _Optional[_Union[LLMServer, _Mapping]] = ...) -> None: ...

class RemoveLLMRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class RemoveLLMResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListLLMsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListLLMsResponse(_message.Message):
    __slots__ = ("servers",)
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    servers: _containers.RepeatedCompositeFieldContainer[LLMServer]
    def __init__(self, servers: _Optional[_Iterable[_Union[LLMServer, _Mapping]]] = ...) -> None: ...

class SetPolicyVersionRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class SetPolicyVersionResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class RolloutOptions(_message.Message):
    __slots__ = ("n", "max_staleness", "stream_turns", "group_id")
    N_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    STREAM_TURNS_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    n: int
    max_staleness: int
    stream_turns: bool
    group_id: str
    def __init__(self, n: _Optional[int] = ..., max_staleness: _Optional[int] = ..., stream_turns: _Optional[bool] = ..., group_id: _Optional[str] = ...) -> None: ...

class RunRequest(_message.Message):
    __slots__ = ("task", "options")
    TASK_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    task: Task
    options: RolloutOptions
    def __init__(self, task: _Optional[_Union[Task, _Mapping]] = ..., options: _Optional[_Union[RolloutOptions, _Mapping]] = ...) -> None: ...

class RunResponse(_message.Message):
    __slots__ = ("result",)
    RESULT_FIELD_NUMBER: _ClassVar[int]
    result: RolloutResult
    def __init__(self, result: _Optional[_Union[RolloutResult, _Mapping]] = ...) -> None: ...

class SubmitRollout(_message.Message):
    __slots__ = ("task", "options", "client_ref")
    TASK_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_REF_FIELD_NUMBER: _ClassVar[int]
    task: Task
    options: RolloutOptions
    client_ref: str
    def __init__(self, task: _Optional[_Union[Task, _Mapping]] = ..., options: _Optional[_Union[RolloutOptions, _Mapping]] = ..., client_ref: _Optional[str] = ...) -> None: ...

class CancelRollout(_message.Message):
    __slots__ = ("task_id", "rollout_id")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    rollout_id: str
    def __init__(self, task_id: _Optional[str] = ..., rollout_id: _Optional[str] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("submit", "cancel")
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    submit: SubmitRollout
    cancel: CancelRollout
    def __init__(self, submit: _Optional[_Union[SubmitRollout, _Mapping]] = ..., cancel: _Optional[_Union[CancelRollout, _Mapping]] = ...) -> None: ...

class RolloutAccepted(_message.Message):
    __slots__ = ("client_ref", "task_id", "group_id", "rollout_ids")
    CLIENT_REF_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_IDS_FIELD_NUMBER: _ClassVar[int]
    client_ref: str
    task_id: str
    group_id: str
    rollout_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, client_ref: _Optional[str] = ..., task_id: _Optional[str] = ..., group_id: _Optional[str] = ..., rollout_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RolloutRejected(_message.Message):
    __slots__ = ("client_ref", "task_id", "code", "message")
    CLIENT_REF_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    client_ref: str
    task_id: str
    code: str
    message: str
    def __init__(self, client_ref: _Optional[str] = ..., task_id: _Optional[str] = ..., code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class StreamResponse(_message.Message):
    __slots__ = ("accepted", "rejected", "result", "turn")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    accepted: RolloutAccepted
    rejected: RolloutRejected
    result: RolloutResult
    turn: Turn
    def __init__(self, accepted: _Optional[_Union[RolloutAccepted, _Mapping]] = ..., rejected: _Optional[_Union[RolloutRejected, _Mapping]] = ..., result: _Optional[_Union[RolloutResult, _Mapping]] = ..., turn: _Optional[_Union[Turn, _Mapping]] = ...) -> None: ...

class StageStats(_message.Message):
    __slots__ = ("queued", "in_flight", "workers", "completed", "throughput_per_s")
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_PER_S_FIELD_NUMBER: _ClassVar[int]
    queued: int
    in_flight: int
    workers: int
    completed: int
    throughput_per_s: float
    def __init__(self, queued: _Optional[int] = ..., in_flight: _Optional[int] = ..., workers: _Optional[int] = ..., completed: _Optional[int] = ..., throughput_per_s: _Optional[float] = ...) -> None: ...

class GetRolloutStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetRolloutStatsResponse(_message.Message):
    __slots__ = ("init", "run", "eval", "llm_servers", "policy_version", "results_completed", "results_filtered", "results_cancelled")
    INIT_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    EVAL_FIELD_NUMBER: _ClassVar[int]
    LLM_SERVERS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    RESULTS_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FILTERED_FIELD_NUMBER: _ClassVar[int]
    RESULTS_CANCELLED_FIELD_NUMBER: _ClassVar[int]
    init: StageStats
    run: StageStats
    eval: StageStats
    llm_servers: _containers.RepeatedCompositeFieldContainer[LLMServer]
    policy_version: int
    results_completed: int
    results_filtered: int
    results_cancelled: int
    def __init__(self, init: _Optional[_Union[StageStats, _Mapping]] = ..., run: _Optional[_Union[StageStats, _Mapping]] = ..., eval: _Optional[_Union[StageStats, _Mapping]] = ..., llm_servers: _Optional[_Iterable[_Union[LLMServer, _Mapping]]] = ..., policy_version: _Optional[int] = ..., results_completed: _Optional[int] = ..., results_filtered: _Optional[int] = ..., results_cancelled: _Optional[int] = ...) -> None: ...
