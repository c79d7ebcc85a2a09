"""The BDLM run as the plugin sees it: one frozen value, read from the flags once, validated once, handed down.

Like megatron-core's `TransformerConfig`, a `RunConfig` is built once — by the trainer from either loop's
parsed arguments (`RunConfig.from_args`, the one place the plugin reads its flags), by the planner for each
candidate layout — and checked in `__post_init__` by the rules (`core.rules`), in one order, so a layout the
planner proposes is one the trainer accepts and a refusal reads the same wherever it is met. It holds the
variants themselves (the parallel mode, the objective, the transport, the block schedule, the clean layout,
the clean-attention rule: objects stating their own facts, `core.variants`), the model's shape
(`core.model_shape.ModelShape`) and its RoPE variant (`core.positions.RotaryPositions`). What the flags leave to
defaults (the clean shards `C`, the loss weighting, the sizes, the ETP, the global batch) it resolves once;
nothing downstream re-derives them. The block-parallel size `P` and `C` live here; a rank's rows are `layout(rank)`.

Megatron's own code (Megatron-LM's checkpoints and FLOPs count, our loop's configs) reads some resolved values
off the parsed arguments: `write_back` writes those, and only those.

Standard library only (the planner runs without torch); `layout()` builds a torch layout when called.
"""

import dataclasses

from megatron_csbp.core import modes, objectives, rules, transports, windows
from megatron_csbp.core.clean_attention import BLOCK_CAUSAL, CLEAN_ATTENTIONS, CleanAttention
from megatron_csbp.core.model_shape import Gemma4AttentionShape, LinearAttentionShape, ModelShape, MoEShape
from megatron_csbp.core.positions import RotaryPositions
from megatron_csbp.core.schedule import CLEAN_LAYOUTS, DUAL_END, SCHEDULES, ZIGZAG, BlockSchedule, CleanLayout


LINEAR_SIZES = ("conv_kernel_dim", "key_head_dim", "value_head_dim", "num_key_heads", "num_value_heads")


