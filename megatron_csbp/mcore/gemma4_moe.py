"""Gemma 4's feed-forward block (DiffusionGemma's): a dense MLP beside routed experts, each with its own norms.

For the residual stream `x` after attention, the block adds to `x`

    post( post_1(mlp(pre(x))) + post_2(experts(pre_2(x), router(x))) )

five learned RMSNorms around the two branches (transformers' `pre_feedforward_layernorm`, `_1`, `_2`,
`pre_feedforward_layernorm_2`, `post_feedforward_layernorm`). The router reads `x` itself through its own norm
without weight, times a learned `scale` and `1/sqrt(hidden)`; its top-k weights (softmax over the top k, so they
sum to 1) are then multiplied by a learned `per_expert_scale` of the chosen expert. Both MLPs are gated GELU-tanh.

Built of megatron-core's pieces, so EP, ETP, TP/SP and every dispatcher carry over unchanged: the MoE layer
(`MoELayer`: its dispatch, experts and combine), with the dense MLP as its shared expert (`SharedExpertMLP`,
`--moe-shared-expert-intermediate-size`: the dense size), and its top-k router. Subclasses add only what differs:
the router's input norm, scale and per-expert scale (`Gemma4Router`); the five norms around the dense MLP, around
the experts (before dispatch, after combine) and of the sum (`Gemma4MoELayer`). The layer's own pre-MLP norm is an
identity: the block reads the raw residual stream.
megatron-core sums the shared expert into the experts' output unnormed, which is why the sum is taken here.
"""

import contextlib
import copy
import logging

import torch
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_csbp.core import rules
from megatron_csbp.mcore.spec import SequenceParallelTorchNorm, TokenCountedTopKRouter, get_csbp_block_spec


def gelu_tanh(x):
    """GELU with the tanh approximation (transformers' `gelu_pytorch_tanh`), Gemma's activation."""
    return torch.nn.functional.gelu(x, approximate="tanh")


def _norm(config):
    return SequenceParallelTorchNorm(config, config.hidden_size, eps=config.layernorm_epsilon)


class Gemma4Router(TokenCountedTopKRouter):
    """megatron-core's top-k router reading `rms(x) * scale / sqrt(hidden)`, its weights times `per_expert_scale`.

    The norm has no weight and is taken in fp32, as transformers' is. The weights are megatron-core's softmax over
    the top-k logits (`--moe-router-pre-softmax` off), which equals transformers' softmax over all experts
    renormalised over the top k."""

    def __init__(self, config, pg_collection=None):
        super().__init__(config, pg_collection=pg_collection)
        self.scale = torch.nn.Parameter(torch.ones(config.hidden_size, dtype=config.params_dtype))
        self.per_expert_scale = torch.nn.Parameter(torch.ones(config.num_moe_experts, dtype=config.params_dtype))
        for param in (self.scale, self.per_expert_scale):
            param.sequence_parallel = config.sequence_parallel

    def gating(self, input):
        x = input.float()
        normed = (x * torch.pow(x.pow(2).mean(-1, keepdim=True) + self.config.layernorm_epsilon, -0.5)).type_as(input)
        return super().gating(normed * self.scale * self.config.hidden_size ** -0.5)

    def routing(self, logits, padding_mask=None):
        probs, routing_map = super().routing(logits, padding_mask=padding_mask)
        return probs * self.per_expert_scale.to(probs.dtype), routing_map


