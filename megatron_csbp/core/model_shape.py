"""The model's shape by Megatron's hyper-parameters, with Megatron-LM's defaults filled in here and nowhere else.

A `ModelShape` is what the FLOP and parameter counts (`bdlm.flops`), the planner (`tools.plan`), the
checkpoint-size estimate and the trainer's `TransformerConfig` read of the model: its sizes, and its mixture
of experts (`MoEShape`) where it has one. The flags leave some sizes to defaults (the FFN size, the head
size, the K/V heads, each expert's FFN size); they are resolved once, when the shape is made, by Megatron-LM's
rules, so every reader sees the same numbers. A `RunConfig` (`core.run_config`) holds the run's shape.

Standard library only (the planner runs without torch).
"""

import dataclasses

from megatron_csbp.core import rules


@dataclasses.dataclass(frozen=True)
class MoEShape:
    """The mixture of experts of a model (Megatron's flags): `num_moe_layers` of the layers route each row to
    `topk` of `num_experts` experts of FFN size `ffn_hidden_size` (None: the dense FFN size, resolved by the
    `ModelShape` holding it), plus a shared expert of `shared_expert_ffn_hidden_size` (0: none). `gemma4`: Gemma 4's
    block (`--gemma4-moe`): the shared expert is the dense MLP between its own norms, the router has an input norm,
    a scale and a per-expert scale, and the block four norms more than a layer's pre-MLP norm."""

    num_experts: int
    topk: int
    ffn_hidden_size: int | None
    num_moe_layers: int
    shared_expert_ffn_hidden_size: int = 0
    gemma4: bool = False


@dataclasses.dataclass(frozen=True)
class Gemma4AttentionShape:
    """Gemma 4's attention (`--gemma4-attention`, DiffusionGemma's): every layer normalises its values (an RMSNorm
    without weight) and takes softmax scale 1 (its query and key norms set the scale), normalises the attention's
    output before the residual (a sandwich norm) and multiplies the layer's output by a fixed `layer_scalar`. The
    global layers (those the window pattern leaves without a window) have a shape of their own: head size
    `global_kv_channels`, `global_query_groups` K/V heads, the key projection doubling as the value (K = V), and
    proportional RoPE (base `global_rotary_base`, the first `global_rotary_fraction` of each half of the head
    rotated at the frequencies of the whole head, the rest left unrotated). Sliding layers keep the model's head
    shape and plain RoPE at `--rotary-base`."""

    global_kv_channels: int
    global_query_groups: int
    global_rotary_base: float = 1_000_000.0
    global_rotary_fraction: float = 0.25

    def problem(self, num_attention_heads: int, tensor_parallel: int = 1,
                tensor_parallel_flag: str = rules.FLAGS.tensor_parallel) -> str | None:
        """The first size Gemma 4's global layers cannot take (one line naming the flag), or None."""
        problem = (rules.at_least("--global-kv-channels", self.global_kv_channels)
                   or rules.at_least("--global-num-query-groups", self.global_query_groups))
        if problem:
            return problem
        if num_attention_heads % self.global_query_groups:
            return (f"--global-num-query-groups {self.global_query_groups} does not divide --num-attention-heads "
                    f"{num_attention_heads}: each K/V head of a global layer serves the same number of query heads")
        if self.global_query_groups % tensor_parallel:
            return (f"{tensor_parallel_flag} {tensor_parallel} does not divide --global-num-query-groups "
                    f"{self.global_query_groups}: each TP rank holds whole K/V heads of the global layers")
        if not 0 < self.global_rotary_fraction <= 1:
            return (f"--global-rotary-percent {self.global_rotary_fraction} must be in (0, 1]: the share of each "
                    f"global head's frequencies that rotate")
        if not self.global_rotary_base > 0:
            return f"--global-rotary-base {self.global_rotary_base} must be > 0"
        return None


