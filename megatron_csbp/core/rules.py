"""Every rule a BDLM run must satisfy, and every choice list, in one place.

The trainer's validation (`arguments`, both entry paths), the layouts, the planner, the bench, the FLOP
counter, the objective, the parallel state and `scripts/gpu_check.py` ask here, so a topology the planner
proposes is one the trainer accepts, and a refusal reads the same wherever it is met.

A rule returns None when it holds, else one line naming the flag and a valid alternative; the caller
raises it as its own kind of error (`ConfigError`, defined here, at the entry paths, `ValueError` in the
library, `parser.error` in the tools). Messages name the trainer's flags (`FLAGS`); a tool whose flags
are named otherwise passes its own names (`FLAGS.renamed(seq_length="--seq-lengths", ...)`).

Standard library only: the planner, the FLOP counter and config checks run without torch or Megatron.
"""

import dataclasses

from megatron_csbp.core import modes, objectives, schedule, transports


class ConfigError(ValueError):
    """A refused argument or input file. An ordinary exception, raised wherever the refusal is found; each
    entry (`scripts/*.py`, `python -m megatron_csbp.torchrun`, `plan`) catches it once and prints it as one
    line, exit status 2."""


# --- choice lists ----------------------------------------------------------------------------------

# The variants' registries (`core.variants.Registry`: iterating one gives its names, a flag's choices).
PARALLEL_MODES = modes.PARALLEL_MODES  # each a `modes.ParallelMode` stating its facts
TRANSPORTS = transports.TRANSPORTS  # each a `transports.Transport`
SCHEDULES = schedule.SCHEDULES  # how noisy blocks are dealt to ranks
CLEAN_LAYOUTS = schedule.CLEAN_LAYOUTS  # how a ring shards the clean sequence
OBJECTIVES = objectives.OBJECTIVES  # each an `objectives.ObjectiveKind`
LOSS_WEIGHTINGS = objectives.LOSS_WEIGHTINGS
NOISE_SAMPLINGS = ("antithetic", "iid")
RECOMPUTE_GRANULARITIES = ("full", "selective")
# megatron-core's selective-recompute submodules (`TransformerConfig.recompute_modules`; see `recompute_problem`).
RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm", "moe", "shared_experts", "moe_act", "mla_up_proj")
DEFAULT_RECOMPUTE_MODULES = ("core_attn",)
BYTE_TOKENIZER = "ByteLevelTokenizer"
TEXT_TOKENIZERS = (BYTE_TOKENIZER, "HuggingFaceTokenizer")  # those that turn text into ids
TOKENIZERS = TEXT_TOKENIZERS + ("NullTokenizer",)
MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128  # Megatron-LM's default
# --cross-entropy-fusion-impl: the values of Megatron-LM's that the tiled linear cross-entropy stands for, and its tile
CROSS_ENTROPY_FUSION_IMPLS = ("native",)
CROSS_ENTROPY_TILE_ROWS = 1024
# Mixture of experts: what routes each token alike on every layout (see `moe_problem`).
MOE_LOAD_BALANCING = ("aux_loss", "none")
MOE_SCORE_FUNCTIONS = ("softmax", "sigmoid")
MOE_DISPATCHERS = ("alltoall", "allgather")
# The most transformer layers a model may have (the deepest trained are about a thousand): it bounds
# `--num-layers` and a `--moe-layer-freq` pattern, which is read before the model it describes exists.
MAX_LAYERS = 10_000


