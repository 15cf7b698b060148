from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Identity(_message.Message):
    __slots__ = ("cluster", "worker_id", "incarnation", "term")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    worker_id: str
    incarnation: int
    term: int
    def __init__(self, cluster: _Optional[str] = ..., worker_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., term: _Optional[int] = ...) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ("to",)
    TO_FIELD_NUMBER: _ClassVar[int]
    to: Identity
    def __init__(self, to: _Optional[_Union[Identity, _Mapping]] = ...) -> None: ...

class PingResponse(_message.Message):
    __slots__ = ("worker_id", "incarnation", "devices", "state")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: int
    devices: int
    state: str
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., devices: _Optional[int] = ..., state: _Optional[str] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("to", "coordinator_id", "interval_s")
    TO_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_ID_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    to: Identity
    coordinator_id: str
    interval_s: float
    def __init__(self, to: _Optional[_Union[Identity, _Mapping]] = ..., coordinator_id: _Optional[str] = ..., interval_s: _Optional[float] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("worker_id", "incarnation", "seq", "fenced")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    FENCED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: int
    seq: int
    fenced: bool
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., seq: _Optional[int] = ..., fenced: _Optional[bool] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class SliceAssignment(_message.Message):
    __slots__ = ("slice", "devices", "mesh_shape", "mesh_axes", "members")
    SLICE_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    MESH_SHAPE_FIELD_NUMBER: _ClassVar[int]
    MESH_AXES_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    slice: str
    devices: _containers.RepeatedScalarFieldContainer[int]
    mesh_shape: _containers.RepeatedScalarFieldContainer[int]
    mesh_axes: _containers.RepeatedScalarFieldContainer[str]
    members: _containers.RepeatedCompositeFieldContainer[GangMember]
    def __init__(self, slice: _Optional[str] = ..., devices: _Optional[_Iterable[int]] = ..., mesh_shape: _Optional[_Iterable[int]] = ..., mesh_axes: _Optional[_Iterable[str]] = ..., members: _Optional[_Iterable[_Union[GangMember, _Mapping]]] = ...) -> None: ...

class GangMember(_message.Message):
    __slots__ = ("worker_id", "address", "incarnation", "devices", "device_ids")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    incarnation: int
    devices: int
    device_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., incarnation: _Optional[int] = ..., devices: _Optional[int] = ..., device_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class InputBinding(_message.Message):
    __slots__ = ("arg", "kind", "node", "output", "state", "leaves", "producer_per_microbatch")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        REF: _ClassVar[InputBinding.Kind]
        STATE: _ClassVar[InputBinding.Kind]
        GATHER: _ClassVar[InputBinding.Kind]
        STEP: _ClassVar[InputBinding.Kind]
        MICROBATCH: _ClassVar[InputBinding.Kind]
    REF: InputBinding.Kind
    STATE: InputBinding.Kind
    GATHER: InputBinding.Kind
    STEP: InputBinding.Kind
    MICROBATCH: InputBinding.Kind
    ARG_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LEAVES_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_PER_MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    arg: str
    kind: InputBinding.Kind
    node: str
    output: str
    state: str
    leaves: int
    producer_per_microbatch: bool
    def __init__(self, arg: _Optional[str] = ..., kind: _Optional[_Union[InputBinding.Kind, str]] = ..., node: _Optional[str] = ..., output: _Optional[str] = ..., state: _Optional[str] = ..., leaves: _Optional[int] = ..., producer_per_microbatch: _Optional[bool] = ...) -> None: ...

class OutputSpec(_message.Message):
    __slots__ = ("name", "leaves", "updates_state", "metrics")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LEAVES_FIELD_NUMBER: _ClassVar[int]
    UPDATES_STATE_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    name: str
    leaves: int
    updates_state: str
    metrics: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., leaves: _Optional[int] = ..., updates_state: _Optional[str] = ..., metrics: _Optional[_Iterable[str]] = ...) -> None: ...