GATED_DELTA_NET = "gated_delta_net"  # megatron-core's --experimental-attention-variant of Gated DeltaNet layers
VARIANT_FLAG, FREQ_FLAG = "--experimental-attention-variant", "--linear-attention-freq"


def linear_attention_pattern(freq, num_layers: int) -> tuple:
    """`--linear-attention-freq` as one 1 (Gated DeltaNet) or 0 (full attention) per layer, megatron-core's
    reading (`get_linear_attention_pattern`): an int N makes every N-th layer, counting from 1, full attention;
    a list is the pattern itself."""
    if isinstance(freq, int):
        return tuple(0 if (layer + 1) % freq == 0 else 1 for layer in range(num_layers))
    return tuple(int(value) for value in freq)


@dataclasses.dataclass(frozen=True)
class LinearAttentionShape:
    """The Gated DeltaNet layers of a hybrid model (megatron-core's `--experimental-attention-variant
    gated_delta_net`): `pattern` one 1 (Gated DeltaNet) or 0 (full attention) per layer, and the `--linear-*`
    sizes (megatron-core's defaults). Each layer's state is `num_value_heads x key_head_dim x value_head_dim`."""

    pattern: tuple
    conv_kernel_dim: int = 4
    key_head_dim: int = 128
    value_head_dim: int = 128
    num_key_heads: int = 16
    num_value_heads: int = 32

    @classmethod
    def from_flags(cls, variant, freq, num_layers: int, **sizes) -> "LinearAttentionShape | None":
        """The shape the flags give (None: no linear layers); `ConfigError` naming the flag where they cannot."""
        if variant is None:
            if freq is not None:
                raise rules.ConfigError(f"{FREQ_FLAG} picks the Gated DeltaNet layers, but there is no {VARIANT_FLAG}: "
                                        f"give {VARIANT_FLAG} {GATED_DELTA_NET} or drop {FREQ_FLAG}")
            return None
        rules.refuse(rules.choice_problem(VARIANT_FLAG, variant, (GATED_DELTA_NET,)), rules.ConfigError)
        if freq is None:
            raise rules.ConfigError(f"{VARIANT_FLAG} {GATED_DELTA_NET} needs {FREQ_FLAG}: N (every N-th layer full "
                                    f"attention, e.g. 4 for Qwen3.5) or one 1 (Gated DeltaNet) or 0 per layer")
        if isinstance(freq, int) and freq < 1:
            raise rules.ConfigError(f"{FREQ_FLAG} {freq}: give N >= 1 (every N-th layer full attention) or a list")
        if not isinstance(freq, int) and len(freq) != num_layers:
            raise rules.ConfigError(f"{FREQ_FLAG} names {len(freq)} layers, but --num-layers is {num_layers}: give "
                                    f"one 1 (Gated DeltaNet) or 0 (full attention) per layer, or an int N")
        shape = cls(linear_attention_pattern(freq, num_layers), **sizes)
        rules.refuse(shape.problem(), rules.ConfigError)
        return shape

    def problem(self, tensor_parallel: int = 1, tensor_parallel_flag: str = rules.FLAGS.tensor_parallel) -> str | None:
        """The first size the layer cannot take (one line naming the flag), or None."""
        for name in ("conv_kernel_dim", "key_head_dim", "value_head_dim", "num_key_heads", "num_value_heads"):
            problem = rules.at_least("--linear-" + name.replace("_", "-"), getattr(self, name))
            if problem:
                return problem
        if self.num_value_heads % self.num_key_heads:
            return (f"--linear-num-value-heads {self.num_value_heads} is not a multiple of --linear-num-key-heads "
                    f"{self.num_key_heads}: each key head serves the same number of value heads")
        for flag, heads in (("--linear-num-key-heads", self.num_key_heads),
                            ("--linear-num-value-heads", self.num_value_heads)):
            if heads % tensor_parallel:
                return (f"{tensor_parallel_flag} {tensor_parallel} does not divide {flag} {heads}: each TP rank "
                        f"holds whole Gated DeltaNet heads; use a TP size dividing {heads}")
        return None

    @property
    def num_linear_layers(self) -> int:
        return sum(self.pattern)

    def state_bytes(self, element_bytes: int = 4) -> int:
        """One sample's state of one layer (all value heads, whole model): `Hv x dk x dv` elements."""
        return self.num_value_heads * self.key_head_dim * self.value_head_dim * element_bytes


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A GPT model's sizes. Left to defaults (None), as Megatron-LM fills them: `num_query_groups` one per
    attention head, `kv_channels` `hidden / heads`, `ffn_hidden_size` `4h` (`8h/3` rounded down to a multiple of
    64 with SwiGLU), each expert's FFN size the dense one. `ConfigError` (one line naming the flag) where the
    sizes cannot make a model."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int | None = None
    kv_channels: int | None = None
    ffn_hidden_size: int | None = None
    swiglu: bool = False
    add_bias_linear: bool = True
    layernorm_bias: bool = True  # LayerNorm has a bias, RMSNorm none
    untied_output: bool = False  # an output layer of its own, not the word embeddings
    moe: MoEShape | None = None
    linear: LinearAttentionShape | None = None  # Gated DeltaNet layers (a hybrid model), None: none
    attention_output_gate: bool = False  # a sigmoid gate on each full-attention layer's output (Qwen3.5's)
    layernorm_1p: bool = False  # every norm's weight scales by 1 + w (--apply-layernorm-1p; RMSNorm only)
    gemma4_attention: Gemma4AttentionShape | None = None  # Gemma 4's attention block (None: Megatron's)
    flags: rules.Flags = dataclasses.field(default=rules.FLAGS, compare=False, repr=False)  # names in messages

    def __post_init__(self):
        rules.refuse(self.problem(), rules.ConfigError)
        fill = dict(num_query_groups=self.num_query_groups or self.num_attention_heads,
                    kv_channels=self.kv_channels or self.hidden_size // self.num_attention_heads,
                    ffn_hidden_size=self.ffn_hidden_size or rules.default_ffn_hidden_size(self.hidden_size,
                                                                                          self.swiglu))
        if self.moe is not None and self.moe.ffn_hidden_size is None:
            fill["moe"] = dataclasses.replace(self.moe, ffn_hidden_size=fill["ffn_hidden_size"])
        for name, value in fill.items():
            object.__setattr__(self, name, value)

    def problem(self) -> str | None:
        """The first rule the sizes break (one line: flag and fix), or None."""
        f = self.flags
        for flag, value in ((f.num_layers, self.num_layers), (f.hidden_size, self.hidden_size),
                            (f.heads, self.num_attention_heads)):
            if value is None:
                return f"{flag} is required"
            if value < 1:
                return rules.at_least(flag, value)
        heads, groups = self.num_attention_heads, self.num_query_groups or self.num_attention_heads
        if self.layernorm_1p and self.layernorm_bias:
            return ("--apply-layernorm-1p is taken with --normalization RMSNorm only (the zero-centred RMSNorm of "
                    "Qwen3.5): give --normalization RMSNorm, or drop --apply-layernorm-1p")
        return (rules.query_groups_problem(heads, groups, f)
                or (None if self.kv_channels else rules.kv_channels_problem(self.hidden_size, heads, f))
                or (self._gemma4_attention_problem() if self.gemma4_attention is not None else None))

    def _gemma4_attention_problem(self) -> str | None:
        if self.add_bias_linear:
            return "--gemma4-attention's projections have no biases: give --disable-bias-linear"
        return self.gemma4_attention.problem(self.num_attention_heads)

    @property
    def num_moe_layers(self) -> int:
        return self.moe.num_moe_layers if self.moe is not None else 0

    @property
    def linear_layers(self) -> tuple:
        """1 for each Gated DeltaNet layer, 0 for each full-attention one (all 0 without Gated DeltaNet)."""
        return self.linear.pattern if self.linear is not None else (0,) * self.num_layers