class Gemma4MoELayer(MoELayer):
    """megatron-core's MoE layer with Gemma 4's norms: the router reads the raw residual stream; the dense MLP (the
    shared expert) reads it through `pre_feedforward_layernorm`, its output normed by `post_dense_layernorm`; the
    experts read it through `pre_experts_layernorm` (applied before dispatch, so the norm is a replicated weight
    like the router's), their combined output normed by `post_experts_layernorm`; the sum of the two branches is
    normed by `post_feedforward_layernorm`. The norms live here, not in the shared expert, whose checkpoint
    (megatron-core's `MLP.sharded_state_dict`) takes megatron-core modules only."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None):
        super().__init__(config, submodules=submodules, layer_number=layer_number, pg_collection=pg_collection)
        self.pre_feedforward_layernorm = _norm(config)
        self.post_dense_layernorm = _norm(config)
        self.pre_experts_layernorm = _norm(config)
        self.post_experts_layernorm = _norm(config)
        self.post_feedforward_layernorm = _norm(config)

    def shared_experts_compute(self, hidden_states):
        return self.post_dense_layernorm(super().shared_experts_compute(self.pre_feedforward_layernorm(hidden_states)))

    def preprocess(self, hidden_states, probs, routing_map):
        return super().preprocess(self.pre_experts_layernorm(hidden_states), probs, routing_map)

    def postprocess(self, output, shared_expert_output):
        routed = self.post_experts_layernorm(super().postprocess(output, None))
        return self.post_feedforward_layernorm(routed + shared_expert_output)


class _KnownMLP(logging.Filter):
    def filter(self, record):
        return not record.getMessage().startswith("Unknown MLP type")


@contextlib.contextmanager
def quiet_about_its_layer(active: bool = True):
    """While Gemma 4's layers are built (`active`): megatron-core's transformer layer knows its MoE layer by class
    identity, so for `Gemma4MoELayer` it logs "Unknown MLP type ... Using default kwargs" once per layer and passes
    no process groups, which the MoE layer then takes from the parallel state, as megatron-core's own does without
    them. The line says nothing about a Gemma 4 model; it is filtered out there, and only there."""
    if not active:
        yield
        return
    from megatron.core.transformer import transformer_layer

    quiet = _KnownMLP()
    transformer_layer.logger.addFilter(quiet)
    try:
        yield
    finally:
        transformer_layer.logger.removeFilter(quiet)


def get_gemma4_block_spec(config, use_transformer_engine: bool = False, context=None, vp_stage=None):
    """`spec.get_csbp_block_spec` with Gemma 4's block in every layer (`config.gemma4_moe`, which
    `model.set_shape_config` sets); ValueError (one line) where the config cannot build it."""
    problem = config_problem(config)
    if problem:
        raise ValueError(problem)
    block = get_csbp_block_spec(config, use_transformer_engine, context, vp_stage=vp_stage)
    rewired = {}  # one Gemma 4 copy per distinct layer spec
    for spec in block.layer_specs:
        rewired.setdefault(id(spec), gemma4_layer_spec(spec))
    if getattr(config, "gemma4_attention", None) is not None:
        from megatron_csbp.mcore import gemma4_attention

        rules.refuse(gemma4_attention.config_problem(config), ValueError)
        rewired = {key: gemma4_attention.gemma4_attention_layer_spec(spec) for key, spec in rewired.items()}
    return TransformerBlockSubmodules(layer_specs=[rewired[id(spec)] for spec in block.layer_specs],
                                      layer_norm=block.layer_norm)


def gemma4_layer_spec(spec: ModuleSpec) -> ModuleSpec:
    """A copy of the MoE layer spec `spec` (megatron-core's, CSBP's attention bound) with Gemma 4's block."""
    spec = copy.copy(spec)
    spec.submodules = copy.copy(spec.submodules)
    spec.submodules.pre_mlp_layernorm = IdentityOp
    mlp = spec.submodules.mlp = copy.copy(spec.submodules.mlp)
    mlp.module = Gemma4MoELayer
    mlp.submodules = copy.copy(mlp.submodules)
    mlp.submodules.router = Gemma4Router
    return spec


def config_problem(config) -> str | None:
    """Why megatron-core's `config` cannot build Gemma 4's block (`rules.gemma4_moe_problem`, and the gated
    GELU-tanh MLPs `model.set_shape_config` sets for `--gemma4-moe`), or None."""
    pattern = rules.moe_layer_pattern(config.moe_layer_freq, config.num_layers)
    problem = rules.gemma4_moe_problem(config.num_moe_experts, pattern, config.moe_shared_expert_intermediate_size,
                                       False, config.moe_router_score_function, config.moe_router_pre_softmax)
    if problem is None and not (config.gated_linear_unit and config.activation_func is gelu_tanh):
        problem = ("--gemma4-moe: the config's MLPs must be gated GELU-tanh (gated_linear_unit, activation_func "
                   "gemma4_moe.gelu_tanh), as set_shape_config sets them")
    return problem