class NodeProgram(_message.Message):
    __slots__ = ("name", "slice", "per_microbatch", "every", "inputs", "outputs", "exported", "variants", "platforms", "host_source", "clock")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SLICE_FIELD_NUMBER: _ClassVar[int]
    PER_MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    EVERY_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    EXPORTED_FIELD_NUMBER: _ClassVar[int]
    VARIANTS_FIELD_NUMBER: _ClassVar[int]
    PLATFORMS_FIELD_NUMBER: _ClassVar[int]
    HOST_SOURCE_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    name: str
    slice: str
    per_microbatch: bool
    every: int
    inputs: _containers.RepeatedCompositeFieldContainer[InputBinding]
    outputs: _containers.RepeatedCompositeFieldContainer[OutputSpec]
    exported: bytes
    variants: _containers.RepeatedCompositeFieldContainer[ExportedVariant]
    platforms: _containers.RepeatedScalarFieldContainer[str]
    host_source: HostSource
    clock: bool
    def __init__(self, name: _Optional[str] = ..., slice: _Optional[str] = ..., per_microbatch: _Optional[bool] = ..., every: _Optional[int] = ..., inputs: _Optional[_Iterable[_Union[InputBinding, _Mapping]]] = ..., outputs: _Optional[_Iterable[_Union[OutputSpec, _Mapping]]] = ..., exported: _Optional[bytes] = ..., variants: _Optional[_Iterable[_Union[ExportedVariant, _Mapping]]] = ..., platforms: _Optional[_Iterable[str]] = ..., host_source: _Optional[_Union[HostSource, _Mapping]] = ..., clock: _Optional[bool] = ...) -> None: ...

class HostSource(_message.Message):
    __slots__ = ("file", "name", "prefetch")
    FILE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    file: str
    name: str
    prefetch: int
    def __init__(self, file: _Optional[str] = ..., name: _Optional[str] = ..., prefetch: _Optional[int] = ...) -> None: ...

class CodeBundle(_message.Message):
    __slots__ = ("sha256", "zip", "size", "files")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    ZIP_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    zip: bytes
    size: int
    files: int
    def __init__(self, sha256: _Optional[str] = ..., zip: _Optional[bytes] = ..., size: _Optional[int] = ..., files: _Optional[int] = ...) -> None: ...

class ExportedVariant(_message.Message):
    __slots__ = ("devices", "mesh_shape", "exported")
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    MESH_SHAPE_FIELD_NUMBER: _ClassVar[int]
    EXPORTED_FIELD_NUMBER: _ClassVar[int]
    devices: int
    mesh_shape: _containers.RepeatedScalarFieldContainer[int]
    exported: bytes
    def __init__(self, devices: _Optional[int] = ..., mesh_shape: _Optional[_Iterable[int]] = ..., exported: _Optional[bytes] = ...) -> None: ...

class StateProgram(_message.Message):
    __slots__ = ("name", "slice", "exported_init", "leaves", "producer_node", "producer_every", "treedef", "init_variants", "platforms", "init_from", "tree")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SLICE_FIELD_NUMBER: _ClassVar[int]
    EXPORTED_INIT_FIELD_NUMBER: _ClassVar[int]
    LEAVES_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_NODE_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_EVERY_FIELD_NUMBER: _ClassVar[int]
    TREEDEF_FIELD_NUMBER: _ClassVar[int]
    INIT_VARIANTS_FIELD_NUMBER: _ClassVar[int]
    PLATFORMS_FIELD_NUMBER: _ClassVar[int]
    INIT_FROM_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    name: str
    slice: str
    exported_init: bytes
    leaves: int
    producer_node: str
    producer_every: int
    treedef: str
    init_variants: _containers.RepeatedCompositeFieldContainer[ExportedVariant]
    platforms: _containers.RepeatedScalarFieldContainer[str]
    init_from: InitFrom
    tree: str
    def __init__(self, name: _Optional[str] = ..., slice: _Optional[str] = ..., exported_init: _Optional[bytes] = ..., leaves: _Optional[int] = ..., producer_node: _Optional[str] = ..., producer_every: _Optional[int] = ..., treedef: _Optional[str] = ..., init_variants: _Optional[_Iterable[_Union[ExportedVariant, _Mapping]]] = ..., platforms: _Optional[_Iterable[str]] = ..., init_from: _Optional[_Union[InitFrom, _Mapping]] = ..., tree: _Optional[str] = ...) -> None: ...

