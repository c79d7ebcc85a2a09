"""Gemma 4's attention (DiffusionGemma's), on megatron-core's self-attention and transformer layer.

transformers' DiffusionGemma attention differs from Megatron's GPT attention in five ways, each added here to
megatron-core's modules, which stay whole (their projections, TP sharding and checkpoint layout):
* values are normalised per head by an RMSNorm without weight, beside the usual query and key norms;
* the softmax scale is 1 (`model.set_shape_config` sets it): the query and key norms fix the scores' scale;
* the attention's output is normalised before it joins the residual stream (`post_attention_layernorm`);
* the layer's output is multiplied by a fixed `layer_scalar` (a buffer: it comes with the weights);
* global layers (those the window pattern leaves without a window) have their own head size and K/V heads, and
  their key projection doubles as the value (K = V): the fused projection holds query and key heads only, per
  group as megatron-core interleaves them, `[ng, (np/ng + 1) * hn]`, and the value is the projected key before
  its norm and RoPE. Their RoPE is proportional (`proportional_inverse_frequencies`).

RoPE per layer type: megatron-core hands every layer one `rotary_pos_emb`. The model (`BDLMGPTModel`) gives the
sliding and the global table side by side in that one tensor, `[..., sliding head + global head]` (one tensor, so
activation recomputation and the pipeline pass it as any other), and each layer takes its own columns.
"""

import copy

import torch
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_csbp.core.windows import GLOBAL
from megatron_csbp.mcore.spec import SequenceParallelTorchNorm, layer_window


