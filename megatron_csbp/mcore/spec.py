"""The CSBP layer spec: Megatron's GPT layer spec with one leaf, the core attention, swapped.

`CSBPCoreAttention` honours Megatron's core-attention contract (constructor keywords from
`build_module`, `forward(query, key, value, attention_mask, ...)` with un-expanded GQA heads, output
`[s, b, heads/tp * d]`) and calls the CSBP op with this rank's row layout. The layout and groups come
from an `AttentionContext` (the run's, `providers.BDLMRun.attention`), bound into the spec by
`get_csbp_layer_spec(context=...)`. The module-level specs (`--spec megatron_csbp.mcore.spec csbp_layer_spec`)
carry none: they are a starting point the model provider copies and binds the run's context into.
"""

import collections
import copy
import functools
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.utils import is_layer_window_attention

from megatron_csbp.core import transports
from megatron_csbp.core.device import default_device
from megatron_csbp.core.documents import Documents, balanced_layout
from megatron_csbp.core.ops import context_sharded_block_attention, ring_plan
from megatron_csbp.core.rules import refused_features
from megatron_csbp.core.windows import GLOBAL, Sliding, window_size_problem


DOCUMENT_PLANS = 8  # packed samples' plans kept (a micro-batch's are held apart, for all its layers, until the next)


