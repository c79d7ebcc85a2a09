"""The bench's records, typed: what one rank measured of a run under one condition (`RankRecord`), and the one
record per (mode, length, condition) that the tables, the plots and the JSON are made from (`RunRecord`).

The JSON is each `RunRecord`'s `record()`: its fields in order, a group of keys measured only in some runs (the
transports' peaks, the logits' peaks, the experts' per-rank figures, the comparison with CP, the planner's
prediction) written only where measured, so the keys are the ones docs/performance.md and tests/test_bench.py
read. A rank's record crosses the process boundary from the spawned ranks and carries no variant object (an object
unpickled there would be a copy, not the registry's); the run it belongs to is named by the process that spawned
it.

Standard library only.
"""

import dataclasses
import statistics

from megatron_csbp.core import modes, transports

BASELINE = next(mode for mode in modes.PARALLEL_MODES.values() if mode.is_baseline)  # the field's CP: "vs CP"
INLINE = {"inline": True}  # a field holding a group of keys of its own, written into the record (where measured)
OPTIONAL = {"optional": True}  # a field written only where measured (not None)


def plain(value):
    """`value` as the JSON holds it: a variant by its name, a record by its `record()`, another dataclass field by
    field, a tuple as a list."""
    if isinstance(value, (modes.ParallelMode, transports.Transport)):
        return value.name
    if hasattr(value, "record"):
        return value.record()
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    return value


def record_of(value) -> dict:
    """The keys of a record dataclass, in field order: `INLINE` fields merged in, `OPTIONAL` ones where set."""
    out = {}
    for field in dataclasses.fields(value):
        item = getattr(value, field.name)
        if field.metadata.get("inline"):
            out.update(plain(item) if item is not None else {})
        elif item is not None or not field.metadata.get("optional"):
            out[field.name] = plain(item)
    return out


@dataclasses.dataclass(frozen=True)
class Condition:
    """What a set of steps ran under: the backend's own link or a simulated one (`link_gbps`, each collective
    at least `link_latency_us` plus bytes / bandwidth), the collectives overlapped or waited for at issue, and
    whether every mode's steps alternated in the same ranks (`--interleave`)."""

    link_gbps: float | None = None
    link_latency_us: float | None = None
    overlap: bool = True
    interleaved: bool = False

    @property
    def is_main(self) -> bool:
        """The backend's own link, overlapped: the main table's condition."""
        return self.link_gbps is None and self.overlap

    @property
    def label(self) -> str:
        if not self.overlap:
            return "backend, serialised"
        return "backend" if self.link_gbps is None else f"{self.link_gbps:g} Gb/s"


@dataclasses.dataclass(frozen=True)
class RankCalibration:
    """One rank's rates, timed in its own ranks (`calibration.calibrate`): the model's linear layers and the
    attention kernel (GFLOP/s), and the backend's all-gather of `gather_bytes` and of one float (latency)."""

    linear_gflops: float
    attention_gflops: float
    gather_bytes: int
    gather_s: float
    latency_s: float

    def least_disturbed(self, other: "RankCalibration") -> "RankCalibration":
        """Each rate the faster of this one and `other` (timed before and after the steps): the planner is
        compared with the fastest measured step, so it gets the least disturbed calibration too; a load burst
        during one of the two (minutes on a shared machine) does not decide the prediction."""
        return dataclasses.replace(self, linear_gflops=max(self.linear_gflops, other.linear_gflops),
                                   attention_gflops=max(self.attention_gflops, other.attention_gflops),
                                   gather_s=min(self.gather_s, other.gather_s),
                                   latency_s=min(self.latency_s, other.latency_s))


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The machine as the planner sees it: the slowest rank's rates, the backend's link as the ranks saw it.
    `origin`: where a calibration read from an earlier run's JSON came from (`--calibrate-from`; not written)."""

    linear_gflops: float
    attention_gflops: float
    gather_s: float
    latency_s: float
    backend_gb_s: float
    origin: str | None = None

    @classmethod
    def of_ranks(cls, per_rank) -> "Calibration":
        gather_s, latency_s = max(r.gather_s for r in per_rank), max(r.latency_s for r in per_rank)
        return cls(min(r.linear_gflops for r in per_rank), min(r.attention_gflops for r in per_rank), gather_s,
                   latency_s, per_rank[0].gather_bytes / max(gather_s - latency_s, 1e-9) / 1e9)

    def record(self) -> dict:
        """The rates (not where they came from)."""
        return {key: value for key, value in record_of(self).items() if key != "origin"}


PEAK_PARTS = ("step", "attention_forward", "attention")  # a training step, the attention op forward, and +backward


@dataclasses.dataclass(frozen=True)
class TransportPeaks:
    """Peak tensor bytes of one rank under one transport (its name), by `PEAK_PARTS` (`--transport-memory`)."""

    transport: str
    step: int
    attention_forward: int
    attention: int

    def record(self) -> dict:
        return {f"{self.transport}_{part}_peak_bytes": getattr(self, part) for part in PEAK_PARTS}