@dataclasses.dataclass(frozen=True)
class Flags:
    """The flag each message names: the trainer's by default (`FLAGS`)."""
    seq_length: str = "--seq-length"
    block_size: str = "--bdlm-block-size"
    parallel_size: str = "--context-block-parallel"
    clean_shards: str = "--context-block-parallel-clean-shards"
    mode: str = "--bdlm-parallel-mode"
    clean_layout: str = "--csbp-clean-layout"
    schedule: str = "--csbp-block-schedule"
    tensor_parallel: str = "--tensor-model-parallel-size"
    pipeline_parallel: str = "--pipeline-model-parallel-size"
    num_layers: str = "--num-layers"
    hidden_size: str = "--hidden-size"
    heads: str = "--num-attention-heads"
    query_groups: str = "--num-query-groups"
    kv_channels: str | None = "--kv-channels"  # None: the tool has no such flag
    global_batch: str = "--global-batch-size"
    micro_batch: str = "--micro-batch-size"
    num_experts: str = "--num-experts"
    expert_parallel: str = "--expert-model-parallel-size"
    expert_tensor_parallel: str = "--expert-tensor-parallel-size"
    logits_tile_rows: str = "--cross-entropy-tile-rows"

    def renamed(self, **names) -> "Flags":
        return dataclasses.replace(self, **names)


FLAGS = Flags()


def refuse(problem: str | None, error: type = ValueError) -> None:
    """Raises `error(problem)` when a rule found a problem."""
    if problem:
        raise error(problem)


def choice_problem(flag: str, value, choices) -> str | None:
    if value in choices:
        return None
    return f"{flag} {value!r}: choose one of {', '.join(choices)}"


def at_least(flag: str, value, minimum=1) -> str | None:
    if value >= minimum:
        return None
    return f"{flag} must be >= {minimum}; got {value}"


# --- how many clean shards, and the layout's geometry ----------------------------------------------

def clean_shards(mode, parallel_size: int, given: int | None = None) -> int:
    """`C` of `mode`: 1 for pure BP, `P` for the CP baseline (one ring shards both copies), else `given` or `P`."""
    return modes.parallel_mode(mode).clean_shards(parallel_size, given)


def clean_shards_problem(mode, parallel_size: int, given: int | None = None, flags: Flags = FLAGS) -> str | None:
    """`given` (the clean-shards flag, None when unset) must suit `mode`, and `C` must divide `P`."""
    P = parallel_size
    problem = PARALLEL_MODES.problem(mode, flags.mode)
    if problem:
        return problem
    mode = modes.parallel_mode(mode)
    problem = mode.clean_shards_problem(P, given, flags)
    if problem:
        return problem
    C = mode.clean_shards(P, given)
    if not (C >= 1 and P % C == 0):
        return (f"{flags.parallel_size} {P} is not a multiple of {flags.clean_shards} {C}; use a divisor of {P} "
                f"(default {P})")
    return None


def whole_blocks_problem(seq_length: int, block_size: int, flags: Flags = FLAGS) -> str | None:
    """`L` is a whole number of diffusion blocks."""
    L, B = seq_length, block_size
    problem = at_least(flags.block_size, B) or at_least(flags.seq_length, L)
    if problem or L % B == 0:
        return problem
    return (f"{flags.seq_length} {L} is not a multiple of {flags.block_size} {B}; use {flags.seq_length} "
            f"{max(L - L % B, B)} or a block size dividing {L}")


def sequence_problem(mode, seq_length: int, block_size: int, parallel_size: int, clean_shards: int,
                     clean_layout=schedule.ZIGZAG, flags: Flags = FLAGS) -> str | None:
    """The layout geometry of `mode` over `P` ranks with `C` clean shards (docs/algorithm.md §4):

    whole blocks; a noisy block for every rank; then the mode's own cut (`ParallelMode.geometry_problem`):
    conventional CP's `2P` zigzag chunks of `[x_t ; x_0]` hold whole blocks (a noisy block never straddles
    two ranks); CSBP's clean sequence cuts into the equal chunks of its clean layout (`2C` zigzag, `C`
    contiguous).
    """
    L, B, P, C = seq_length, block_size, parallel_size, clean_shards
    problem = (whole_blocks_problem(L, B, flags) or at_least(flags.parallel_size, P)
               or at_least(flags.clean_shards, C) or CLEAN_LAYOUTS.problem(clean_layout, flags.clean_layout))
    if problem:
        return problem
    if L // B < P:
        return (f"{flags.seq_length} {L} has {L // B} blocks of {B}, too few for {flags.parallel_size} {P} (every rank "
                f"needs a block); use {flags.seq_length} >= {P * B} or a smaller block size")
    return modes.parallel_mode(mode).geometry_problem(L, B, P, C, CLEAN_LAYOUTS(clean_layout), flags)