def _router_without_transformer_engine() -> None:
    """megatron-core 0.16's router GEMM (`moe_utils.RouterGatingLinearFunction`) tests `te_general_gemm is not
    None`, a name its module defines only where Transformer Engine imports: without TE every MoE router fails
    with a NameError. Defining it as None there gives the torch GEMM megatron-core means to fall back to."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


_router_without_transformer_engine()


@dataclass(frozen=True)
class AttentionContext:
    """What the core attention needs beyond Megatron's config: this rank's rows and where K/V travel.

    `group`: the block-parallel `ProcessGroup`, a `process_groups.BlockParallelGroups`, or None on one rank.
    Its plans, the op's `ops.RingPlan` of the layout on the run's device in a layer of each window (`plan_for`;
    `plan`: a global layer's), are made on first use (a model built only to load or export weights never pays for
    them) and then shared by every layer of that window, forward and backward: the run owns them; no cache is
    consulted.
    """

    layout: Any
    group: Any = None
    transport: transports.Transport = transports.COLLECTIVE

    @functools.cached_property
    def _plans(self):
        return {}

    def plan_for(self, window=GLOBAL):
        """The plan of a layer of `window` (`core.windows`): the layout's rows with that window's mask."""
        if window not in self._plans:
            self._plans[window] = ring_plan(self.layout.windowed(window), default_device())
        return self._plans[window]

    @property
    def plan(self):
        return self.plan_for(GLOBAL)

    @functools.cached_property
    def _document_plans(self):
        return {"last": {}, "plans": collections.OrderedDict()}

    def document_plans(self, document_ids, window=GLOBAL) -> list:
        """`(documents, plan)` per sample of a packed micro-batch (`document_ids [b, L]`, the attention mask the
        forward step passes) in a layer of `window`: worked out once per micro-batch and window (every such layer
        and the backward get the same tensor) and kept for the last `DOCUMENT_PLANS` packings seen. Each plan is of
        the sample's deal of the layout's blocks (`documents.balanced_layout`, as the forward step's rows: the same
        in every layer)."""
        memo = self._document_plans
        last = memo["last"].get(window)
        if last is not None and last[0] is document_ids:
            return last[1]
        plans = memo["plans"]
        per_sample = []
        for ids in document_ids.cpu():
            documents = Documents.from_ids(ids)
            if documents.seq_length != self.layout.seq_length:
                raise ValueError(f"document ids cover {documents.seq_length} positions, not --seq-length="
                                 f"{self.layout.seq_length}")
            key = (documents, window)
            if key not in plans:
                layout = balanced_layout(self.layout, documents).windowed(window)
                plans[key] = ring_plan(layout, default_device(), documents=documents)
            plans.move_to_end(key)
            per_sample.append((documents, plans[key]))
        while len(plans) > DOCUMENT_PLANS:
            plans.popitem(last=False)
        memo["last"][window] = (document_ids, per_sample)
        return per_sample


def layer_window(config, layer_number: int):
    """The window of layer `layer_number` (1-based, over the whole model): megatron-core's own reading of the
    config's `window_size` and `window_attn_skip_freq` (`is_layer_window_attention`), so a layer slides here
    exactly where it slides in Megatron-LM; what the kernels cannot do is refused (`core.windows`)."""
    window_size, skip_freq = config.window_size, config.window_attn_skip_freq
    skip_freq = list(skip_freq) if isinstance(skip_freq, tuple) else skip_freq  # megatron-core takes a list
    problem = window_size_problem(tuple(window_size) if isinstance(window_size, list) else window_size, skip_freq,
                                  config.num_layers)
    if problem:
        raise ValueError(problem)
    if not is_layer_window_attention(window_size, skip_freq, layer_number) or window_size[0] == -1:
        return GLOBAL
    return Sliding(window_size[0])


class CSBPCoreAttention(MegatronModule):
    """Block-diffusion attention over this rank's `[noisy ; clean]` rows through the CSBP op.

    The layer's window (`layer_window`: the config's `window_size` and `window_attn_skip_freq`, megatron-core's
    reading by the layer number it is built with) chooses its plan: a sliding layer's mask and exchange
    (`core.windows`, `core.exchange`), or a global one's.

    `attention_bias`, megatron-core's one per-micro-batch input to the core attention besides the mask, carries
    each row's query scale `[rows, b or 1, 1, 1]` (Llama 4's query scaling, from the row's RoPE position:
    `model.query_scales`), which multiplies the query, RoPE already applied, as transformers does.

    Attention dropout is refused: the op is a fused, flash-style kernel that never materialises the
    attention probabilities. `apply_query_key_layer_scaling` changes nothing: in Megatron it divides
    the scale by the layer number and multiplies the scores back in fp32, an fp16 overflow guard
    with no effect on the result.
    """

    def __init__(self, config, layer_number, attn_mask_type=None, attention_type="self",
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None, pg_collection=None,
                 context: AttentionContext | None = None, **unused):
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        for message in refused_features(SimpleNamespace(attention_dropout=dropout)):
            raise ValueError(message)
        if config.softmax_type != "vanilla":
            raise ValueError(f"softmax_type={config.softmax_type!r} is not supported by the CSBP attention; "
                             "use --softmax-type vanilla")
        if context is None:
            raise RuntimeError("CSBPCoreAttention has no attention context (layout, groups): build the layer spec "
                               "with get_csbp_layer_spec(context=AttentionContext(...)), as megatron_csbp's model "
                               "provider does")
        self.layer_number = layer_number
        self.window = layer_window(config, layer_number)
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.context = context

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None:
            raise ValueError("packed_seq_params (THD packed sequences) cannot be used with CSBP: rows are "
                             "laid out by the CSBP layout; feed one sample per row set (bshd)")
        if attention_bias is not None:  # the rows' query scales (Llama 4's; `BDLMGPTModel` gives them)
            query = query * attention_bias.to(query)
        context = self.context
        rows = context.layout.num_rows
        padded_rows = query.shape[0]
        if attention_mask is not None:  # packed samples: each sample's document ids, one op call per sample
            out = torch.cat([context_sharded_block_attention(
                query[:rows, i:i + 1], key[:rows, i:i + 1], value[:rows, i:i + 1], plan.layout,
                group=context.group, softmax_scale=self.softmax_scale, transport=context.transport, plan=plan,
                documents=documents) for i, (documents, plan) in enumerate(context.document_plans(attention_mask,
                                                                                                   self.window))],
                dim=1)
        else:
            plan = context.plan_for(self.window)
            out = context_sharded_block_attention(query[:rows], key[:rows], value[:rows], plan.layout,
                                                  group=context.group, softmax_scale=self.softmax_scale,
                                                  transport=context.transport, plan=plan)
        if padded_rows > rows:  # rows added to make the row count a multiple of TP (sequence parallel)
            out = torch.cat([out, out.new_zeros(padded_rows - rows, *out.shape[1:])])
        return out


class TokenCountedTopKRouter(TopKRouter):
    """megatron-core's top-k router, whose load-balancing-loss gradient does not depend on the TP x CP size.

    With a per-token loss (always, for BDLM) megatron-core 0.16 scales the aux loss by the rank's own token count
    and `finalize_model_grads` divides every gradient by the global token count, so under TP (SP) or CP, where
    each rank routes `1/(TP x CP)` of the rows, the aux-loss gradient comes out `TP x CP` times too small
    (Megatron-LM issue 1652; fixed upstream by scaling with the TP x CP size, which is what this does). The
    CSBP block-parallel ranks live in the CP slot, so without this the aux loss would weigh less the more
    block-parallel ranks a run has, and no layout would train like the one-rank run."""

    def attach_and_log_load_balancing_loss(self, activation, aux_loss_coeff, aux_loss, aux_loss_name, reduce_group,
                                           reduce_group_has_dp=False, valid_token_count=None):
        if self.calculate_per_token_loss:
            tokens = activation.shape[0] if valid_token_count is None else valid_token_count
            valid_token_count = tokens * self.tp_cp_group.size()
        return super().attach_and_log_load_balancing_loss(activation, aux_loss_coeff, aux_loss, aux_loss_name,
                                                          reduce_group, reduce_group_has_dp, valid_token_count)


class LayoutInvariantSequentialMLP(SequentialMLP):
    """megatron-core's local experts (one MLP after another), initialised alike on every expert-parallel layout.

    With `use_cpu_initialization` every weight is drawn whole from the default generator, in construction order,
    and TP ranks keep their slice: the same model on any TP x CSBP x PP layout. Experts break this: an EP rank
    builds only its `E/EP` experts, so it would draw another rank's experts' weights and shift every draw after
    them. Here each rank draws (and drops) the experts of the EP ranks before and after its own, built the way
    megatron-core builds them, one at a time, so expert `e` and every later weight get the one-rank run's
    values. (Without CPU initialisation megatron-core seeds each EP rank's experts apart; nothing to match.)"""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None):
        ep_size, ep_rank = pg_collection.ep.size(), pg_collection.ep.rank()
        aligned = config.use_cpu_initialization and ep_size > 1
        self._draw_experts(ep_rank * num_local_experts if aligned else 0, config, submodules, pg_collection)
        super().__init__(num_local_experts, config, submodules, pg_collection)
        self._draw_experts((ep_size - 1 - ep_rank) * num_local_experts if aligned else 0, config, submodules,
                           pg_collection)

    @staticmethod
    def _draw_experts(count, config, submodules, pg_collection) -> None:
        for _ in range(count):
            SequentialMLP(1, config, submodules, pg_collection)


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm whose weight `w` scales by `1 + w` (megatron's `--apply-layernorm-1p`, Qwen3.5's norms): the
    weight starts at zero. Normalised and scaled in fp32, as transformers' Qwen3.5 does."""

    def __init__(self, config, hidden_size, eps=1e-5):
        super().__init__()
        if config.normalization != "RMSNorm":
            raise ValueError("--apply-layernorm-1p is supported with --normalization RMSNorm only")
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        self.eps = eps

    def forward(self, x):
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class SequenceParallelTorchNorm:
    """Megatron's torch LayerNorm/RMSNorm, allowed under sequence parallelism.

    Megatron's `WrappedTorchNorm` refuses sequence parallelism; all it lacks is the `sequence_parallel`
    mark on the weights, which makes `finalize_model_grads` sum their gradients over TP. A class (not a
    function) because `build_module` returns plain functions uncalled.
    """

    def __new__(cls, config, hidden_size, eps=1e-5, **unused):
        norms = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in norms:
            raise ValueError(f"normalization={config.normalization!r}: choose LayerNorm or RMSNorm")
        if config.layernorm_zero_centered_gamma:  # --apply-layernorm-1p
            norm = ZeroCenteredRMSNorm(config, hidden_size, eps)
        else:
            norm = norms[config.normalization](hidden_size, eps=eps, dtype=config.params_dtype)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def _swap_torch_norms(spec):
    if isinstance(spec, ModuleSpec):
        spec.submodules = _swap_torch_norms(spec.submodules)
        return spec
    for name in vars(spec) if hasattr(spec, "__dict__") else ():
        child = getattr(spec, name)
        if child is WrappedTorchNorm:
            setattr(spec, name, SequenceParallelTorchNorm)
        elif isinstance(child, ModuleSpec) or (hasattr(child, "__dataclass_fields__")
                                               and not isinstance(child, type)):
            _swap_torch_norms(child)
    return spec


def get_csbp_layer_spec(use_transformer_engine: bool = False, context: AttentionContext | None = None,
                        base_spec: ModuleSpec | None = None, **megatron_spec_kwargs) -> ModuleSpec:
    """A GPT layer spec with `CSBPCoreAttention` as core attention: a copy of `base_spec` (e.g. Megatron-LM's
    `--spec`) where given, else Megatron's local (or Transformer Engine) spec."""
    for message in refused_features(SimpleNamespace(**megatron_spec_kwargs)):
        raise ValueError(message)
    if base_spec is not None:
        spec = base_spec
    elif use_transformer_engine:
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**megatron_spec_kwargs)
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(**megatron_spec_kwargs)
    return _with_csbp_attention(spec, use_transformer_engine, context)


