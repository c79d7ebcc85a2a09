"""megatron-core's Gated DeltaNet layer over CSBP rows, and the hybrid decoder it makes with CSBP attention layers.

`BDLMGatedDeltaNet` keeps megatron-core's `GatedDeltaNet` whole (its projections, convolution, decay parameters,
output norm and projection, their TP sharding and checkpoint layout) and replaces its forward's core: the
convolution and the delta rule run under block diffusion over this rank's `[noisy ; clean]` rows
(`core.gated_delta`: the clean stream causal, each noisy block from the clean state at its start, states passed
inside the ring). megatron-core builds the layer only where `fla` imports, though only its own forward calls
`fla`; the core here uses `fla`'s kernel where it is installed on a GPU and the torch chunked rule elsewhere.

`get_csbp_hybrid_block_spec` lays the layers out as megatron-core's experimental hybrid spec does
(`--experimental-attention-variant gated_delta_net --linear-attention-freq N`: every N-th layer full attention,
the others Gated DeltaNet), with the local modules: full-attention layers are CSBP's (`spec.get_csbp_layer_spec`,
with `--attention-output-gate` if set), linear ones this layer.
"""

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_linear_attention_pattern
from megatron.core.ssm import gated_delta_net as mcore_gated_delta_net
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_csbp.core.gated_delta import gated_delta_block_diffusion, gated_delta_plan
from megatron_csbp.core.process_groups import ring_group_of
from megatron_csbp.mcore import spec as csbp_spec


class GatedDeltaNorm(torch.nn.Module):
    """The layer's output norm and gate, `RMSNorm(core) · silu(gate)` per value head (fla's and transformers'
    gated norm: a plain weight, initialised to ones, whatever `--apply-layernorm-1p` says of the other norms).
    Each TP rank normalises its own heads with the one shared weight: its gradient is summed over TP here."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **unused):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.eps = eps
        self.activation = config.activation_func
        self.tp_group = None  # set by the layer

    def forward(self, core, gate):
        weight = self.weight
        if self.tp_group is not None and self.tp_group.size() > 1:
            weight = copy_to_tensor_model_parallel_region(weight, group=self.tp_group)
        x = core.float()
        normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).to(core.dtype)
        return (weight * normed * self.activation(gate.float())).to(core.dtype)


class BDLMGatedDeltaNet(mcore_gated_delta_net.GatedDeltaNet):
    """megatron-core's `GatedDeltaNet` whose core runs under block diffusion (module docstring). `context`: the
    run's `spec.AttentionContext` (this rank's layout, the block-parallel groups)."""

    def __init__(self, config, submodules, layer_number=None, pg_collection=None, context=None, **unused):
        if context is None:
            raise RuntimeError("BDLMGatedDeltaNet has no attention context (layout, groups): build the block spec "
                               "with get_csbp_hybrid_block_spec(config, context)")
        built_without_fla = mcore_gated_delta_net.HAVE_FLA
        mcore_gated_delta_net.HAVE_FLA = True  # megatron-core's check; only its replaced forward needs fla
        try:
            super().__init__(config, submodules, layer_number=layer_number, pg_collection=pg_collection)
        finally:
            mcore_gated_delta_net.HAVE_FLA = built_without_fla
        self.context = context
        self.out_norm.tp_group = self.pg_collection.tp
        # Each TP rank holds its slice of every section (megatron-core's sharded state dict splits them so).
        qk, v, heads = self.qk_dim, self.v_dim, self.num_value_heads
        self.in_proj.weight.tensor_parallel_sections = (qk, qk, v, v, heads, heads)
        for param in self.conv1d.parameters():
            param.tensor_parallel_sections = (qk, qk, v)
        self.plan = gated_delta_plan(context.layout, self.conv_kernel_dim)  # refuses a layout it cannot run

    def forward(self, hidden_states, attention_mask=None, packed_seq_params=None, **unused):
        if attention_mask is not None or packed_seq_params is not None:
            raise ValueError("Gated DeltaNet layers do not reset their state at document boundaries: packed "
                             "documents (--reset-attention-mask, --reset-position-ids) are not supported with "
                             "--experimental-attention-variant gated_delta_net")
        context = self.context
        layout = context.layout
        rows = layout.num_rows
        mixed, _ = self.in_proj(hidden_states)  # [padded rows, b, in_proj / TP] (SP: gathered)
        padded_rows, batch = mixed.shape[:2]
        tp = self.tp_size
        pre_conv, gate, beta, alpha = mixed[:rows].transpose(0, 1).split(
            [(2 * self.qk_dim + self.v_dim) // tp, self.v_dim // tp, self.num_value_heads // tp,
             self.num_value_heads // tp], dim=-1)
        g = -self.A_log.float().exp() * F.softplus(alpha.float() + self.dt_bias)
        core = gated_delta_block_diffusion(
            pre_conv, g, beta.sigmoid(), self.conv1d.weight.squeeze(1), self.conv1d.bias, self.act_fn,
            self.num_key_heads // tp, self.key_head_dim, layout, ring_group_of(context.group, layout), self.plan)
        core = core.to(hidden_states.dtype)
        out = self.out_norm(core, gate.reshape(*core.shape)).reshape(batch, rows, -1).transpose(0, 1)
        if padded_rows > rows:  # rows added to make the row count a multiple of TP (sequence parallel)
            out = torch.cat([out, out.new_zeros(padded_rows - rows, *out.shape[1:])])
        return self.out_proj(out.contiguous())


def gated_delta_net_spec(context) -> ModuleSpec:
    """The Gated DeltaNet attention of a layer spec (local modules), bound to `context`."""
    return ModuleSpec(module=BDLMGatedDeltaNet, params={"context": context},
                      submodules=mcore_gated_delta_net.GatedDeltaNetSubmodules(
                          in_proj=ColumnParallelLinear, out_norm=GatedDeltaNorm, out_proj=RowParallelLinear))


def get_csbp_hybrid_block_spec(config, context, vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """This pipeline stage's layer specs of a hybrid model: Gated DeltaNet where megatron-core's
    `get_linear_attention_pattern(config)` says 1, CSBP attention where it says 0."""
    full = csbp_spec.get_csbp_layer_spec(context=context, qk_layernorm=config.qk_layernorm)
    linear = csbp_spec.get_csbp_layer_spec(context=context, qk_layernorm=config.qk_layernorm)
    linear.submodules.self_attention = gated_delta_net_spec(context)
    pattern = get_linear_attention_pattern(config)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    local = range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage))
    return TransformerBlockSubmodules(layer_specs=[linear if pattern[i] else full for i in local],
                                      layer_norm=csbp_spec.SequenceParallelTorchNorm)