def _gemma4_attention(args, groups: int) -> Gemma4AttentionShape | None:
    """Gemma 4's attention of the flags (None: off, or a checkpoint recorded before the flag), defaults filled: the
    global layers' head size and K/V heads are the model's unless given."""
    if not getattr(args, "gemma4_attention", False):
        return None
    head = args.kv_channels or args.hidden_size // args.num_attention_heads
    return Gemma4AttentionShape(head if args.global_kv_channels is None else args.global_kv_channels,
                                groups if args.global_num_query_groups is None else args.global_num_query_groups,
                                args.global_rotary_base, args.global_rotary_percent)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Model shape, sequence, objective and parallel layout of one BDLM run (the trainer flags' meanings)."""

    shape: ModelShape
    seq_length: int  # L, clean tokens per sample
    block_size: int  # B, the diffusion block
    positions: RotaryPositions = RotaryPositions()  # YaRN and the query scaling (plain RoPE: neither)
    # the objective
    objective: objectives.ObjectiveKind = objectives.BD3LM
    loss_weighting: str | None = None  # None: the objective's default
    noise_range: tuple = (1e-3, 1.0)
    antithetic_noise: bool = True  # noise times stratified over each global batch (else i.i.d.)
    seed: int = 1234  # the noise is drawn from (seed, sample index)
    clean_attention: CleanAttention = BLOCK_CAUSAL
    # sliding-window layers, megatron-core's `window_size` (LEFT, 0) and `window_attn_skip_freq` (`core.windows`)
    window_size: tuple | None = None
    window_attn_skip_freq: int | tuple | None = None
    diffusion_loss_weight: float = 1.0  # the weight of the diffusion loss on the noisy rows
    ar_loss_weight: float = 0.0  # the weight of the next-token loss on the clean rows (0: none)
    self_conditioning_probability: float | None = None  # chance a sample is self-conditioned (None: the objective's)
    logits_tile_rows: int | None = None  # the loss as a tiled linear cross-entropy over tiles of these rows (None: off)
    final_logit_softcapping: float | None = None  # logits = cap · tanh(logits / cap) (None: off)
    scale_embeddings: bool = False  # input embeddings times sqrt(hidden size), as Gemma's
    # the layout
    mode: modes.ParallelMode = modes.CSBP
    block_parallel_size: int = 1  # P, in Megatron's CP slot
    clean_shards: int | None = None  # C (None: the mode's default)
    schedule: BlockSchedule = DUAL_END
    clean_layout: CleanLayout = ZIGZAG
    transport: transports.Transport = transports.COLLECTIVE
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    world_size: int | None = None  # None: one model replica (TP x PP x P)
    # mixture of experts (`shape.moe`): EP x ETP x expert-DP is carved from each stage's TP x P x DP ranks
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
        f = self.flags
        variants = dict(objective=(objectives.OBJECTIVES, "--bdlm-objective"), mode=(modes.PARALLEL_MODES, f.mode),
                        schedule=(SCHEDULES, f.schedule), clean_layout=(CLEAN_LAYOUTS, f.clean_layout),
                        transport=(transports.TRANSPORTS, "--csbp-transport"),
                        clean_attention=(CLEAN_ATTENTIONS, "--bdlm-clean-attention"))
        for name, (registry, flag) in variants.items():  # a library caller may name a variant
            rules.refuse(registry.problem(getattr(self, name), flag), rules.ConfigError)
            object.__setattr__(self, name, registry(getattr(self, name)))
        for name in ("window_size", "window_attn_skip_freq"):  # a list (the flags' reading) held as a tuple
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        rules.refuse(self.problem(), rules.ConfigError)
        resolved = dict(
            loss_weighting=self.loss_weighting or self.objective.default_weighting,
            self_conditioning_probability=(self.objective.self_conditioning_probability
                                           if self.self_conditioning_probability is None
                                           else float(self.self_conditioning_probability)),
            clean_shards=self.mode.clean_shards(self.block_parallel_size, self.clean_shards),
            world_size=self.world_size or self.model_parallel_size,
            expert_tensor_parallel_size=self.expert_tensor_parallel_size or self.tensor_parallel_size)
        resolved["global_batch_size"] = (self.global_batch_size
                                         or self.micro_batch_size * resolved["world_size"] // self.model_parallel_size)
        for name, value in resolved.items():
            object.__setattr__(self, name, value)

    def problem(self) -> str | None:
        """The first rule the settings break (one line: flag and fix), in the trainer's order, or None."""
        f, P, TP, PP = self.flags, self.block_parallel_size, self.tensor_parallel_size, self.pipeline_parallel_size
        for flag, value in ((f.seq_length, self.seq_length), (f.micro_batch, self.micro_batch_size)):
            if value is None:
                return f"{flag} is required"
        shape, world = self.shape, self.world_size or TP * PP * P
        problem = (rules.tensor_parallel_problem(shape.num_attention_heads, shape.num_query_groups, TP, f)
                   or rules.pipeline_problem(shape.num_layers, PP, f)
                   or rules.at_least(f.block_size, self.block_size) or rules.at_least(f.parallel_size, P)
                   or rules.clean_shards_problem(self.mode, P, self.clean_shards, f)
                   or rules.world_size_problem(TP, PP, P, world, f)
                   or rules.expert_parallel_problem(shape.moe and shape.moe.num_experts, self.expert_parallel_size,
                                                    self.expert_tensor_parallel_size, TP, PP, world, f)
                   or rules.sequence_problem(self.mode, self.seq_length, self.block_size, P,
                                             self.mode.clean_shards(P, self.clean_shards), self.clean_layout, f)
                   or rules.noise_range_problem(*self.noise_range)
                   or rules.packing_problem(self.reset_position_ids, self.reset_attention_mask, PP, flags=f)
                   or rules.loss_weighting_problem(self.objective, self.loss_weighting)
                   or rules.loss_parts_problem(self.objective, self.clean_attention, self.diffusion_loss_weight,
                                               self.ar_loss_weight)
                   or rules.causal_encoder_problem(self.objective, self.clean_attention)
                   or (rules.self_conditioning_problem(self.objective, self.self_conditioning_probability, PP)
                       if self.self_conditioning_probability is not None else None)
                   or (rules.at_least(f.logits_tile_rows, self.logits_tile_rows)
                       if self.logits_tile_rows is not None else None)
                   or (f"--final-logit-softcapping {self.final_logit_softcapping} must be > 0 (omit it: no cap)"
                       if self.final_logit_softcapping is not None and not self.final_logit_softcapping > 0 else None)
                   or windows.window_size_problem(self.window_size, self.window_attn_skip_freq, shape.num_layers)
                   or self._linear_attention_problem()
                   or (self._gemma4_attention_problem() if shape.gemma4_attention is not None else None))
        if problem or self.global_batch_size is None:
            return problem
        return rules.batch_problem(self.global_batch_size, self.micro_batch_size, world // (TP * PP * P), f)

    def _gemma4_attention_problem(self) -> str | None:
        """What Gemma 4's attention cannot take of this run (one line), or None."""
        if not (self.shape.moe and self.shape.moe.gemma4):
            return ("--gemma4-attention builds DiffusionGemma's layers, whose feed-forward block is Gemma 4's: add "
                    "--gemma4-moe")
        if self.positions.yarn is not None or self.positions.query_scaling is not None:
            return ("--gemma4-attention takes plain RoPE on sliding layers and proportional RoPE on global ones: drop "
                    "--position-embedding-type yarn and --llama-4-scaling-beta")
        return self.shape.gemma4_attention.problem(self.shape.num_attention_heads, self.tensor_parallel_size,
                                                   self.flags.tensor_parallel)

    def _linear_attention_problem(self) -> str | None:
        """What Gated DeltaNet layers cannot do of this run (one line), or None."""
        linear = self.shape.linear
        if linear is None:
            return None
        if self.packed:
            flag = "--reset-attention-mask" if self.reset_attention_mask else "--reset-position-ids"
            return (f"{flag}: Gated DeltaNet layers carry their state across a packed sample's documents (it is not "
                    f"reset per document yet); drop {flag}, or train without --experimental-attention-variant")
        return (linear.problem(self.tensor_parallel_size, self.flags.tensor_parallel)
                or rules.conv_history_problem(self.block_size, linear.conv_kernel_dim, self.flags))

    @classmethod
    def from_args(cls, args, world_size: int | None = None) -> "RunConfig":
        """The run of either loop's parsed arguments (ours, or Megatron-LM's with the plugin's flags): the one
        place the plugin reads its flags and the model's sizes. `world_size`: the launch's (default: the
        arguments' `world_size`, else one model replica)."""
        heads = args.num_attention_heads
        groups = args.num_query_groups if args.group_query_attention else heads
        experts = getattr(args, "num_experts", None) or None  # Megatron-LM reads 0 as none
        moe = None if experts is None or args.num_layers is None else MoEShape(
            experts, args.moe_router_topk, args.moe_ffn_hidden_size,
            sum(rules.moe_layer_pattern(args.moe_layer_freq, args.num_layers)),
            args.moe_shared_expert_intermediate_size or 0, gemma4=bool(getattr(args, "gemma4_moe", False)))
        linear = LinearAttentionShape.from_flags(  # checkpoints recorded before these flags hold none of them
            getattr(args, "experimental_attention_variant", None), getattr(args, "linear_attention_freq", None),
            args.num_layers, **{name: getattr(args, "linear_" + name) for name in LINEAR_SIZES
                                if getattr(args, "linear_" + name, None) is not None})
        shape = ModelShape(
            num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=heads,
            num_query_groups=groups, kv_channels=args.kv_channels, ffn_hidden_size=args.ffn_hidden_size,
            swiglu=args.swiglu or bool(moe and moe.gemma4),  # gated MLPs (Gemma 4's GELU-tanh ones too)
            add_bias_linear=args.add_bias_linear,
            layernorm_bias=args.normalization == "LayerNorm", untied_output=args.untie_embeddings_and_output_weights,
            moe=moe, linear=linear, attention_output_gate=bool(getattr(args, "attention_output_gate", False)),
            layernorm_1p=bool(getattr(args, "apply_layernorm_1p", False)),
            gemma4_attention=_gemma4_attention(args, groups))
        return cls(
            shape=shape, seq_length=args.seq_length, block_size=args.bdlm_block_size,
            positions=RotaryPositions.from_args(args),
            objective=args.bdlm_objective, loss_weighting=args.bdlm_loss_weighting,
            clean_attention=args.bdlm_clean_attention, diffusion_loss_weight=args.bdlm_diffusion_loss_weight,
            window_size=getattr(args, "window_size", None),
            window_attn_skip_freq=getattr(args, "window_attn_skip_freq", None),
            ar_loss_weight=args.bdlm_ar_loss_weight,
            self_conditioning_probability=args.bdlm_self_conditioning_probability,
            final_logit_softcapping=args.final_logit_softcapping, scale_embeddings=args.scale_embeddings,
            logits_tile_rows=args.cross_entropy_tile_rows if args.cross_entropy_loss_fusion else None,
            noise_range=tuple(args.bdlm_noise_range), antithetic_noise=args.bdlm_noise_sampling == "antithetic",
            seed=args.seed, mode=args.bdlm_parallel_mode,
            block_parallel_size=args.context_parallel_size,  # Megatron's CP slot (`--context-block-parallel` fills it)
            clean_shards=args.context_block_parallel_clean_shards, schedule=args.csbp_block_schedule,
            clean_layout=args.csbp_clean_layout, transport=args.csbp_transport,
            tensor_parallel_size=args.tensor_model_parallel_size,
            pipeline_parallel_size=args.pipeline_model_parallel_size,
            world_size=world_size or getattr(args, "world_size", None), micro_batch_size=args.micro_batch_size,
            global_batch_size=args.global_batch_size, reset_position_ids=bool(args.reset_position_ids),
            reset_attention_mask=bool(args.reset_attention_mask), eod_mask_loss=bool(args.eod_mask_loss),
            expert_parallel_size=args.expert_model_parallel_size,
            expert_tensor_parallel_size=args.expert_tensor_parallel_size)

    def write_back(self, args) -> None:
        """Writes onto parsed `args` the resolved values Megatron's code reads there, as Megatron-LM's own
        `validate_args` fills them: the sizes (`TransformerConfig` and the FLOPs count read them), the expert
        sizes, the batch and the world (the schedule and the checkpoints' record). Megatron-LM's loop has filled
        them already by the same rules; our loop's arguments get them here."""
        shape = self.shape
        values = dict(num_query_groups=shape.num_query_groups, kv_channels=shape.kv_channels,
                      ffn_hidden_size=shape.ffn_hidden_size, num_experts=shape.moe and shape.moe.num_experts,
                      expert_tensor_parallel_size=self.expert_tensor_parallel_size,
                      global_batch_size=self.global_batch_size, world_size=self.world_size,
                      data_parallel_size=self.data_parallel_size)
        if shape.moe is not None:
            values["moe_ffn_hidden_size"] = shape.moe.ffn_hidden_size
        for name, value in values.items():
            setattr(args, name, value)

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one model replica's sample: TP x PP x P."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.block_parallel_size

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.model_parallel_size

    @property
    def clean_logits(self) -> bool:
        """Whether the LM head also runs over the clean rows (their next-token loss)."""
        return self.ar_loss_weight > 0

    @property
    def self_conditioning(self) -> bool:
        """Whether the model takes a self-conditioning signal (its module exists even when the chance is 0)."""
        return self.objective.self_conditioning_probability > 0

    @property
    def embedding_scale(self) -> float | None:
        """The input embeddings' multiplier (None: 1)."""
        return self.shape.hidden_size ** 0.5 if self.scale_embeddings else None

    @property
    def model_ends(self) -> dict:
        """The model keywords for what wraps its layers: the self-conditioning input, the embedding scale, the
        logits' softcap. Every model of a checkpoint (training, sampling, the harness's scoring) is built with
        them, so its weights load alike and its logits mean the same in each."""
        return dict(self_conditioning=self.self_conditioning, final_logit_softcapping=self.final_logit_softcapping,
                    embedding_scale=self.embedding_scale)

    @property
    def packed(self) -> bool:
        """Whether samples hold several documents (each row's RoPE position or keys depend on its document)."""
        return self.reset_position_ids or self.reset_attention_mask

    @property
    def layer_windows(self) -> tuple:
        """The window of each layer, first to last (`core.windows.GLOBAL` or a `Sliding`): megatron-core's reading
        of `window_size` and `window_attn_skip_freq`."""
        return windows.layer_windows(self.window_size, self.window_attn_skip_freq, self.shape.num_layers)

    def layout(self, rank: int, window=windows.GLOBAL):
        """The rows block-parallel rank `rank` holds (with the mask of a layer of `window`)."""
        from megatron_csbp.core.layout import layout_for

        return layout_for(self.mode, self.seq_length, self.block_size, self.block_parallel_size, self.clean_shards,
                          rank, schedule=self.schedule, clean_layout=self.clean_layout,
                          clean_attention=self.clean_attention, window=window)
