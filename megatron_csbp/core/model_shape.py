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
    `ModelShape` holding it), plus a shared expert of `shared_expert_ffn_hidden_size` (0: none)."""

    num_experts: int
    topk: int
    ffn_hidden_size: int | None
    num_moe_layers: int
    shared_expert_ffn_hidden_size: int = 0


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
        return (rules.query_groups_problem(heads, groups, f)
                or (None if self.kv_channels else rules.kv_channels_problem(self.hidden_size, heads, f)))

    @property
    def num_moe_layers(self) -> int:
        return self.moe.num_moe_layers if self.moe is not None else 0