def layout_problem(mode, seq_length: int, block_size: int, parallel_size: int, given_clean_shards=None,
                   block_schedule=schedule.DUAL_END, clean_layout=schedule.ZIGZAG, flags: Flags = FLAGS) -> str | None:
    """Everything a layout of `mode` needs: its clean shards, its block schedule and its geometry."""
    return (clean_shards_problem(mode, parallel_size, given_clean_shards, flags)
            or SCHEDULES.problem(block_schedule, flags.schedule)
            or sequence_problem(mode, seq_length, block_size, parallel_size,
                                clean_shards(mode, parallel_size, given_clean_shards), clean_layout, flags))


# --- model and parallel sizes ----------------------------------------------------------------------

def world_size_problem(tensor_parallel: int, pipeline_parallel: int, parallel_size: int, world_size: int,
                       flags: Flags = FLAGS) -> str | None:
    """Data parallelism is what is left of the world: TP x PP x P must divide it."""
    model_parallel = tensor_parallel * pipeline_parallel * parallel_size
    if world_size % model_parallel == 0:
        return None
    return (f"{flags.tensor_parallel} {tensor_parallel} x {flags.pipeline_parallel} {pipeline_parallel} x "
            f"{flags.parallel_size} {parallel_size} = {model_parallel} does not divide the world size {world_size}; "
            f"launch a multiple of {model_parallel} ranks or shrink the parallel sizes")


def expert_parallel_problem(num_experts: int | None, expert_parallel: int, expert_tensor_parallel: int | None,
                            tensor_parallel: int, pipeline_parallel: int, world_size: int,
                            flags: Flags = FLAGS) -> str | None:
    """Expert parallelism as megatron-core lays it out: each pipeline stage's ranks (TP x P x DP for attention)
    are cut again into ETP x EP x expert-DP for the experts, so EP x ETP x PP must divide the world, and each EP
    rank holds `num_experts / EP` whole experts. ETP defaults to TP."""
    EP, PP = expert_parallel, pipeline_parallel
    ETP = expert_tensor_parallel or tensor_parallel
    problem = at_least(flags.expert_parallel, EP) or at_least(flags.expert_tensor_parallel, ETP)
    if problem:
        return problem
    if num_experts is None:
        if EP > 1:
            return f"{flags.expert_parallel} {EP} needs experts: give {flags.num_experts} N (a multiple of {EP})"
        return None
    if num_experts < 1:
        return f"{flags.num_experts} must be >= 1; got {num_experts} (drop it for a dense model)"
    if num_experts % EP:
        return (f"{flags.expert_parallel} {EP} does not divide {flags.num_experts} {num_experts}: each expert-parallel "
                f"rank holds whole experts; use an EP size dividing {num_experts}")
    expert_ranks = EP * ETP * PP
    if world_size % expert_ranks:
        return (f"{flags.expert_parallel} {EP} x {flags.expert_tensor_parallel} {ETP} x {flags.pipeline_parallel} {PP} "
                f"= {expert_ranks} does not divide the world size {world_size}: megatron-core carves the expert "
                f"ranks (EP x ETP x expert-DP) out of each pipeline stage's ranks; shrink EP or ETP, or launch a "
                f"multiple of {expert_ranks} ranks")
    return None