class InitFrom(_message.Message):
    __slots__ = ("path", "keys", "checksum")
    PATH_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    path: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    checksum: str
    def __init__(self, path: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ..., checksum: _Optional[str] = ...) -> None: ...

class Route(_message.Message):
    __slots__ = ("node", "output", "state", "consumer_node", "arg", "worker_id", "address", "incarnation", "consumer_every", "data_address")
    NODE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_NODE_FIELD_NUMBER: _ClassVar[int]
    ARG_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_EVERY_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    node: str
    output: str
    state: str
    consumer_node: str
    arg: str
    worker_id: str
    address: str
    incarnation: int
    consumer_every: int
    data_address: str
    def __init__(self, node: _Optional[str] = ..., output: _Optional[str] = ..., state: _Optional[str] = ..., consumer_node: _Optional[str] = ..., arg: _Optional[str] = ..., worker_id: _Optional[str] = ..., address: _Optional[str] = ..., incarnation: _Optional[int] = ..., consumer_every: _Optional[int] = ..., data_address: _Optional[str] = ...) -> None: ...

class LoadJobRequest(_message.Message):
    __slots__ = ("to", "job", "steps", "microbatches", "slices", "nodes", "states", "routes", "checkpoint_every", "checkpoint_dir", "keep_checkpoints", "log_limit_bytes", "start_step", "restore", "committed", "replica_targets", "replica_sources", "code_sha256", "skips", "verify")
    TO_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    SLICES_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_DIR_FIELD_NUMBER: _ClassVar[int]
    KEEP_CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    LOG_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    START_STEP_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    REPLICA_TARGETS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_SOURCES_FIELD_NUMBER: _ClassVar[int]
    CODE_SHA256_FIELD_NUMBER: _ClassVar[int]
    SKIPS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    to: Identity
    job: str
    steps: int
    microbatches: int
    slices: _containers.RepeatedCompositeFieldContainer[SliceAssignment]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeProgram]
    states: _containers.RepeatedCompositeFieldContainer[StateProgram]
    routes: _containers.RepeatedCompositeFieldContainer[Route]
    checkpoint_every: int
    checkpoint_dir: str
    keep_checkpoints: int
    log_limit_bytes: int
    start_step: int
    restore: _containers.RepeatedCompositeFieldContainer[CheckpointRef]
    committed: _containers.RepeatedCompositeFieldContainer[CheckpointRef]
    replica_targets: _containers.RepeatedCompositeFieldContainer[ReplicaPeer]
    replica_sources: _containers.RepeatedCompositeFieldContainer[ReplicaPeer]
    code_sha256: str
    skips: _containers.RepeatedCompositeFieldContainer[SkipRange]
    verify: Verification
    def __init__(self, to: _Optional[_Union[Identity, _Mapping]] = ..., job: _Optional[str] = ..., steps: _Optional[int] = ..., microbatches: _Optional[int] = ..., slices: _Optional[_Iterable[_Union[SliceAssignment, _Mapping]]] = ..., nodes: _Optional[_Iterable[_Union[NodeProgram, _Mapping]]] = ..., states: _Optional[_Iterable[_Union[StateProgram, _Mapping]]] = ..., routes: _Optional[_Iterable[_Union[Route, _Mapping]]] = ..., checkpoint_every: _Optional[int] = ..., checkpoint_dir: _Optional[str] = ..., keep_checkpoints: _Optional[int] = ..., log_limit_bytes: _Optional[int] = ..., start_step: _Optional[int] = ..., restore: _Optional[_Iterable[_Union[CheckpointRef, _Mapping]]] = ..., committed: _Optional[_Iterable[_Union[CheckpointRef, _Mapping]]] = ..., replica_targets: _Optional[_Iterable[_Union[ReplicaPeer, _Mapping]]] = ..., replica_sources: _Optional[_Iterable[_Union[ReplicaPeer, _Mapping]]] = ..., code_sha256: _Optional[str] = ..., skips: _Optional[_Iterable[_Union[SkipRange, _Mapping]]] = ..., verify: _Optional[_Union[Verification, _Mapping]] = ...) -> None: ...