def proportional_inverse_frequencies(head_size: int, base: float, fraction: float) -> torch.Tensor:
    """The `head_size / 2` inverse frequencies of proportional RoPE: the first `fraction` of them those of plain RoPE
    over the whole head (`base ** (-2i / head_size)`), the rest 0, so those dimensions are not rotated."""
    rotated = int(fraction * head_size // 2)
    frequencies = 1.0 / (base ** (torch.arange(0, 2 * rotated, 2, dtype=torch.int64).float() / head_size))
    return torch.cat([frequencies, torch.zeros(head_size // 2 - rotated)])


def rotary_table(inverse_frequencies: torch.Tensor, positions: int) -> torch.Tensor:
    """`[positions, 1, 1, 2 * len(inverse_frequencies)]` angles, megatron-core's (non-interleaved) RoPE layout, on
    the frequencies' device."""
    angles = torch.outer(torch.arange(positions, dtype=torch.float32, device=inverse_frequencies.device),
                         inverse_frequencies.float())
    return torch.cat([angles, angles], dim=-1)[:, None, None, :]


def side_by_side(table: torch.Tensor, global_inverse_frequencies: torch.Tensor) -> torch.Tensor:
    """The one RoPE tensor every layer is handed: the sliding layers' table `[positions, 1, 1, sliding head]` with
    the global layers' proportional table over the same positions after it."""
    global_table = rotary_table(global_inverse_frequencies.to(table.device), table.shape[0])  # made where it runs
    return torch.cat([table, global_table.to(table.dtype)], dim=-1)


def value_norm(value: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without weight over each head, in fp32 (transformers' `v_norm`)."""
    x = value.float()
    return (x * torch.pow(x.pow(2).mean(-1, keepdim=True) + eps, -0.5)).type_as(value)


def is_global_layer(config, layer_number: int) -> bool:
    return layer_window(config, layer_number) == GLOBAL


class Gemma4SelfAttention(SelfAttention):
    """megatron-core's self-attention with Gemma 4's value norm, output norm, global-layer shape and per-type RoPE
    (module docstring). `config.gemma4_attention`: the model's `core.model_shape.Gemma4AttentionShape`."""

    def __init__(self, config, submodules, layer_number, **kwargs):
        shape = config.gemma4_attention
        sliding_head = config.kv_channels
        shared_key_value = is_global_layer(config, layer_number)
        if shared_key_value:  # the global layers' own head size and K/V heads
            config = copy.copy(config)
            config.kv_channels, config.num_query_groups = shape.global_kv_channels, shape.global_query_groups
        super().__init__(config, submodules, layer_number, **kwargs)
        self.shared_key_value = shared_key_value
        self.rotary_columns = (slice(sliding_head, sliding_head + shape.global_kv_channels) if shared_key_value
                               else slice(0, sliding_head))
        if shared_key_value:  # query and key heads only: the key is the value
            self.linear_qkv_out_dim = self.query_projection_size + self.kv_projection_size
            self.linear_qkv = submodules.linear_qkv(
                config.hidden_size, self.linear_qkv_out_dim, config=config, init_method=config.init_method,
                gather_output=False, bias=config.add_bias_linear or config.add_qkv_bias, skip_bias_add=False,
                is_expert=False, tp_comm_buffer_name="qkv", tp_group=self.pg_collection.tp)
        self.post_attention_layernorm = SequenceParallelTorchNorm(config, config.hidden_size,
                                                                  eps=config.layernorm_epsilon)

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True):
        eps = self.config.layernorm_epsilon
        if not self.shared_key_value:
            query, key, value = super().get_query_key_value_tensors(hidden_states, key_value_states,
                                                                    output_gate=output_gate, split_qkv=split_qkv)
            return query, key, value_norm(value, eps)
        mixed, _ = self.linear_qkv(hidden_states)
        groups, head = self.num_query_groups_per_partition, self.hidden_size_per_attention_head
        per_group = self.num_attention_heads_per_partition // groups
        query, key = mixed.view(*mixed.shape[:-1], groups, (per_group + 1) * head).split(
            [per_group * head, head], dim=-1)
        query = query.reshape(*query.shape[:2], -1, head)
        return self.q_layernorm(query), self.k_layernorm(key), value_norm(key, eps)

    def forward(self, hidden_states, attention_mask, *args, rotary_pos_emb=None, **kwargs):
        if rotary_pos_emb is not None:
            rotary_pos_emb = rotary_pos_emb[..., self.rotary_columns]
        output, bias = super().forward(hidden_states, attention_mask, *args, rotary_pos_emb=rotary_pos_emb, **kwargs)
        if bias is not None:  # refused before (`config_problem`): the norm would have to precede the bias
            raise ValueError("--gemma4-attention takes no linear biases: give --disable-bias-linear")
        return self.post_attention_layernorm(output), None


class Gemma4TransformerLayer(TransformerLayer):
    """megatron-core's transformer layer whose output is multiplied by `layer_scalar` (transformers' buffer of the
    same name: 1 when made, a checkpoint's value once loaded)."""

    def __init__(self, config, submodules, layer_number=1, **kwargs):
        super().__init__(config, submodules, layer_number=layer_number, **kwargs)
        self.register_buffer("layer_scalar", torch.ones(1, dtype=config.params_dtype))

    def _forward_post_mlp(self, mlp_output_with_bias, residual):
        return super()._forward_post_mlp(mlp_output_with_bias, residual) * self.layer_scalar


def gemma4_attention_layer_spec(spec):
    """A copy of the layer spec `spec` (Gemma 4's MoE block, CSBP's core attention) with Gemma 4's attention."""
    spec = copy.copy(spec)
    spec.module = Gemma4TransformerLayer
    spec.submodules = copy.copy(spec.submodules)
    attention = spec.submodules.self_attention = copy.copy(spec.submodules.self_attention)
    attention.module = Gemma4SelfAttention
    return spec


def config_problem(config) -> str | None:
    """Why megatron-core's `config` cannot build Gemma 4's attention, or None."""
    if not getattr(config, "gemma4_moe", False):
        return ("--gemma4-attention builds DiffusionGemma's layers, whose feed-forward block is Gemma 4's: add "
                "--gemma4-moe")
    if config.add_bias_linear or config.add_qkv_bias:
        return "--gemma4-attention's projections have no biases: give --disable-bias-linear (and drop --add-qkv-bias)"
    if config.fused_single_qkv_rope or config.attention_output_gate:
        return "--gemma4-attention: drop --fused-single-qkv-rope and --attention-output-gate"
    return None