def moe_problem(num_experts: int, topk: int, load_balancing, dispatcher: str, tensor_parallel: int,
                expert_parallel: int, sequence_parallel: bool, pipeline_parallel: int, shared_expert: bool = False,
                bias: bool = False, score_function: str = "softmax", pre_softmax: bool = False) -> str | None:
    """What a mixture-of-experts BDLM needs so that each token is routed alike on every layout.

    Routing must see each row on its own: `seq_aux_loss`, `global_aux_loss` and `sinkhorn` balance over per-rank
    sets of rows, which CSBP's `[noisy ; clean]` rows and their sharding change; `aux_loss` (its expert fractions
    summed over TP x CP) and `none` do not depend on the layout. (Token dropping, a capacity factor, is refused
    by the flag table for the same reason.) The allgather dispatcher cannot take the variable-shape pipeline
    messages CSBP rows need."""
    balancing = load_balancing[0] if isinstance(load_balancing, (list, tuple)) and len(load_balancing) == 1 \
        else load_balancing
    if not 1 <= topk <= num_experts:
        return f"--moe-router-topk {topk} must be in [1, --num-experts {num_experts}]"
    if topk == 1 and score_function == "softmax" and not pre_softmax:
        return ("--moe-router-topk 1 with a softmax over the top k gives every token weight 1 and the router no "
                "gradient (megatron-core refuses it); add --moe-router-pre-softmax")
    if isinstance(balancing, (list, tuple)) or balancing not in MOE_LOAD_BALANCING:
        return (f"--moe-router-load-balancing-type {balancing}: only {' or '.join(MOE_LOAD_BALANCING)} route every "
                f"row alike under CSBP (the others balance over each rank's own rows, which the layout changes); "
                f"use aux_loss")
    problem = choice_problem("--moe-token-dispatcher-type", dispatcher, MOE_DISPATCHERS)
    if problem:
        return problem
    if dispatcher == "allgather" and pipeline_parallel > 1:
        return ("--moe-token-dispatcher-type allgather cannot take the variable-shape pipeline messages of CSBP rows "
                "(--pipeline-model-parallel-size > 1); use --moe-token-dispatcher-type alltoall")
    if shared_expert and bias:
        return ("--moe-shared-expert-intermediate-size: megatron-core's shared expert has no biases; add "
                "--disable-bias-linear")
    if expert_parallel > 1 and tensor_parallel > 1 and not sequence_parallel:
        return ("--expert-model-parallel-size > 1 with --tensor-model-parallel-size > 1 needs --sequence-parallel "
                "(megatron-core's MoE layers take sequence-parallel rows then); add --sequence-parallel")
    return None


def gemma4_moe_problem(num_experts, moe_layer_pattern, shared_expert_size, swiglu: bool, score_function: str,
                       pre_softmax: bool) -> str | None:
    """What Gemma 4's feed-forward block (`--gemma4-moe`: a dense MLP beside the routed experts, every layer,
    gated GELU-tanh MLPs, a softmax over the top k; `mcore.gemma4_moe`) cannot take of the MoE flags, or None."""
    if not num_experts:
        return "--gemma4-moe builds a mixture of experts: give --num-experts N (and --moe-router-topk K)"
    if not all(moe_layer_pattern):
        return ("--gemma4-moe: every Gemma 4 layer has the MoE block, but --moe-layer-freq makes dense layers; give "
                "--moe-layer-freq 1")
    if not shared_expert_size:
        return ("--gemma4-moe needs --moe-shared-expert-intermediate-size: the dense MLP's size beside the experts "
                "(transformers' intermediate_size)")
    if swiglu:
        return "--gemma4-moe's MLPs are gated GELU-tanh, not SwiGLU: drop --swiglu"
    if score_function != "softmax" or pre_softmax:
        return ("--gemma4-moe weighs the top-k experts by a softmax over the top k: give --moe-router-score-function "
                "softmax without --moe-router-pre-softmax")
    return None


def moe_layer_freq_problem(layer_freq, num_layers: int) -> str | None:
    """`--moe-layer-freq`: every N-th layer MoE (N >= 1), or a 0/1 pattern naming every layer."""
    if isinstance(layer_freq, int):
        return None if layer_freq >= 1 else f"--moe-layer-freq must be >= 1; got {layer_freq}"
    if len(layer_freq) == num_layers:
        return None
    return (f"--moe-layer-freq {layer_freq} names {len(layer_freq)} layers, but --num-layers is {num_layers}: give "
            f"one 0 (dense) or 1 (MoE) per layer, or an int N (every N-th layer MoE)")