def get_csbp_block_spec(config, use_transformer_engine: bool = False, context: AttentionContext | None = None,
                        vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """This pipeline stage's layer specs for a mixture-of-experts config: megatron-core's GPT decoder block
    spec (`get_gpt_decoder_block_spec`: MoE layers where `config.moe_layer_freq` puts them, dense ones
    elsewhere, local experts or grouped GEMM as `config.moe_grouped_gemm` says), each with CSBP's core
    attention; the final norm accepts sequence parallelism as the layers' do."""
    for message in refused_features(config):
        raise ValueError(message)
    block = gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine,
                                                       normalization=config.normalization, vp_stage=vp_stage)
    bound = {}  # one CSBP copy per distinct megatron-core layer spec (dense, MoE)
    for spec in block.layer_specs:
        if id(spec) not in bound:
            bound[id(spec)] = _with_csbp_attention(spec, use_transformer_engine, context)
    layer_specs = [bound[id(spec)] for spec in block.layer_specs]
    layer_norm = block.layer_norm if use_transformer_engine else SequenceParallelTorchNorm
    return TransformerBlockSubmodules(layer_specs=layer_specs, layer_norm=layer_norm)


def _with_csbp_attention(spec: ModuleSpec, use_transformer_engine: bool, context: AttentionContext | None):
    """A copy of the layer spec `spec` whose core attention is CSBP's, bound to `context` (and, without
    Transformer Engine, whose torch norms accept sequence parallelism)."""
    spec = copy.deepcopy(spec)
    if not use_transformer_engine:
        spec = _swap_torch_norms(spec)
    try:
        attention = spec.submodules.self_attention.submodules
    except AttributeError:
        raise ValueError(f"the layer spec {spec.module.__name__} has no self_attention.core_attention to make "
                         f"CSBP's; give a GPT layer spec (--spec)") from None
    attention.core_attention = ModuleSpec(module=CSBPCoreAttention, params={"context": context})
    mlp = getattr(spec.submodules, "mlp", None)
    if isinstance(getattr(mlp, "submodules", None), MoESubmodules):
        moe = mlp.submodules
        if moe.router is TopKRouter:
            moe.router = TokenCountedTopKRouter
        if isinstance(moe.experts, ModuleSpec) and moe.experts.module is SequentialMLP:
            moe.experts.module = LayoutInvariantSequentialMLP
    return spec


csbp_layer_spec = get_csbp_layer_spec()


def __getattr__(name):
    """`csbp_te_layer_spec` is built on first use: the TE spec cannot be made where TE is absent."""
    if name == "csbp_te_layer_spec":
        return get_csbp_layer_spec(use_transformer_engine=True)
    raise AttributeError(name)
