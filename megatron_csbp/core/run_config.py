"""The BDLM run as the plugin sees it: one frozen value, validated once, handed down.

Like megatron-core's `TransformerConfig`, a `RunConfig` is built once (by the trainer from either loop's
parsed arguments, `training.arguments.run_config`; by the planner for each candidate layout) and checked
in `__post_init__` by the rules (`core.rules`), in one order, so a layout the planner proposes is one the
trainer accepts and a refusal reads the same wherever it is met. What it leaves to defaults (the clean
shards, the loss weighting, the head size, the K/V heads, the global batch) it resolves once; nothing
downstream re-derives them. The variants it names are objects (`parallel_mode`, `objective_kind`,
`transport_kind`) that state their own facts.

Standard library only (the planner runs without torch); `layout()` builds a torch layout when called.
"""

import dataclasses

from megatron_csbp.core import modes, objectives, rules, transports


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Model shape, sequence, objective and parallel layout of one BDLM run (trainer flags' meanings)."""

    # the model
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int  # L, clean tokens per sample
    block_size: int  # B, the diffusion block
    num_query_groups: int | None = None  # K/V heads (None: one per attention head)
    kv_channels: int | None = None  # head size (None: hidden / heads)
    # the objective
    objective: str = "bd3lm"
    loss_weighting: str | None = None  # None: the objective's default
    noise_range: tuple = (1e-3, 1.0)
    # the layout
    mode: str = "csbp"
    block_parallel_size: int = 1  # P, in Megatron's CP slot
    clean_shards: int | None = None  # C (None: the mode's default)
    schedule: str = "dual_end"
    clean_layout: str = "zigzag"
    transport: str = "collective"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    world_size: int | None = None  # None: one model replica (TP x PP x P)
    # mixture of experts (None: a dense model); EP x ETP x expert-DP is carved from each stage's TP x P x DP ranks
    num_experts: int | None = None
    expert_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None  # None: TP
    # the batch
    micro_batch_size: int = 1
    global_batch_size: int | None = None  # None: one micro-batch per data-parallel replica
    # packed documents (Megatron-LM's flags; boundaries at EOD)
    reset_position_ids: bool = False  # RoPE positions restart at each document
    reset_attention_mask: bool = False  # no row attends across a document
    eod_mask_loss: bool = False  # EOD tokens never supervised
    flags: rules.Flags = dataclasses.field(default=rules.FLAGS, compare=False, repr=False)  # names in messages

    def __post_init__(self):
        rules.refuse(self.problem(), rules.ConfigError)
        resolved = dict(
            num_query_groups=self.num_query_groups or self.num_attention_heads,
            kv_channels=self.kv_channels or self.hidden_size // self.num_attention_heads,
            loss_weighting=self.loss_weighting or self.objective_kind.default_weighting,
            clean_shards=self.parallel_mode.clean_shards(self.block_parallel_size, self.clean_shards),
            world_size=self.world_size or self.model_parallel_size,
            expert_tensor_parallel_size=self.expert_tensor_parallel_size or self.tensor_parallel_size)
        resolved["global_batch_size"] = (self.global_batch_size
                                         or self.micro_batch_size * resolved["world_size"] // self.model_parallel_size)
        for name, value in resolved.items():
            object.__setattr__(self, name, value)

    def problem(self) -> str | None:
        """The first rule the settings break (one line: flag and fix), in the trainer's order, or None."""
        f, P, TP, PP = self.flags, self.block_parallel_size, self.tensor_parallel_size, self.pipeline_parallel_size
        for flag, value in ((f.num_layers, self.num_layers), (f.hidden_size, self.hidden_size),
                            (f.heads, self.num_attention_heads), (f.seq_length, self.seq_length)):
            if value is None:
                return f"{flag} is required"
        heads, groups = self.num_attention_heads, self.num_query_groups or self.num_attention_heads
        problem = (rules.query_groups_problem(heads, groups, f) or rules.tensor_parallel_problem(heads, groups, TP, f)
                   or rules.pipeline_problem(self.num_layers, PP, f)
                   or (None if self.kv_channels else rules.kv_channels_problem(self.hidden_size, heads, f))
                   or rules.at_least(f.block_size, self.block_size) or rules.at_least(f.parallel_size, P)
                   or rules.clean_shards_problem(self.mode, P, self.clean_shards, f)
                   or rules.world_size_problem(TP, PP, P, self.world_size or TP * PP * P, f)
                   or rules.expert_parallel_problem(self.num_experts, self.expert_parallel_size,
                                                    self.expert_tensor_parallel_size, TP, PP,
                                                    self.world_size or TP * PP * P, f)
                   or rules.sequence_problem(self.mode, self.seq_length, self.block_size, P,
                                             rules.clean_shards(self.mode, P, self.clean_shards), self.clean_layout, f)
                   or rules.choice_problem(f.schedule, self.schedule, rules.SCHEDULES)
                   or rules.choice_problem("--csbp-transport", self.transport, rules.TRANSPORTS)
                   or rules.noise_range_problem(*self.noise_range)
                   or rules.packing_problem(self.reset_position_ids, self.reset_attention_mask, PP, flags=f)
                   or rules.loss_weighting_problem(self.objective, self.loss_weighting))
        if problem or self.global_batch_size is None:
            return problem
        data_parallel = (self.world_size or TP * PP * P) // (TP * PP * P)
        return rules.batch_problem(self.global_batch_size, self.micro_batch_size, data_parallel, f)

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one model replica's sample: TP x PP x P."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.block_parallel_size

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.model_parallel_size

    @property
    def parallel_mode(self) -> modes.ParallelMode:
        return modes.parallel_mode(self.mode)

    @property
    def objective_kind(self) -> objectives.ObjectiveKind:
        return objectives.objective_kind(self.objective)

    @property
    def transport_kind(self) -> transports.Transport:
        return transports.transport(self.transport)

    def layout(self, rank: int):
        """The rows block-parallel rank `rank` holds."""
        return self.parallel_mode.layout(self.seq_length, self.block_size, self.block_parallel_size,
                                         self.clean_shards, rank, schedule=self.schedule,
                                         clean_layout=self.clean_layout)