def moe_layer_pattern(layer_freq, num_layers: int) -> list[int]:
    """`--moe-layer-freq` as one 0 (dense) or 1 (MoE) per layer, as megatron-core reads it: an int N makes layers
    0, N, 2N, ... MoE; a list is the pattern itself."""
    if isinstance(layer_freq, int):
        return [int(layer % layer_freq == 0) for layer in range(num_layers)]
    return [int(bool(value)) for value in layer_freq]


GATED_DELTA_CHUNK = 64  # tokens the chunked gated delta rule solves at once (fla's chunk size)


def conv_history_problem(block_size: int, conv_width: int, flags: Flags = FLAGS) -> str | None:
    """A Gated DeltaNet layer's convolution reads the `W - 1` tokens before each block from the block before it."""
    if conv_width - 1 <= block_size:
        return None
    return (f"{flags.block_size} {block_size} is shorter than the convolution's history (--linear-conv-kernel-dim "
            f"{conv_width} reads {conv_width - 1} earlier tokens): use a block of at least {conv_width - 1}")


def query_groups_problem(heads: int, query_groups: int, flags: Flags = FLAGS) -> str | None:
    """GQA: every K/V head serves the same number of query heads."""
    if query_groups >= 1 and heads % query_groups == 0:
        return None
    return (f"{flags.heads} {heads} is not a multiple of {flags.query_groups} {query_groups}; use a number of query "
            f"groups dividing {heads}")


def tensor_parallel_problem(heads: int, query_groups: int, tensor_parallel: int, flags: Flags = FLAGS) -> str | None:
    """megatron-core splits the query heads and the K/V heads (query groups) evenly over TP ranks."""
    TP = tensor_parallel
    if heads % TP:
        return f"{flags.tensor_parallel} {TP} does not divide {flags.heads} {heads}; use a TP size dividing {heads}"
    if query_groups % TP:
        return (f"{flags.tensor_parallel} {TP} does not divide {flags.query_groups} {query_groups}; use a TP size "
                f"dividing {query_groups} or more query groups")
    return None


def pipeline_problem(num_layers: int, pipeline_parallel: int, flags: Flags = FLAGS) -> str | None:
    if num_layers % pipeline_parallel == 0:
        return None
    return (f"{flags.pipeline_parallel} {pipeline_parallel} does not divide {flags.num_layers} {num_layers}; use a PP "
            f"size dividing {num_layers}")


def kv_channels_problem(hidden_size: int, heads: int, flags: Flags = FLAGS) -> str | None:
    """The default head size, `hidden / heads`, must be whole."""
    if hidden_size % heads == 0:
        return None
    fix = f"set {flags.kv_channels}" if flags.kv_channels else f"use a multiple of {heads}"
    return f"{flags.hidden_size} {hidden_size} is not a multiple of {flags.heads} {heads}; {fix}"


def batch_problem(global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                  flags: Flags = FLAGS) -> str | None:
    """A step is whole micro-batches on every data-parallel replica."""
    step = micro_batch_size * data_parallel_size
    if global_batch_size % step == 0:
        return None
    return (f"{flags.global_batch} {global_batch_size} is not a multiple of {flags.micro_batch} {micro_batch_size} x "
            f"data-parallel size {data_parallel_size}; use a multiple of {step}")


def packing_problem(reset_position_ids: bool, reset_attention_mask: bool, pipeline_parallel: int,
                    virtual_pipeline: bool = False, flags: Flags = FLAGS) -> str | None:
    """Packed documents (`--reset-position-ids`, `--reset-attention-mask`) need each micro-batch's documents on every
    pipeline stage that runs layers; only the first and last stages read the batch."""
    if not (reset_position_ids or reset_attention_mask):
        return None
    flag = "--reset-attention-mask" if reset_attention_mask else "--reset-position-ids"
    if pipeline_parallel > 2:
        return (f"{flag} with {flags.pipeline_parallel}={pipeline_parallel}: the middle stages never read the batch, "
                f"so they cannot know its documents; use {flags.pipeline_parallel} 2 or less, or drop {flag}")
    if virtual_pipeline:
        return (f"{flag} with a virtual pipeline: its middle model chunks never read the batch, so they cannot know "
                f"its documents; drop --num-layers-per-virtual-pipeline-stage or {flag}")
    return None