class Verification(_message.Message):
    __slots__ = ("job", "commit")
    JOB_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    job: str
    commit: CheckpointRef
    def __init__(self, job: _Optional[str] = ..., commit: _Optional[_Union[CheckpointRef, _Mapping]] = ...) -> None: ...

class SkipRange(_message.Message):
    __slots__ = ("start", "count")
    START_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    start: int
    count: int
    def __init__(self, start: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class ReplicaPeer(_message.Message):
    __slots__ = ("slice", "worker_id", "address", "incarnation")
    SLICE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    slice: str
    worker_id: str
    address: str
    incarnation: int
    def __init__(self, slice: _Optional[str] = ..., worker_id: _Optional[str] = ..., address: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class CheckpointRef(_message.Message):
    __slots__ = ("slice", "step", "path", "checksum")
    SLICE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    slice: str
    step: int
    path: str
    checksum: str
    def __init__(self, slice: _Optional[str] = ..., step: _Optional[int] = ..., path: _Optional[str] = ..., checksum: _Optional[str] = ...) -> None: ...

class LoadJobResponse(_message.Message):
    __slots__ = ("load_s", "restore_tiers", "program_sources")
    class RestoreTiersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class ProgramSourcesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    LOAD_S_FIELD_NUMBER: _ClassVar[int]
    RESTORE_TIERS_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_SOURCES_FIELD_NUMBER: _ClassVar[int]
    load_s: float
    restore_tiers: _containers.ScalarMap[str, str]
    program_sources: _containers.ScalarMap[str, str]
    def __init__(self, load_s: _Optional[float] = ..., restore_tiers: _Optional[_Mapping[str, str]] = ..., program_sources: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RunStepsRequest(_message.Message):
    __slots__ = ("to", "job", "until_step", "cut_step", "save_at")
    TO_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    UNTIL_STEP_FIELD_NUMBER: _ClassVar[int]
    CUT_STEP_FIELD_NUMBER: _ClassVar[int]
    SAVE_AT_FIELD_NUMBER: _ClassVar[int]
    to: Identity
    job: str
    until_step: int
    cut_step: int
    save_at: int
    def __init__(self, to: _Optional[_Union[Identity, _Mapping]] = ..., job: _Optional[str] = ..., until_step: _Optional[int] = ..., cut_step: _Optional[int] = ..., save_at: _Optional[int] = ...) -> None: ...

class RunStepsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TransferHeader(_message.Message):
    __slots__ = ("job", "node", "output", "state", "step", "microbatch", "consumer_node", "arg", "leaves", "to", "from_worker", "from_incarnation", "pieces", "value_leaves")
    JOB_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_NODE_FIELD_NUMBER: _ClassVar[int]
    ARG_FIELD_NUMBER: _ClassVar[int]
    LEAVES_FIELD_NUMBER: _ClassVar[int]
    TO_FIELD_NUMBER: _ClassVar[int]
    FROM_WORKER_FIELD_NUMBER: _ClassVar[int]
    FROM_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    VALUE_LEAVES_FIELD_NUMBER: _ClassVar[int]
    job: str
    node: str
    output: str
    state: str
    step: int
    microbatch: int
    consumer_node: str
    arg: str
    leaves: int
    to: Identity
    from_worker: str
    from_incarnation: int
    pieces: _containers.RepeatedCompositeFieldContainer[Piece]
    value_leaves: int
    def __init__(self, job: _Optional[str] = ..., node: _Optional[str] = ..., output: _Optional[str] = ..., state: _Optional[str] = ..., step: _Optional[int] = ..., microbatch: _Optional[int] = ..., consumer_node: _Optional[str] = ..., arg: _Optional[str] = ..., leaves: _Optional[int] = ..., to: _Optional[_Union[Identity, _Mapping]] = ..., from_worker: _Optional[str] = ..., from_incarnation: _Optional[int] = ..., pieces: _Optional[_Iterable[_Union[Piece, _Mapping]]] = ..., value_leaves: _Optional[int] = ...) -> None: ...

class Piece(_message.Message):
    __slots__ = ("leaf", "start", "shape")
    LEAF_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    leaf: int
    start: _containers.RepeatedScalarFieldContainer[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, leaf: _Optional[int] = ..., start: _Optional[_Iterable[int]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class TransferChunk(_message.Message):
    __slots__ = ("header", "leaf", "dtype", "shape", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    LEAF_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: TransferHeader
    leaf: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, header: _Optional[_Union[TransferHeader, _Mapping]] = ..., leaf: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("duplicate",)
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    duplicate: bool
    def __init__(self, duplicate: _Optional[bool] = ...) -> None: ...

class JobEventsRequest(_message.Message):
    __slots__ = ("to", "job")
    TO_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    to: Identity
    job: str
    def __init__(self, to: _Optional[_Union[Identity, _Mapping]] = ..., job: _Optional[str] = ...) -> None: ...

class InstanceDone(_message.Message):
    __slots__ = ("node", "step", "microbatch", "compute_s", "metrics", "error", "checkpoint_slice", "checkpoint_step", "log_bytes", "log_spilled_bytes", "program_source", "compile_s", "busy_s", "saving_s", "group_lost", "verified")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NODE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_SLICE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    LOG_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOG_SPILLED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_SOURCE_FIELD_NUMBER: _ClassVar[int]
    COMPILE_S_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_FIELD_NUMBER: _ClassVar[int]
    SAVING_S_FIELD_NUMBER: _ClassVar[int]
    GROUP_LOST_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    node: str
    step: int
    microbatch: int
    compute_s: float
    metrics: _containers.ScalarMap[str, float]
    error: str
    checkpoint_slice: str
    checkpoint_step: int
    log_bytes: int
    log_spilled_bytes: int
    program_source: str
    compile_s: float
    busy_s: float
    saving_s: float
    group_lost: GroupLoss
    verified: VerifiedState
    def __init__(self, node: _Optional[str] = ..., step: _Optional[int] = ..., microbatch: _Optional[int] = ..., compute_s: _Optional[float] = ..., metrics: _Optional[_Mapping[str, float]] = ..., error: _Optional[str] = ..., checkpoint_slice: _Optional[str] = ..., checkpoint_step: _Optional[int] = ..., log_bytes: _Optional[int] = ..., log_spilled_bytes: _Optional[int] = ..., program_source: _Optional[str] = ..., compile_s: _Optional[float] = ..., busy_s: _Optional[float] = ..., saving_s: _Optional[float] = ..., group_lost: _Optional[_Union[GroupLoss, _Mapping]] = ..., verified: _Optional[_Union[VerifiedState, _Mapping]] = ...) -> None: ...

class VerifiedState(_message.Message):
    __slots__ = ("slice", "step", "checksum", "match")
    SLICE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    MATCH_FIELD_NUMBER: _ClassVar[int]
    slice: str
    step: int
    checksum: str
    match: bool
    def __init__(self, slice: _Optional[str] = ..., step: _Optional[int] = ..., checksum: _Optional[str] = ..., match: _Optional[bool] = ...) -> None: ...

class InstanceDoneBatch(_message.Message):
    __slots__ = ("done",)
    DONE_FIELD_NUMBER: _ClassVar[int]
    done: _containers.RepeatedCompositeFieldContainer[InstanceDone]
    def __init__(self, done: _Optional[_Iterable[_Union[InstanceDone, _Mapping]]] = ...) -> None: ...

class GroupLoss(_message.Message):
    __slots__ = ("member_worker",)
    MEMBER_WORKER_FIELD_NUMBER: _ClassVar[int]
    member_worker: str
    def __init__(self, member_worker: _Optional[str] = ...) -> None: ...

class RewireRequest(_message.Message):
    __slots__ = ("to", "job", "routes", "resend_to", "from_step", "until_step", "replica_targets")
    TO_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    RESEND_TO_FIELD_NUMBER: _ClassVar[int]
    FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    UNTIL_STEP_FIELD_NUMBER: _ClassVar[int]
    REPLICA_TARGETS_FIELD_NUMBER: _ClassVar[int]
    to: Identity
    job: str
    routes: _containers.RepeatedCompositeFieldContainer[Route]
    resend_to: _containers.RepeatedScalarFieldContainer[str]
    from_step: int
    until_step: int
    replica_targets: _containers.RepeatedCompositeFieldContainer[ReplicaPeer]
    def __init__(self, to: _Optional[_Union[Identity, _Mapping]] = ..., job: _Optional[str] = ..., routes: _Optional[_Iterable[_Union[Route, _Mapping]]] = ..., resend_to: _Optional[_Iterable[str]] = ..., from_step: _Optional[int] = ..., until_step: _Optional[int] = ..., replica_targets: _Optional[_Iterable[_Union[ReplicaPeer, _Mapping]]] = ...) -> None: ...

class RewireResponse(_message.Message):
    __slots__ = ("resent", "log_from")
    RESENT_FIELD_NUMBER: _ClassVar[int]
    LOG_FROM_FIELD_NUMBER: _ClassVar[int]
    resent: int
    log_from: int
    def __init__(self, resent: _Optional[int] = ..., log_from: _Optional[int] = ...) -> None: ...

class FetchStateRequest(_message.Message):
    __slots__ = ("to", "job")
    TO_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    to: Identity
    job: str
    def __init__(self, to: _Optional[_Union[Identity, _Mapping]] = ..., job: _Optional[str] = ...) -> None: ...

class StateValue(_message.Message):
    __slots__ = ("state", "leaves")
    STATE_FIELD_NUMBER: _ClassVar[int]
    LEAVES_FIELD_NUMBER: _ClassVar[int]
    state: str
    leaves: _containers.RepeatedCompositeFieldContainer[Tensor]
    def __init__(self, state: _Optional[str] = ..., leaves: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ...) -> None: ...

class UnloadJobRequest(_message.Message):
    __slots__ = ("to", "job", "flush_s")
    TO_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    FLUSH_S_FIELD_NUMBER: _ClassVar[int]
    to: Identity
    job: str
    flush_s: float
    def __init__(self, to: _Optional[_Union[Identity, _Mapping]] = ..., job: _Optional[str] = ..., flush_s: _Optional[float] = ...) -> None: ...

class UnloadJobResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MemberChunk(_message.Message):
    __slots__ = ("to", "start", "data")
    TO_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    to: Identity
    start: str
    data: bytes
    def __init__(self, to: _Optional[_Union[Identity, _Mapping]] = ..., start: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class WarmJobRequest(_message.Message):
    __slots__ = ("to", "job", "slices", "nodes", "members")
    TO_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    SLICES_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    to: Identity
    job: str
    slices: _containers.RepeatedCompositeFieldContainer[SliceAssignment]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeProgram]
    members: int
    def __init__(self, to: _Optional[_Union[Identity, _Mapping]] = ..., job: _Optional[str] = ..., slices: _Optional[_Iterable[_Union[SliceAssignment, _Mapping]]] = ..., nodes: _Optional[_Iterable[_Union[NodeProgram, _Mapping]]] = ..., members: _Optional[int] = ...) -> None: ...

class WarmJobResponse(_message.Message):
    __slots__ = ("compile_s", "failed", "warm_s")
    class CompileSEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class FailedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    COMPILE_S_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    WARM_S_FIELD_NUMBER: _ClassVar[int]
    compile_s: _containers.ScalarMap[str, float]
    failed: _containers.ScalarMap[str, str]
    warm_s: float
    def __init__(self, compile_s: _Optional[_Mapping[str, float]] = ..., failed: _Optional[_Mapping[str, str]] = ..., warm_s: _Optional[float] = ...) -> None: ...

class ReplicaHeader(_message.Message):
    __slots__ = ("to", "job", "slice", "step", "checksum", "states", "state_leaves", "from_worker", "from_incarnation")
    TO_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    SLICE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    STATE_LEAVES_FIELD_NUMBER: _ClassVar[int]
    FROM_WORKER_FIELD_NUMBER: _ClassVar[int]
    FROM_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    to: Identity
    job: str
    slice: str
    step: int
    checksum: str
    states: _containers.RepeatedScalarFieldContainer[str]
    state_leaves: _containers.RepeatedScalarFieldContainer[int]
    from_worker: str
    from_incarnation: int
    def __init__(self, to: _Optional[_Union[Identity, _Mapping]] = ..., job: _Optional[str] = ..., slice: _Optional[str] = ..., step: _Optional[int] = ..., checksum: _Optional[str] = ..., states: _Optional[_Iterable[str]] = ..., state_leaves: _Optional[_Iterable[int]] = ..., from_worker: _Optional[str] = ..., from_incarnation: _Optional[int] = ...) -> None: ...

class ReplicaChunk(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: ReplicaHeader
    chunk: TransferChunk
    def __init__(self, header: _Optional[_Union[ReplicaHeader, _Mapping]] = ..., chunk: _Optional[_Union[TransferChunk, _Mapping]] = ...) -> None: ...

class PushReplicaResponse(_message.Message):
    __slots__ = ("stored", "reason")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    stored: bool
    reason: str
    def __init__(self, stored: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class FetchReplicaRequest(_message.Message):
    __slots__ = ("to", "job", "slice", "step")
    TO_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    SLICE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    to: Identity
    job: str
    slice: str
    step: int
    def __init__(self, to: _Optional[_Union[Identity, _Mapping]] = ..., job: _Optional[str] = ..., slice: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class JobSpec(_message.Message):
    __slots__ = ("job", "steps", "microbatches", "window", "slices", "nodes", "states", "checkpoint_every", "checkpoint_dir", "keep_checkpoints", "policy", "on_no_spare", "wait_timeout_s", "log_limit_bytes", "stall_timeout_s", "priority", "stragglers", "straggler_factor", "straggler_window", "straggler_persist", "warm_spares", "straggler_probation_s", "straggler_repeat_window_s", "max_faults", "max_preemptions", "failure_window_s", "compile_timeout_s", "on_nonfinite", "new_run", "code", "submit_id", "metrics_sinks", "owner", "on_spike", "spike_metric", "spike_window", "spike_factor", "spike_zscore", "spike_rewind", "spike_skip", "max_rollbacks", "verify_every", "verify_seed", "verify_fraction")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    SLICES_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_DIR_FIELD_NUMBER: _ClassVar[int]
    KEEP_CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    ON_NO_SPARE_FIELD_NUMBER: _ClassVar[int]
    WAIT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    LOG_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    STALL_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    STRAGGLERS_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_FACTOR_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_WINDOW_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_PERSIST_FIELD_NUMBER: _ClassVar[int]
    WARM_SPARES_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_PROBATION_S_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_REPEAT_WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    MAX_FAULTS_FIELD_NUMBER: _ClassVar[int]
    MAX_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    COMPILE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    ON_NONFINITE_FIELD_NUMBER: _ClassVar[int]
    NEW_RUN_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    SUBMIT_ID_FIELD_NUMBER: _ClassVar[int]
    METRICS_SINKS_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    ON_SPIKE_FIELD_NUMBER: _ClassVar[int]
    SPIKE_METRIC_FIELD_NUMBER: _ClassVar[int]
    SPIKE_WINDOW_FIELD_NUMBER: _ClassVar[int]
    SPIKE_FACTOR_FIELD_NUMBER: _ClassVar[int]
    SPIKE_ZSCORE_FIELD_NUMBER: _ClassVar[int]
    SPIKE_REWIND_FIELD_NUMBER: _ClassVar[int]
    SPIKE_SKIP_FIELD_NUMBER: _ClassVar[int]
    MAX_ROLLBACKS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_EVERY_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SEED_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FRACTION_FIELD_NUMBER: _ClassVar[int]
    job: str
    steps: int
    microbatches: int
    window: int
    slices: _containers.RepeatedCompositeFieldContainer[SliceAssignment]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeProgram]
    states: _containers.RepeatedCompositeFieldContainer[StateProgram]
    checkpoint_every: int
    checkpoint_dir: str
    keep_checkpoints: int
    policy: str
    on_no_spare: str
    wait_timeout_s: float
    log_limit_bytes: int
    stall_timeout_s: float
    priority: int
    stragglers: str
    straggler_factor: float
    straggler_window: int
    straggler_persist: int
    warm_spares: int
    straggler_probation_s: float
    straggler_repeat_window_s: float
    max_faults: int
    max_preemptions: int
    failure_window_s: float
    compile_timeout_s: float
    on_nonfinite: str
    new_run: bool
    code: CodeBundle
    submit_id: str
    metrics_sinks: _containers.RepeatedCompositeFieldContainer[MetricsSink]
    owner: str
    on_spike: str
    spike_metric: str
    spike_window: int
    spike_factor: float
    spike_zscore: float
    spike_rewind: int
    spike_skip: int
    max_rollbacks: int
    verify_every: int
    verify_seed: int
    verify_fraction: float
    def __init__(self, job: _Optional[str] = ..., steps: _Optional[int] = ..., microbatches: _Optional[int] = ..., window: _Optional[int] = ..., slices: _Optional[_Iterable[_Union[SliceAssignment, _Mapping]]] = ..., nodes: _Optional[_Iterable[_Union[NodeProgram, _Mapping]]] = ..., states: _Optional[_Iterable[_Union[StateProgram, _Mapping]]] = ..., checkpoint_every: _Optional[int] = ..., checkpoint_dir: _Optional[str] = ..., keep_checkpoints: _Optional[int] = ..., policy: _Optional[str] = ..., on_no_spare: _Optional[str] = ..., wait_timeout_s: _Optional[float] = ..., log_limit_bytes: _Optional[int] = ..., stall_timeout_s: _Optional[float] = ..., priority: _Optional[int] = ..., stragglers: _Optional[str] = ..., straggler_factor: _Optional[float] = ..., straggler_window: _Optional[int] = ..., straggler_persist: _Optional[int] = ..., warm_spares: _Optional[int] = ..., straggler_probation_s: _Optional[float] = ..., straggler_repeat_window_s: _Optional[float] = ..., max_faults: _Optional[int] = ..., max_preemptions: _Optional[int] = ..., failure_window_s: _Optional[float] = ..., compile_timeout_s: _Optional[float] = ..., on_nonfinite: _Optional[str] = ..., new_run: _Optional[bool] = ..., code: _Optional[_Union[CodeBundle, _Mapping]] = ..., submit_id: _Optional[str] = ..., metrics_sinks: _Optional[_Iterable[_Union[MetricsSink, _Mapping]]] = ..., owner: _Optional[str] = ..., on_spike: _Optional[str] = ..., spike_metric: _Optional[str] = ..., spike_window: _Optional[int] = ..., spike_factor: _Optional[float] = ..., spike_zscore: _Optional[float] = ..., spike_rewind: _Optional[int] = ..., spike_skip: _Optional[int] = ..., max_rollbacks: _Optional[int] = ..., verify_every: _Optional[int] = ..., verify_seed: _Optional[int] = ..., verify_fraction: _Optional[float] = ...) -> None: ...

class MetricsSink(_message.Message):
    __slots__ = ("kind", "dir")
    KIND_FIELD_NUMBER: _ClassVar[int]
    DIR_FIELD_NUMBER: _ClassVar[int]
    kind: str
    dir: str
    def __init__(self, kind: _Optional[str] = ..., dir: _Optional[str] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ("job", "checkpoint_dir")
    JOB_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_DIR_FIELD_NUMBER: _ClassVar[int]
    job: str
    checkpoint_dir: str
    def __init__(self, job: _Optional[str] = ..., checkpoint_dir: _Optional[str] = ...) -> None: ...

class WatchJobRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class JobControlRequest(_message.Message):
    __slots__ = ("job", "checkpoint", "by", "reason")
    JOB_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    BY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job: str
    checkpoint: bool
    by: str
    reason: str
    def __init__(self, job: _Optional[str] = ..., checkpoint: _Optional[bool] = ..., by: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class JobControlReply(_message.Message):
    __slots__ = ("job", "state", "message", "run")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    job: str
    state: str
    message: str
    run: str
    def __init__(self, job: _Optional[str] = ..., state: _Optional[str] = ..., message: _Optional[str] = ..., run: _Optional[str] = ...) -> None: ...

class JobEvent(_message.Message):
    __slots__ = ("job", "event", "step", "metrics", "detail", "states")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    JOB_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    job: str
    event: str
    step: int
    metrics: _containers.ScalarMap[str, float]
    detail: str
    states: _containers.RepeatedCompositeFieldContainer[StateValue]
    def __init__(self, job: _Optional[str] = ..., event: _Optional[str] = ..., step: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., detail: _Optional[str] = ..., states: _Optional[_Iterable[_Union[StateValue, _Mapping]]] = ...) -> None: ...