@dataclasses.dataclass(frozen=True)
class TransportMemory:
    """Every transport's peaks, in the registry's order."""

    peaks: tuple

    @classmethod
    def largest(cls, per_rank) -> "TransportMemory":
        """The largest rank's bytes, part by part."""
        def largest(same):  # one transport's peaks, every rank's
            return TransportPeaks(same[0].transport, *(max(getattr(p, part) for p in same) for part in PEAK_PARTS))

        return cls(tuple(largest(same) for same in zip(*(memory.peaks for memory in per_rank))))

    def record(self) -> dict:
        return {key: value for peaks in self.peaks for key, value in peaks.record().items()}


@dataclasses.dataclass(frozen=True)
class LogitsMemory:
    """Peak tensor bytes of one rank's training step with the LM head's logits whole and as a tiled linear
    cross-entropy (`--logits-memory`), beside the bytes of the head's fp32 logits `[rows x vocab / TP]`."""

    logits_bytes: int
    whole_logits_step_peak_bytes: int
    tiled_logits_step_peak_bytes: int

    @classmethod
    def largest(cls, per_rank) -> "LogitsMemory":
        return cls(*(max(getattr(memory, field.name) for memory in per_rank) for field in dataclasses.fields(cls)))

    def record(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Routing:
    """What one rank of a MoE run routes in a step and holds (`experts.MoERouting`; kept per rank, as the routing
    differs from rank to rank): its expert-parallel rank and group, the rows each router call routed and the
    (row, expert) pairs that went to each EP rank's experts, its dense and expert parameters."""

    ep_rank: int
    ep_group: list
    routed_rows: list
    routed_pairs_to_ep_ranks: list
    dense_parameters: int
    expert_parameters: int


@dataclasses.dataclass(frozen=True)
class OptimizerState:
    """The bytes megatron-core's distributed optimizer gives one rank of a MoE run (`experts.optimizer_state`):
    Adam's state and the fp32 gradient buffers, of the dense and of the expert parameters."""

    optimizer_dense_state_bytes: int
    optimizer_expert_state_bytes: int
    gradient_buffer_dense_bytes: int
    gradient_buffer_expert_bytes: int


@dataclasses.dataclass(frozen=True)
class ExpertRanks:
    """Every rank's `Routing` and `OptimizerState`, written as one `<field>_by_rank` list per field."""

    routing: tuple
    state: tuple

    def record(self) -> dict:
        return {f"{field.name}_by_rank": [getattr(rank, field.name) for rank in ranks]
                for ranks in (self.routing, self.state) for field in dataclasses.fields(ranks[0])}


@dataclasses.dataclass(frozen=True)
class RankRecord:
    """One rank's measured steps of a run under one condition (`mode_run.ModeRun.record`)."""

    rank: int
    condition: Condition
    bytes_sent: int  # by the attention ops' collectives, in one step
    step_times_s: tuple
    cpu_times_s: tuple  # the process's CPU seconds of each step
    waits_s: tuple  # the seconds each step's compute path waited on the collectives (exposed communication)
    peak_memory_bytes: int
    saved_activation_bytes: int
    rows: int
    attention_pairs: int  # that the BDLM mask lets the rank's rows see, every head, layer and sample
    kernel_work: tuple  # core.kernel_work.KernelCall of one layer's forward, per head and sample
    all_to_all_bytes: int = 0
    all_to_all_calls: int = 0
    routing: Routing | None = None  # a MoE model's
    optimizer_state: OptimizerState | None = None
    transport_memory: TransportMemory | None = None
    logits_memory: LogitsMemory | None = None
    calibration: RankCalibration | None = None

    @property
    def step_time_s(self) -> float:
        return statistics.median(self.step_times_s)

    @property
    def exposed_comm_s(self) -> float:
        return statistics.median(self.waits_s)

    @property
    def cpu_time_s(self) -> float:
        return statistics.median(self.cpu_times_s)

    @property
    def best(self) -> int:
        """The fastest step's index."""
        return min(range(len(self.step_times_s)), key=self.step_times_s.__getitem__)

    @property
    def kernel_computed_pairs(self) -> int:
        return sum(call.computed_pairs * call.calls for call in self.kernel_work)


@dataclasses.dataclass(frozen=True)
class CPComparison:
    """A main-table record's step time (wall clock and CPU) over CP's at its length (None where CP did not run)."""

    step_vs_cp: float | None
    cpu_vs_cp: float | None


@dataclasses.dataclass(frozen=True)
class PlannerStep:
    """The calibrated planner's step and exposed communication for a measured record (`--predict`)."""

    predicted_step_time_s: float
    predicted_exposed_comm_s: float


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """One (mode, length, condition) over its ranks: the slowest rank's time and exposed communication, the
    largest rank's bytes and memory, the kernel work of the rank computing most (its kernels, calls, real and
    computed pairs), and what only some runs measure, where measured."""

    mode: modes.ParallelMode
    seq_length: int
    block_size: int
    nproc: int
    transport: transports.Transport
    recompute: str
    condition: Condition = dataclasses.field(metadata=INLINE)
    step_times_s: tuple  # round by round, the slowest rank's
    cpu_times_s: tuple
    bytes_sent_per_rank: int
    step_time_s: float
    cpu_time_s: float
    exposed_comm_s: float
    best_step_time_s: float
    best_exposed_comm_s: float
    peak_memory_bytes: int
    saved_activation_bytes: int
    rows_per_rank: int
    attention_pairs_per_rank: int
    transport_memory: TransportMemory | None = dataclasses.field(metadata=INLINE)
    logits_memory: LogitsMemory | None = dataclasses.field(metadata=INLINE)
    kernels: str  # the kernel families of the rank computing most, e.g. "dense+prefix"
    kernel_calls: int
    kernel_real_pairs: int
    kernel_computed_pairs: int
    kernel_work_by_rank: tuple
    exposed_share: float
    calibration: Calibration | None = dataclasses.field(metadata=OPTIONAL)
    tokens_per_s: float
    all_to_all_bytes_per_rank: int
    all_to_all_bytes_by_rank: tuple
    all_to_all_calls_by_rank: tuple
    experts: ExpertRanks | None = dataclasses.field(metadata=INLINE)
    load_average: float | None = None  # the 1-minute load average, the larger of before and after the run
    versus_cp: CPComparison | None = dataclasses.field(default=None, metadata=INLINE)
    predicted: PlannerStep | None = dataclasses.field(default=None, metadata=INLINE)

    def record(self) -> dict:
        return record_of(self)


def summarise(of_ranks, mode, seq_length: int, args) -> RunRecord:
    """The `RunRecord` of every rank's `RankRecord` of one condition of `mode` at `seq_length` (bench `args`)."""
    first = of_ranks[0]
    busiest = max(of_ranks, key=lambda r: r.kernel_computed_pairs)
    kinds = dict.fromkeys(call.kind for call in busiest.kernel_work)
    step_time_s = max(r.step_time_s for r in of_ranks)
    exposed_comm_s = max(r.exposed_comm_s for r in of_ranks)
    experts = ExpertRanks(*zip(*((r.routing, r.optimizer_state) for r in of_ranks))) if first.routing else None
    memory = TransportMemory.largest([r.transport_memory for r in of_ranks]) if first.transport_memory else None
    logits = LogitsMemory.largest([r.logits_memory for r in of_ranks]) if first.logits_memory else None
    calibration = Calibration.of_ranks([r.calibration for r in of_ranks]) if first.calibration else None
    return RunRecord(
        mode=modes.parallel_mode(mode), seq_length=seq_length, block_size=args.block_size, nproc=args.nproc,
        transport=transports.transport(args.csbp_transport), recompute=args.recompute_granularity or "none",
        condition=first.condition,
        step_times_s=tuple(max(times) for times in zip(*(r.step_times_s for r in of_ranks))),
        cpu_times_s=tuple(max(times) for times in zip(*(r.cpu_times_s for r in of_ranks))),
        bytes_sent_per_rank=max(r.bytes_sent for r in of_ranks), step_time_s=step_time_s,
        cpu_time_s=max(r.cpu_time_s for r in of_ranks), exposed_comm_s=exposed_comm_s,
        best_step_time_s=max(r.step_times_s[r.best] for r in of_ranks),
        best_exposed_comm_s=max(r.waits_s[r.best] for r in of_ranks),
        peak_memory_bytes=max(r.peak_memory_bytes for r in of_ranks),
        saved_activation_bytes=max(r.saved_activation_bytes for r in of_ranks),
        rows_per_rank=max(r.rows for r in of_ranks), attention_pairs_per_rank=max(r.attention_pairs for r in of_ranks),
        transport_memory=memory, logits_memory=logits, kernels="+".join(kinds),
        kernel_calls=sum(c.calls for c in busiest.kernel_work),
        kernel_real_pairs=sum(c.real_pairs * c.calls for c in busiest.kernel_work),
        kernel_computed_pairs=busiest.kernel_computed_pairs,
        kernel_work_by_rank=tuple(r.kernel_work for r in of_ranks), exposed_share=exposed_comm_s / step_time_s,
        calibration=calibration, tokens_per_s=args.micro_batch_size * seq_length / step_time_s,
        all_to_all_bytes_per_rank=max(r.all_to_all_bytes for r in of_ranks),
        all_to_all_bytes_by_rank=tuple(r.all_to_all_bytes for r in of_ranks),
        all_to_all_calls_by_rank=tuple(r.all_to_all_calls for r in of_ranks), experts=experts)