def default_ffn_hidden_size(hidden_size: int, swiglu: bool) -> int:
    """Megatron-LM's default: `4h`, or `8h/3` rounded down to a multiple of 64 with SwiGLU."""
    return int(4 * hidden_size * 2 / 3 / 64) * 64 if swiglu else 4 * hidden_size


def padded_vocab_size(num_ids: int, divisible_by: int = MAKE_VOCAB_SIZE_DIVISIBLE_BY, tensor_parallel: int = 1) -> int:
    """Megatron's padding: the smallest multiple of `divisible_by x TP` holding `num_ids`."""
    multiple = divisible_by * tensor_parallel
    return -(-num_ids // multiple) * multiple


def vocab_padding_problem(num_ids: int, divisible_by: int, tensor_parallel: int = 1) -> str | None:
    """Padding rows are allocated (and never trained) in the embedding and output matrices: more of them than
    real ids (beyond what Megatron's default multiple gives) is a mistake, e.g. a value that would allocate
    terabytes."""
    padding = padded_vocab_size(num_ids, divisible_by, tensor_parallel) - num_ids
    if padding <= max(num_ids, MAKE_VOCAB_SIZE_DIVISIBLE_BY * tensor_parallel):
        return None
    largest = max(num_ids // tensor_parallel, MAKE_VOCAB_SIZE_DIVISIBLE_BY)
    return (f"--make-vocab-size-divisible-by {divisible_by} (x TP {tensor_parallel}) pads the {num_ids} ids to "
            f"{num_ids + padding} rows, {padding} of them padding: use at most {largest} (Megatron's default is "
            f"{MAKE_VOCAB_SIZE_DIVISIBLE_BY})")


# --- the objective ---------------------------------------------------------------------------------

def default_loss_weighting(objective) -> str:
    """The NELBO's `1/t` for BD3-LM; Fast-dLLM v2 trains with unit weights."""
    return objectives.objective_kind(objective).default_weighting


def loss_weighting_problem(objective, loss_weighting: str | None) -> str | None:
    problem = OBJECTIVES.problem(objective)
    if problem:
        return problem
    kind = objectives.objective_kind(objective)
    weighting = loss_weighting or kind.default_weighting
    return choice_problem("--bdlm-loss-weighting", weighting, LOSS_WEIGHTINGS) or kind.weighting_problem(weighting)


def loss_parts_problem(objective, clean_attention, diffusion_weight: float, ar_weight: float) -> str | None:
    """The loss's parts (`--bdlm-diffusion-loss-weight`, `--bdlm-ar-loss-weight`): weights >= 0, not both 0. The
    autoregressive co-loss is a next-token loss on the clean rows, so a clean row must not see the tokens after
    its own (token-causal clean attention), and it is BD3-LM's: Fast-dLLM v2's own rows are next-token rows
    already, and its two complementary views would carry the clean stream twice."""
    for flag, weight in (("--bdlm-diffusion-loss-weight", diffusion_weight), ("--bdlm-ar-loss-weight", ar_weight)):
        if not weight >= 0:
            return f"{flag} {weight} must be >= 0 (0: that part is off)"
    if diffusion_weight == 0 and ar_weight == 0:
        return "--bdlm-diffusion-loss-weight and --bdlm-ar-loss-weight are both 0: nothing would be trained; give " \
               "one a weight > 0"
    if not ar_weight:
        return None
    if objectives.objective_kind(objective).views_per_sample > 1:
        return (f"--bdlm-ar-loss-weight {ar_weight} does not go with --bdlm-objective {objective}: its rows predict "
                f"the next token already and its complementary views would carry the clean stream twice; drop "
                f"--bdlm-ar-loss-weight or use --bdlm-objective {objectives.BD3LM}")
    if clean_attention.sees_the_future:
        return (f"--bdlm-ar-loss-weight {ar_weight} needs --bdlm-clean-attention token-causal: with "
                f"{clean_attention} clean attention a clean row sees the tokens after its own in its block, so its "
                f"next-token loss would read the answer")
    return None


def causal_encoder_problem(objective, clean_attention) -> str | None:
    """An objective whose clean copy is a causal LM (DiffusionGemma's encoder) needs token-causal clean rows."""
    kind = objectives.objective_kind(objective)
    if kind.encoder_is_causal and clean_attention.sees_the_future:
        return (f"--bdlm-objective {kind} reads the clean tokens with a causal encoder, not {clean_attention} clean "
                f"attention: add --bdlm-clean-attention token-causal")
    return None


def self_conditioning_problem(objective, probability: float, pipeline_parallel_size: int = 1) -> str | None:
    """`--bdlm-self-conditioning-probability`: a chance, for an objective whose model takes the signal; the first
    (detached) pass runs the whole model inside one forward step, so every stage must be one (no pipeline yet)."""
    kind = objectives.objective_kind(objective)
    if not 0 <= probability <= 1:
        return f"--bdlm-self-conditioning-probability {probability} must lie in [0, 1]"
    if probability and not kind.self_conditioning_probability:
        return (f"--bdlm-self-conditioning-probability {probability} does not go with --bdlm-objective {kind}, whose "
                f"model takes no self-conditioning signal: drop it")
    if probability and pipeline_parallel_size > 1:
        return (f"--bdlm-self-conditioning-probability {probability} needs the whole model on each rank for its first "
                f"pass: use --pipeline-model-parallel-size 1, or set it to 0")
    return None


def noise_range_problem(t_min: float, t_max: float) -> str | None:
    """Noise times are masking probabilities, and `1/t` weights need `t > 0`."""
    if 0 < t_min <= t_max <= 1:
        return None
    return f"--bdlm-noise-range {t_min} {t_max} must satisfy 0 < T_MIN <= T_MAX <= 1 (default 0.001 1)"


def recompute_modules(granularity: str | None, modules, moe_layer_recompute: bool = False) -> tuple | None:
    """The submodules selective recompute redoes, as megatron-core resolves them (None: no selective recompute):
    `--recompute-modules` (default core_attn), with moe added by the older `--moe-layer-recompute`, which selects
    selective recompute by itself. `granularity`: `--recompute-granularity` (Megatron-LM's `--recompute-activations`
    already read as selective)."""
    if moe_layer_recompute and granularity is None:
        granularity = "selective"
    if granularity != "selective":
        return None
    chosen = tuple(modules) if modules else DEFAULT_RECOMPUTE_MODULES
    return chosen + (("moe",) if moe_layer_recompute and "moe" not in chosen else ())


def recompute_problem(granularity: str | None, modules, moe_layer_recompute: bool, *, dense_layers: bool,
                      moe_layers: bool, shared_experts: bool, grouped_gemm: bool,
                      transformer_engine: bool) -> str | None:
    """Selective recompute of submodules the model has: megatron-core skips a named module a layer lacks (an MLP
    where every layer is a mixture of experts), so the memory the user asked to free would silently stay. A BDLM
    layer has the core attention (CSBP's), its norms (fused into the linear layers under Transformer Engine, where
    megatron-core has nothing to redo, as in Megatron-LM), a dense MLP where a layer is not a MoE layer, the MoE
    layer and its shared experts where configured, and the experts' activation in their grouped GEMM; never
    multi-latent attention's up-projection (MLA is refused). The norms' recompute discards its output, and
    megatron-core's output-discarding checkpoint reads Transformer Engine's FP8 state: it needs Transformer Engine
    installed (`transformer_engine`). The same line under both loops."""
    if moe_layer_recompute and granularity == "full":
        return ("--moe-layer-recompute selects selective recompute of the MoE layers, not beside --recompute-"
                "granularity full (megatron-core refuses the pair); drop one")
    if modules and recompute_modules(granularity, modules, moe_layer_recompute) is None:
        return (f"--recompute-modules {' '.join(modules)} needs --recompute-granularity selective (megatron-core "
                f"reads the modules only then); add it, or drop --recompute-modules")
    unknown = [name for name in modules or () if name not in RECOMPUTE_MODULES]
    if unknown:
        return (f"--recompute-modules {' '.join(unknown)}: not a module megatron-core recomputes; choose from "
                f"{', '.join(name for name in RECOMPUTE_MODULES if name != 'mla_up_proj')}")
    if moe_layer_recompute and not moe_layers:
        return "--moe-layer-recompute: the model has no MoE layers (--num-experts); drop it"
    no_moe = "the model has no MoE layers (--num-experts)"
    lacking = {"mlp": None if dense_layers else "every layer is a MoE layer, none has a dense MLP (--moe-layer-freq)",
               "moe": None if moe_layers else no_moe,
               "shared_experts": None if shared_experts else "the model has no shared experts "
                                                             "(--moe-shared-expert-intermediate-size)",
               "moe_act": None if moe_layers and grouped_gemm else no_moe if not moe_layers else
               "megatron-core recomputes the experts' activation only in their grouped GEMM (--moe-grouped-gemm)",
               "mla_up_proj": "the model has no multi-latent attention (refused with CSBP)"}
    if not transformer_engine:
        lacking["layernorm"] = ("megatron-core's output-discarding recompute of the norms needs Transformer Engine, "
                                "not installed here")
    missing = [name for name in modules or () if lacking.get(name)]
    if missing:
        return (f"--recompute-modules {' '.join(missing)}: {'; '.join(f'{name}: {lacking[name]}' for name in missing)}"
                f"; drop {'them' if len(missing) > 1 else 'it'}")
    return None


# --- the FLOP convention ---------------------------------------------------------------------------

# Model FLOPs, as Megatron-LM and MFU count them: the backward of every matmul is twice its forward (dX and
# dW; for attention dQ, dK, dV and dP from the saved scores), and a flash kernel's recomputation of the scores
# in its backward is not counted. A training step is then this many forwards, plus one with recompute.
BACKWARD_FLOPS_PER_FORWARD = 2


def step_passes(recompute: bool = False) -> int:
    """Forward-equivalents of FLOPs in one training step: forward, backward, and a recomputed forward."""
    return 1 + BACKWARD_FLOPS_PER_FORWARD + int(bool(recompute))


# --- what CSBP refuses of ring CP and of Megatron's attention options -------------------------------

RING_CP_REFUSALS = (
    # (attribute of the args or TransformerConfig, is it refused?, the one-line refusal)
    ("calculate_per_token_loss", lambda v: not v,
     "BDLM needs --calculate-per-token-loss (calculate_per_token_loss=True): the loss is normalised by the token "
     "count of the global batch; a mean of per-rank means gives wrong gradients"),
    ("hierarchical_context_parallel_sizes", bool,
     "--hierarchical-context-parallel-sizes is a ring-CP feature; CSBP has its own rings "
     "(--context-block-parallel-clean-shards): remove it"),
    ("cp_comm_type", lambda v: not (v in (None, "p2p") or (isinstance(v, list) and set(v) <= {"p2p"})),
     "--cp-comm-type selects a ring-CP transport that CSBP does not use; remove it (CSBP attention has its own "
     "transports: --csbp-transport)"),
    ("hybrid_context_parallel", bool, "--hybrid-context-parallel is a ring-CP feature not supported with CSBP: "
                                      "remove it"),
    ("multi_latent_attention", bool, "--multi-latent-attention is not supported with CSBP: use standard (GQA) "
                                     "attention"),
    ("mtp_num_layers", lambda v: v is not None, "--mtp-num-layers (multi-token prediction) is not supported with "
                                                "BDLM: remove it"),
    ("attention_dropout", bool, "--attention-dropout must be 0: the CSBP attention kernel has no attention-"
                                "probability dropout (hidden dropout is unaffected)"),
)


def refused_features(settings) -> list[str]:
    """The refusals of `RING_CP_REFUSALS` that apply to `settings` (parsed args or a TransformerConfig)."""
    return [message for name, refused, message in RING_CP_REFUSALS
            if hasattr(settings, name) and refused(getattr(settings, name))]
