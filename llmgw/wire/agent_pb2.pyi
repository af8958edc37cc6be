from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ShardState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SHARD_STATE_UNSPECIFIED: _ClassVar[ShardState]
    SHARD_STATE_PENDING: _ClassVar[ShardState]
    SHARD_STATE_STARTING: _ClassVar[ShardState]
    SHARD_STATE_READY: _ClassVar[ShardState]
    SHARD_STATE_DRAINING: _ClassVar[ShardState]
    SHARD_STATE_STOPPED: _ClassVar[ShardState]
    SHARD_STATE_FAILED: _ClassVar[ShardState]
    SHARD_STATE_SLEEPING: _ClassVar[ShardState]
    SHARD_STATE_WAKING: _ClassVar[ShardState]
SHARD_STATE_UNSPECIFIED: ShardState
SHARD_STATE_PENDING: ShardState
SHARD_STATE_STARTING: ShardState
SHARD_STATE_READY: ShardState
SHARD_STATE_DRAINING: ShardState
SHARD_STATE_STOPPED: ShardState
SHARD_STATE_FAILED: ShardState
SHARD_STATE_SLEEPING: ShardState
SHARD_STATE_WAKING: ShardState

class AgentMessage(_message.Message):
    __slots__ = ("register", "heartbeat", "shard_status", "command_result", "weights_report")
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    SHARD_STATUS_FIELD_NUMBER: _ClassVar[int]
    COMMAND_RESULT_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_REPORT_FIELD_NUMBER: _ClassVar[int]
    register: Register
    heartbeat: Heartbeat
    shard_status: ShardStatus
    command_result: CommandResult
    weights_report: WeightsReport
    def __init__(self, register: _Optional[_Union[Register, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., shard_status: _Optional[_Union[ShardStatus, _Mapping]] = ..., command_result: _Optional[_Union[CommandResult, _Mapping]] = ..., weights_report: _Optional[_Union[WeightsReport, _Mapping]] = ...) -> None: ...

class ControlMessage(_message.Message):
    __slots__ = ("welcome", "start_shard", "stop_shard", "remove_weights", "redirect", "refused", "sleep_shard", "wake_shard")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    START_SHARD_FIELD_NUMBER: _ClassVar[int]
    STOP_SHARD_FIELD_NUMBER: _ClassVar[int]
    REMOVE_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    REDIRECT_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    SLEEP_SHARD_FIELD_NUMBER: _ClassVar[int]
    WAKE_SHARD_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    start_shard: StartShard
    stop_shard: StopShard
    remove_weights: RemoveWeights
    redirect: Redirect
    refused: Refused
    sleep_shard: SleepShard
    wake_shard: WakeShard
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., start_shard: _Optional[_Union[StartShard, _Mapping]] = ..., stop_shard: _Optional[_Union[StopShard, _Mapping]] = ..., remove_weights: _Optional[_Union[RemoveWeights, _Mapping]] = ..., redirect: _Optional[_Union[Redirect, _Mapping]] = ..., refused: _Optional[_Union[Refused, _Mapping]] = ..., sleep_shard: _Optional[_Union[SleepShard, _Mapping]] = ..., wake_shard: _Optional[_Union[WakeShard, _Mapping]] = ...) -> None: ...

class Register(_message.Message):
    __slots__ = ("node_id", "agent_version", "address", "labels", "fabrics", "cpus", "memory_bytes", "gpus", "shards", "max_frame_size", "agent_instance", "sleep_memory_bytes", "protocol_version")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    FABRICS_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAME_SIZE_FIELD_NUMBER: _ClassVar[int]
    AGENT_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    SLEEP_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    agent_version: str
    address: str
    labels: _containers.ScalarMap[str, str]
    fabrics: _containers.RepeatedScalarFieldContainer[str]
    cpus: int
    memory_bytes: int
    gpus: _containers.RepeatedCompositeFieldContainer[Gpu]
    shards: _containers.RepeatedCompositeFieldContainer[RunningShard]
    max_frame_size: int
    agent_instance: str
    sleep_memory_bytes: int
    protocol_version: str
    def __init__(self, node_id: _Optional[str] = ..., agent_version: _Optional[str] = ..., address: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., fabrics: _Optional[_Iterable[str]] = ..., cpus: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., gpus: _Optional[_Iterable[_Union[Gpu, _Mapping]]] = ..., shards: _Optional[_Iterable[_Union[RunningShard, _Mapping]]] = ..., max_frame_size: _Optional[int] = ..., agent_instance: _Optional[str] = ..., sleep_memory_bytes: _Optional[int] = ..., protocol_version: _Optional[str] = ...) -> None: ...

class Gpu(_message.Message):
    __slots__ = ("index", "uuid", "name", "memory_total_mib", "memory_used_mib", "problems", "simulated")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_MIB_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_MIB_FIELD_NUMBER: _ClassVar[int]
    PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    SIMULATED_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    name: str
    memory_total_mib: int
    memory_used_mib: int
    problems: _containers.RepeatedScalarFieldContainer[str]
    simulated: bool
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., name: _Optional[str] = ..., memory_total_mib: _Optional[int] = ..., memory_used_mib: _Optional[int] = ..., problems: _Optional[_Iterable[str]] = ..., simulated: _Optional[bool] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("gpus",)
    GPUS_FIELD_NUMBER: _ClassVar[int]
    gpus: _containers.RepeatedCompositeFieldContainer[GpuUsage]
    def __init__(self, gpus: _Optional[_Iterable[_Union[GpuUsage, _Mapping]]] = ...) -> None: ...

class GpuUsage(_message.Message):
    __slots__ = ("index", "memory_used_mib", "new_problems", "processes", "foreign_used_mib")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_MIB_FIELD_NUMBER: _ClassVar[int]
    NEW_PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    FOREIGN_USED_MIB_FIELD_NUMBER: _ClassVar[int]
    index: int
    memory_used_mib: int
    new_problems: _containers.RepeatedScalarFieldContainer[str]
    processes: _containers.RepeatedCompositeFieldContainer[GpuProcess]
    foreign_used_mib: int
    def __init__(self, index: _Optional[int] = ..., memory_used_mib: _Optional[int] = ..., new_problems: _Optional[_Iterable[str]] = ..., processes: _Optional[_Iterable[_Union[GpuProcess, _Mapping]]] = ..., foreign_used_mib: _Optional[int] = ...) -> None: ...

class GpuProcess(_message.Message):
    __slots__ = ("pid", "used_mib", "managed", "name")
    PID_FIELD_NUMBER: _ClassVar[int]
    USED_MIB_FIELD_NUMBER: _ClassVar[int]
    MANAGED_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    pid: int
    used_mib: int
    managed: bool
    name: str
    def __init__(self, pid: _Optional[int] = ..., used_mib: _Optional[int] = ..., managed: _Optional[bool] = ..., name: _Optional[str] = ...) -> None: ...

class RunningShard(_message.Message):
    __slots__ = ("shard_id", "replica_id", "model", "profile", "state", "port", "gpu_indices", "rank", "world_size", "pid", "engine", "source")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    GPU_INDICES_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    shard_id: str
    replica_id: str
    model: str
    profile: str
    state: ShardState
    port: int
    gpu_indices: _containers.RepeatedScalarFieldContainer[int]
    rank: int
    world_size: int
    pid: int
    engine: str
    source: str
    def __init__(self, shard_id: _Optional[str] = ..., replica_id: _Optional[str] = ..., model: _Optional[str] = ..., profile: _Optional[str] = ..., state: _Optional[_Union[ShardState, str]] = ..., port: _Optional[int] = ..., gpu_indices: _Optional[_Iterable[int]] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., pid: _Optional[int] = ..., engine: _Optional[str] = ..., source: _Optional[str] = ...) -> None: ...

class ShardStatus(_message.Message):
    __slots__ = ("shard_id", "state", "exit_code", "has_exit_code", "error", "output_tail", "pid", "note", "phases")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    HAS_EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TAIL_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    shard_id: str
    state: ShardState
    exit_code: int
    has_exit_code: bool
    error: str
    output_tail: _containers.RepeatedScalarFieldContainer[str]
    pid: int
    note: str
    phases: _containers.RepeatedCompositeFieldContainer[StartPhase]
    def __init__(self, shard_id: _Optional[str] = ..., state: _Optional[_Union[ShardState, str]] = ..., exit_code: _Optional[int] = ..., has_exit_code: _Optional[bool] = ..., error: _Optional[str] = ..., output_tail: _Optional[_Iterable[str]] = ..., pid: _Optional[int] = ..., note: _Optional[str] = ..., phases: _Optional[_Iterable[_Union[StartPhase, _Mapping]]] = ...) -> None: ...

class StartPhase(_message.Message):
    __slots__ = ("name", "seconds", "detail")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    name: str
    seconds: float
    detail: bool
    def __init__(self, name: _Optional[str] = ..., seconds: _Optional[float] = ..., detail: _Optional[bool] = ...) -> None: ...

class CommandResult(_message.Message):
    __slots__ = ("command_id", "ok", "error", "code")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    command_id: int
    ok: bool
    error: str
    code: str
    def __init__(self, command_id: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., code: _Optional[str] = ...) -> None: ...

class WeightsReport(_message.Message):
    __slots__ = ("files", "total", "truncated")
    FILES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    files: _containers.RepeatedCompositeFieldContainer[WeightsFile]
    total: int
    truncated: bool
    def __init__(self, files: _Optional[_Iterable[_Union[WeightsFile, _Mapping]]] = ..., total: _Optional[int] = ..., truncated: _Optional[bool] = ...) -> None: ...

class WeightsFile(_message.Message):
    __slots__ = ("path", "size_bytes", "last_used_unix")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_UNIX_FIELD_NUMBER: _ClassVar[int]
    path: str
    size_bytes: int
    last_used_unix: int
    def __init__(self, path: _Optional[str] = ..., size_bytes: _Optional[int] = ..., last_used_unix: _Optional[int] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("server_version", "heartbeat_interval_seconds", "max_frame_size", "protocol_version")
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAME_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    server_version: str
    heartbeat_interval_seconds: int
    max_frame_size: int
    protocol_version: str
    def __init__(self, server_version: _Optional[str] = ..., heartbeat_interval_seconds: _Optional[int] = ..., max_frame_size: _Optional[int] = ..., protocol_version: _Optional[str] = ...) -> None: ...

class Redirect(_message.Message):
    __slots__ = ("leader",)
    LEADER_FIELD_NUMBER: _ClassVar[int]
    leader: str
    def __init__(self, leader: _Optional[str] = ...) -> None: ...

class Refused(_message.Message):
    __slots__ = ("code", "reason", "certificate_name", "node_id")
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_NAME_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    code: str
    reason: str
    certificate_name: str
    node_id: str
    def __init__(self, code: _Optional[str] = ..., reason: _Optional[str] = ..., certificate_name: _Optional[str] = ..., node_id: _Optional[str] = ...) -> None: ...

class StartShard(_message.Message):
    __slots__ = ("command_id", "shard_id", "replica_id", "model", "profile", "engine", "source", "args", "env", "port", "gpu_indices", "rank", "world_size", "leader_address", "api_key", "sleep_level", "gpu_memory_gb", "sleep_gpu_memory_gb", "gpu_share")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    GPU_INDICES_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    LEADER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    API_KEY_FIELD_NUMBER: _ClassVar[int]
    SLEEP_LEVEL_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_GB_FIELD_NUMBER: _ClassVar[int]
    SLEEP_GPU_MEMORY_GB_FIELD_NUMBER: _ClassVar[int]
    GPU_SHARE_FIELD_NUMBER: _ClassVar[int]
    command_id: int
    shard_id: str
    replica_id: str
    model: str
    profile: str
    engine: str
    source: str
    args: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.ScalarMap[str, str]
    port: int
    gpu_indices: _containers.RepeatedScalarFieldContainer[int]
    rank: int
    world_size: int
    leader_address: str
    api_key: str
    sleep_level: int
    gpu_memory_gb: float
    sleep_gpu_memory_gb: float
    gpu_share: float
    def __init__(self, command_id: _Optional[int] = ..., shard_id: _Optional[str] = ..., replica_id: _Optional[str] = ..., model: _Optional[str] = ..., profile: _Optional[str] = ..., engine: _Optional[str] = ..., source: _Optional[str] = ..., args: _Optional[_Iterable[str]] = ..., env: _Optional[_Mapping[str, str]] = ..., port: _Optional[int] = ..., gpu_indices: _Optional[_Iterable[int]] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., leader_address: _Optional[str] = ..., api_key: _Optional[str] = ..., sleep_level: _Optional[int] = ..., gpu_memory_gb: _Optional[float] = ..., sleep_gpu_memory_gb: _Optional[float] = ..., gpu_share: _Optional[float] = ...) -> None: ...

class SleepShard(_message.Message):
    __slots__ = ("command_id", "shard_id", "level")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    command_id: int
    shard_id: str
    level: int
    def __init__(self, command_id: _Optional[int] = ..., shard_id: _Optional[str] = ..., level: _Optional[int] = ...) -> None: ...

class WakeShard(_message.Message):
    __slots__ = ("command_id", "shard_id")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    command_id: int
    shard_id: str
    def __init__(self, command_id: _Optional[int] = ..., shard_id: _Optional[str] = ...) -> None: ...

class StopShard(_message.Message):
    __slots__ = ("command_id", "shard_id", "grace_seconds")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    GRACE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    command_id: int
    shard_id: str
    grace_seconds: int
    def __init__(self, command_id: _Optional[int] = ..., shard_id: _Optional[str] = ..., grace_seconds: _Optional[int] = ...) -> None: ...

class RemoveWeights(_message.Message):
    __slots__ = ("command_id", "paths")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    PATHS_FIELD_NUMBER: _ClassVar[int]
    command_id: int
    paths: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, command_id: _Optional[int] = ..., paths: _Optional[_Iterable[str]] = ...) -> None: ...
