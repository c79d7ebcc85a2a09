"""Hugging Face <-> megatron-core weights for Llama-family models: Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE,
Ministral 3, and the Gated DeltaNet hybrid Qwen3.5; and DiffusionGemma, whose mapping is its own module
(`hf_diffusion_gemma`), reached through this one's functions.

One mapping, both directions; `scripts/convert_hf.py` drives it (import: HF directory -> our `torch_dist`
checkpoint; export: any of our checkpoints -> HF directory). Megatron-Bridge's `AutoBridge` is the
ecosystem's converter; it needs Python >= 3.12 and megatron-core >= 0.17, so this small module stands in
for it, with its conventions and names:

* QKV interleaving per query group: megatron's fused `linear_qkv` holds, for each of the G query groups,
  its H/G query heads, then its key head, then its value head (`[q_g ; k_g ; v_g]`, each head `d` rows);
  TP shards it by whole groups. The Qwen2 QKV bias is interleaved alike.
* Gated-MLP fusion `[gate ; up]`: `linear_fc1` is `gate_proj` stacked over `up_proj` (megatron's swiglu
  sharded factory splits the two halves per TP rank).
* RoPE layout: HF's `rotate_half` pairs dimension `i` with `i + d/2`, which is megatron's default
  non-interleaved RoPE (`rotary_interleaved=False`): Q/K rows are copied unpermuted.
* QK-norm (Qwen3): `q_norm`/`k_norm` are megatron's `q_layernorm`/`k_layernorm` (RMSNorm over `d`).
* RoPE scaling: Llama 3's `llama3` type is megatron-core's `rope_scaling` (its fixed low/high frequency
  factors and original context); `yarn` is megatron-core's YaRN (`--position-embedding-type yarn`, the `--yarn-*`
  flags: `core.positions`), read as transformers reads it (`hf_positions`: its defaults, and its attention
  factor, which megatron-core derives from factor, mscale and mscale_all_dim); other types are refused.
* Llama 4's query scaling (`llama_4_scaling_beta` in the rope parameters) is applied by transformers' Ministral 3
  (`Ministral3ForCausalLM`, Llama's weights), always, with YaRN's original length; it is our
  `--llama-4-scaling-beta`. A Llama or Qwen config naming it is refused: transformers' model would ignore it.
* Mixture of experts (Qwen3-MoE, `Family.experts`): a sparse layer's router `mlp.gate.weight` is megatron-core's
  `mlp.router.weight`; expert `e`'s `mlp.experts.{e}.{gate,up,down}_proj.weight` (the hub's per-expert tensors) are
  megatron-core's local expert `mlp.experts.local_experts.{e}.linear_fc1.weight` (`[gate ; up]`, as the dense MLP)
  and `linear_fc2.weight`. transformers 5 holds the experts fused (`mlp.experts.gate_up_proj` `[E, 2I, H]`,
  `mlp.experts.down_proj` `[E, H, I]`) and writes the hub's per-expert tensors back on `save_pretrained`; a
  directory saved fused (`save_original_format=False`) is read too (`FUSED_EXPERTS`), one expert at a time. Export
  writes the hub's layout. Routing: `norm_topk_prob` true is megatron-core's default (a softmax over the top-k
  logits); false is `--moe-router-pre-softmax` (a softmax over all experts, then the top k).
* Gated DeltaNet hybrids (Qwen3.5, transformers' `Qwen3_5ForCausalLM`, `Family.hybrid`): `layer_types`'
  `linear_attention` layers (by default every layer but each `full_attention_interval`-th) are megatron-core's
  `GatedDeltaNet` (`--experimental-attention-variant gated_delta_net --linear-attention-freq`, the `--linear-*`
  sizes). Its fused `in_proj` is `[in_proj_qkv ; in_proj_z ; in_proj_b ; in_proj_a]` (q, k, v, the output gate z,
  beta's b, the decay's a); `conv1d`, `dt_bias`, `A_log`, `out_proj` are copied, the gated output norm `norm` is
  `out_norm` (a plain weight on both sides). The full-attention layers carry an output gate
  (`--attention-output-gate`): HF's `q_proj` holds per head `[q_h ; gate_h]`, megatron's `linear_qkv` per query
  group `[q_g ; gate_g ; k_g ; v_g]`. Every other norm (the layers', QK-norm, the final one) scales by `1 + w` on
  both sides (`--apply-layernorm-1p`): copied as is. Partial rotary (`partial_rotary_factor`, 0.25 unless given) is
  `--rotary-percent`: both turn the first `int(d * factor)` channels of a head, rotate-half. The multimodal RoPE's
  sections are one position for text, so plain RoPE. transformers' drop of the hub's multi-token-prediction head
  (`mtp.*`) is followed. The vision model (`Qwen3_5ForConditionalGeneration`) and Qwen3.5-MoE are refused.

Vocabulary. The megatron embedding (and untied output layer) has `padded_vocab_size` rows: the HF rows,
then zero rows (Megatron's padding). A new MASK id (`Vocabulary.new_mask`) gets, in both matrices, the
mean of the rows of the tokenizer's original ids (an unseen token starts as the average token, the
initialisation Fast-dLLM v2 / Dream use); when the HF matrix already has a row there (an unused padding
row, as in Qwen's), that row is replaced. An existing token named as MASK keeps its rows. Export writes
rows `[0, Vocabulary.rows)` back.
"""

import json
import math
import os
from dataclasses import dataclass
from typing import Callable

import torch

from megatron_csbp.core import objectives, rules
from megatron_csbp.core.clean_attention import BLOCK_CAUSAL
from megatron_csbp.core.model_shape import GATED_DELTA_NET, linear_attention_pattern
from megatron_csbp.core.positions import QueryScaling, RotaryPositions, YaRN, yarn_mscale
from megatron_csbp.core.rules import ConfigError
from megatron_csbp.core.variants import Registry
from megatron_csbp.tools import hf_diffusion_gemma


class UnsupportedModel(ConfigError):
    """An HF model (or one of our checkpoints) that the mapping cannot express, with what to do."""


def _refuse(condition: bool, message: str) -> None:
    if condition:
        raise UnsupportedModel(message)


@dataclass(frozen=True)
class QwenExperts:
    """The sparse MLP of transformers' Qwen-MoE models and its megatron-core counterpart (MoE layers, local experts).

    Layer `i` is sparse unless it is in `mlp_only_layers` or `(i + 1) % decoder_sparse_step != 0`; a sparse layer
    routes each token to `num_experts_per_tok` of `num_experts` SwiGLU experts of size `moe_intermediate_size`,
    weighted by the softmax over the experts (renormalised over the top k when `norm_topk_prob`), and trains with
    the load-balancing loss weighted by `router_aux_loss_coef`. Dense layers are the family's dense MLP
    (`intermediate_size`)."""

    @staticmethod
    def experts_key(config: dict) -> str:
        """Where `config.json` keeps the expert count: the hub's `num_experts`, or `num_local_experts`, which
        transformers 5 writes (its `attribute_map` reads either)."""
        return "num_local_experts" if "num_local_experts" in config and "num_experts" not in config else "num_experts"

    def layer_pattern(self, config: dict) -> list[int]:
        """transformers' choice of sparse (1) and dense (0) layers, as `--moe-layer-freq`'s pattern."""
        dense, step = set(config.get("mlp_only_layers") or []), config.get("decoder_sparse_step", 1)
        return [int(layer not in dense and (layer + 1) % step == 0) for layer in range(config["num_hidden_layers"])]

    def problem(self, name: str, config: dict) -> str | None:
        """What of an HF config the MoE layers cannot express (one line), or None."""
        experts, topk, step = config.get(self.experts_key(config)), config.get("num_experts_per_tok"), \
            config.get("decoder_sparse_step", 1)
        for key, value in (("num_experts", experts), ("num_experts_per_tok", topk), ("decoder_sparse_step", step),
                           ("moe_intermediate_size", config.get("moe_intermediate_size"))):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                key = self.experts_key(config) if key == "num_experts" else key
                return f"{name}: {key} {value!r} is not a positive integer; restore the model's config.json"
        if topk > experts:
            return f"{name}: num_experts_per_tok {topk} exceeds num_experts {experts}; restore the model's config.json"
        if topk == 1 and config.get("norm_topk_prob", False):
            return (f"{name}: num_experts_per_tok 1 with norm_topk_prob true weighs every expert output 1, which "
                    f"megatron-core's router cannot express (it needs a softmax before the top 1)")
        if not any(self.layer_pattern(config)):
            return (f"{name}: no layer is sparse (mlp_only_layers / decoder_sparse_step leave every MLP dense); "
                    f"convert the dense model as Qwen3ForCausalLM")
        return None

    def flags(self, config: dict) -> dict:
        """Our MoE flags (YAML keys) for the HF config."""
        pattern = self.layer_pattern(config)
        return {"num-experts": config[self.experts_key(config)], "moe-router-topk": config["num_experts_per_tok"],
                "moe-ffn-hidden-size": config["moe_intermediate_size"],
                "moe-layer-freq": 1 if all(pattern) else pattern,
                "moe-router-pre-softmax": not config.get("norm_topk_prob", False),
                "moe-router-load-balancing-type": "aux_loss",
                "moe-aux-loss-coeff": float(config.get("router_aux_loss_coef", 0.0))}

    def export_problem(self, args) -> str | None:
        """What of a checkpoint's MoE the HF model cannot hold (one line naming the flag), or None."""
        if getattr(args, "moe_router_score_function", "softmax") != "softmax":
            return (f"--moe-router-score-function {args.moe_router_score_function}: Qwen3-MoE routes by a softmax; "
                    f"this checkpoint has no Hugging Face form")
        if getattr(args, "moe_shared_expert_intermediate_size", None):
            return ("--moe-shared-expert-intermediate-size: Qwen3-MoE has no shared expert; this checkpoint has no "
                    "Hugging Face form")
        return None

    def config(self, args, base: dict | None = None) -> dict:
        """The HF config keys of a checkpoint's MoE (`export_problem` is None); the sparse layers in `base`'s words
        (`decoder_sparse_step`, `mlp_only_layers`) where they say the checkpoint's."""
        pattern = moe_layer_pattern(args)
        if base and self.layer_pattern({**base, "num_hidden_layers": args.num_layers}) == pattern:
            layers = {}
        else:
            layers = {"decoder_sparse_step": 1, "mlp_only_layers": [i for i, sparse in enumerate(pattern) if not sparse]}
        coeff = args.moe_aux_loss_coeff
        coeff = coeff[0] if isinstance(coeff, (list, tuple)) else coeff
        balancing = args.moe_router_load_balancing_type
        balancing = balancing[0] if isinstance(balancing, (list, tuple)) else balancing
        return {self.experts_key(base or {}): args.num_experts, "num_experts_per_tok": args.moe_router_topk,
                "moe_intermediate_size": args.moe_ffn_hidden_size or args.ffn_hidden_size, **layers,
                "norm_topk_prob": not getattr(args, "moe_router_pre_softmax", False),
                "router_aux_loss_coef": float(coeff) if balancing == "aux_loss" else 0.0}


LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"
# transformers' Qwen3.5 defaults of the Gated DeltaNet sizes (megatron-core's --linear-* defaults too)
LINEAR_SIZES = {"linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                "linear_num_key_heads": 16, "linear_num_value_heads": 32}


@dataclass(frozen=True)
class GatedDeltaHybrid:
    """The Gated DeltaNet layers of transformers' Qwen3.5 and what comes with them: the full-attention layers' output
    gate, the `1 + w` norms and partial rotary (`partial_rotary_factor`, 0.25 unless given). The layers are the
    `linear_attention` ones of `layer_types`, by default all but every `full_attention_interval`-th (4)."""

    rotary_fraction_default: float = 0.25
    interval_default: int = 4

    def layer_pattern(self, config: dict) -> list[int]:
        """transformers' Gated DeltaNet (1) and full-attention (0) layers, as `--linear-attention-freq`'s pattern."""
        types = config.get("layer_types")
        if not types:
            interval = config.get("full_attention_interval", self.interval_default)
            return [int((layer + 1) % interval != 0) for layer in range(config["num_hidden_layers"])]
        return [int(kind == LINEAR_ATTENTION) for kind in types]

    def rotary_fraction(self, config: dict) -> float:
        rope = config.get("rope_parameters") or {}
        return rope.get("partial_rotary_factor", config.get("partial_rotary_factor", self.rotary_fraction_default))

    def problem(self, name: str, config: dict) -> str | None:
        """What of an HF config the hybrid cannot express (one line), or None."""
        types = config.get("layer_types")
        if types and len(types) != config["num_hidden_layers"]:
            return (f"{name}: layer_types names {len(types)} layers, num_hidden_layers is "
                    f"{config['num_hidden_layers']}; restore the model's config.json")
        if types and not set(types) <= {LINEAR_ATTENTION, FULL_ATTENTION}:
            return f"{name}: layer_types {sorted(set(types))}: only linear- and full-attention layers convert"
        key_heads = config.get("linear_num_key_heads", LINEAR_SIZES["linear_num_key_heads"])
        value_heads = config.get("linear_num_value_heads", LINEAR_SIZES["linear_num_value_heads"])
        if value_heads % key_heads:
            return (f"{name}: linear_num_value_heads {value_heads} is not a multiple of linear_num_key_heads "
                    f"{key_heads}; restore the model's config.json")
        kind = _rope(config)[0]
        if kind != "default":
            return f"{name}: rope_type {kind}: Qwen3.5 converts with plain RoPE (rope_type default) only"
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        rotary = int(head_dim * self.rotary_fraction(config))
        if rotary < 2 or rotary % 2:
            return (f"{name}: partial_rotary_factor {self.rotary_fraction(config)} turns {rotary} of head_dim "
                    f"{head_dim} channels; RoPE turns an even number >= 2")
        return None

    def flags(self, config: dict) -> dict:
        """Our flags (YAML keys) of the hybrid's layers, gate, norms and partial rotary."""
        pattern = self.layer_pattern(config)
        full = pattern.index(0) + 1 if 0 in pattern else 0
        freq = full if full and list(linear_attention_pattern(full, len(pattern))) == pattern else pattern
        return {"experimental-attention-variant": GATED_DELTA_NET, "linear-attention-freq": freq,
                **{key.replace("_", "-"): config.get(key, default) for key, default in LINEAR_SIZES.items()},
                "attention-output-gate": True, "apply-layernorm-1p": True,
                "rotary-percent": float(self.rotary_fraction(config))}

    @staticmethod
    def export_problem(args) -> str | None:
        """What of a checkpoint with Gated DeltaNet layers, an attention output gate or `1 + w` norms Qwen3.5
        cannot hold (one line naming the flag), or None."""
        parts = {"--experimental-attention-variant gated_delta_net": getattr(args, "experimental_attention_variant",
                                                                             None) == GATED_DELTA_NET,
                 "--attention-output-gate": bool(getattr(args, "attention_output_gate", False)),
                 "--apply-layernorm-1p": bool(getattr(args, "apply_layernorm_1p", False)),
                 "--qk-layernorm": bool(getattr(args, "qk_layernorm", False))}
        missing = [flag for flag, present in parts.items() if not present]
        if missing:
            present = [flag for flag, on in parts.items() if on]
            return (f"this checkpoint has {', '.join(present)} without {', '.join(missing)}: Qwen3.5 "
                    f"(Qwen3_5ForCausalLM), the one Hugging Face family with Gated DeltaNet layers, an attention "
                    f"output gate or 1 + w norms, has all four; it has no Hugging Face form")
        for flag, present in (("--add-qkv-bias", getattr(args, "add_qkv_bias", False)),
                              ("--num-experts", getattr(args, "num_experts", None)),
                              ("--window-size", getattr(args, "window_size", None)),
                              ("--use-rope-scaling", getattr(args, "use_rope_scaling", False)),
                              ("--position-embedding-type yarn", getattr(args, "position_embedding_type",
                                                                          "rope") == YARN)):
            if present:
                return (f"{flag}: Qwen3.5 (Qwen3_5ForCausalLM) has none (Qwen3.5-MoE does not convert); this "
                        f"Gated DeltaNet hybrid has no Hugging Face form")
        return None

    @staticmethod
    def config(args) -> dict:
        """The HF config keys of a checkpoint's hybrid parts (`export_problem` is None), besides the RoPE."""
        pattern = linear_attention_pattern(args.linear_attention_freq, args.num_layers)
        return {"layer_types": [LINEAR_ATTENTION if linear else FULL_ATTENTION for linear in pattern],
                **{key: getattr(args, key) for key in LINEAR_SIZES}}


@dataclass(frozen=True)
class Family:
    """An HF model family the mapping converts, and what sets its weights apart from Llama's."""

    name: str  # our name for it (`model_type`)
    display: str  # as messages name it
    architecture: str  # its transformers class (`config.json`'s `architectures[0]`)
    config_class: str  # its transformers config class
    qkv_bias: bool = False  # biases on Q, K and V only (megatron's --add-qkv-bias)
    qk_norm: bool = False  # RMSNorm of each query and key head (megatron's --qk-layernorm)
    exported: bool = True  # export writes this family (Mistral's dense weights are exported as Llama's)
    windowed_by_default: bool = False  # its transformers config has a sliding window unless told `None`
    # Its sliding-window attention (`hf_windows`): none, `sliding_window` in every layer (EVERY_LAYER), or in the
    # `layer_types` layers (PER_LAYER); with `window_switch`, `use_sliding_window` (false unless given, the window
    # 4096 unless given) switches it on.
    windows: str = ""
    window_switch: bool = False
    experts: QwenExperts | None = None  # its sparse (mixture-of-experts) MLP layers; None: a dense model
    query_scaling: bool = False  # Llama 4's query scaling, always (its rope parameters' llama_4_scaling_beta)
    hybrid: "GatedDeltaHybrid | None" = None  # its Gated DeltaNet layers, gated attention and 1 + w norms (Qwen3.5)


EVERY_LAYER, PER_LAYER = "every layer", "per layer"
LLAMA = Family("llama", "Llama", "LlamaForCausalLM", "LlamaConfig")
MISTRAL = Family("mistral", "Mistral", "MistralForCausalLM", "MistralConfig", exported=False,
                 windowed_by_default=True, windows=EVERY_LAYER)
QWEN2 = Family("qwen2", "Qwen2 / Qwen2.5 (QKV bias)", "Qwen2ForCausalLM", "Qwen2Config", qkv_bias=True,
               windows=PER_LAYER, window_switch=True)
QWEN3 = Family("qwen3", "Qwen3 (QK-norm)", "Qwen3ForCausalLM", "Qwen3Config", qk_norm=True,
               windows=PER_LAYER, window_switch=True)
QWEN3_MOE = Family("qwen3_moe", "Qwen3-MoE (QK-norm, experts)", "Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                   qk_norm=True, experts=QwenExperts(), windows=EVERY_LAYER, window_switch=True)
MINISTRAL3 = Family("ministral3", "Ministral 3 (Llama 4 query scaling)", "Ministral3ForCausalLM", "Ministral3Config",
                    query_scaling=True, windows=EVERY_LAYER)
QWEN3_5 = Family("qwen3_5_text", "Qwen3.5 (Gated DeltaNet hybrid)", "Qwen3_5ForCausalLM", "Qwen3_5TextConfig",
                 qk_norm=True, hybrid=GatedDeltaHybrid())
QWEN_MAX_WINDOW_LAYERS = 28  # transformers' default `max_window_layers` of Qwen2 / Qwen3
FAMILIES = Registry("model_type", LLAMA, MISTRAL, QWEN2, QWEN3, QWEN3_MOE, MINISTRAL3, QWEN3_5)
ARCHITECTURES = {family.architecture: family.name for family in FAMILIES.values()}
# Mixture-of-experts architectures the mapping knows and refuses, and why (one line each).
REFUSED_EXPERTS = {
    "Qwen2MoeForCausalLM": "its shared expert's sigmoid gate (megatron-core's --moe-shared-expert-gate) is not "
                           "supported with the BDLM model; convert a Qwen3-MoE model",
    "Qwen3_5MoeForCausalLM": "experts beside Gated DeltaNet layers are not supported; convert a dense Qwen3.5 "
                             "(Qwen3_5ForCausalLM)",
}
# Models with a vision tower, refused before their (nested) config is read.
REFUSED_MULTIMODAL = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")


def exported_family(qkv_bias: bool, qk_norm: bool, experts: bool = False, query_scaling: bool = False,
                    hybrid: bool = False) -> Family:
    """The family export writes for a model with (or without) QKV biases, QK-norm, experts, Llama 4's query
    scaling and Gated DeltaNet layers; refuses (one line) a combination no family has."""
    for family in FAMILIES.values():
        if family.exported and (family.qkv_bias, family.qk_norm, family.experts is not None, family.query_scaling,
                                family.hybrid is not None) \
                == (bool(qkv_bias), bool(qk_norm), bool(experts), bool(query_scaling), bool(hybrid)):
            return family
    wanted = ", ".join(f"{family.display}" for family in FAMILIES.values() if family.exported)
    raise UnsupportedModel(f"a model with{'' if qkv_bias else 'out'} --add-qkv-bias, with{'' if qk_norm else 'out'} "
                           f"--qk-layernorm, with{'' if experts else 'out'} --num-experts and with"
                           f"{'' if query_scaling else 'out'} --llama-4-scaling-beta has no Hugging Face family here "
                           f"(export writes {wanted})")


def moe_layer_pattern(args) -> list[int]:
    """A checkpoint's MoE (1) and dense (0) layers (`--moe-layer-freq`); all 0 for a dense model."""
    if not getattr(args, "num_experts", None):
        return [0] * args.num_layers
    return rules.moe_layer_pattern(args.moe_layer_freq, args.num_layers)


def read_config(hf_dir: str, where: str | None = None) -> dict:
    """The raw `config.json` of a local HF directory (read as JSON: both the transformers 4 and 5 spellings), its
    fields checked (`check_config`); refusals start with `where` (default: `--hf-dir HF_DIR`)."""
    path = os.path.join(hf_dir, "config.json")
    where = where or f"--hf-dir {hf_dir}"
    if not os.path.isfile(path):
        raise ConfigError(f"{where}: no config.json (a local Hugging Face model directory is needed; "
                          f"nothing is downloaded)")
    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{where}: {path} cannot be read ({error})") from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"{where}: {path} is not valid JSON (line {error.lineno}, column "
                          f"{error.colno}: {error.msg}); restore the model's config.json") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{where}: {path} holds a JSON {type(config).__name__}, not the object of a "
                          f"Hugging Face model config; restore the model's config.json")
    check_config(config, hf_dir, where=where)
    return config


@dataclass(frozen=True)
class ConfigField:
    """A `config.json` field the conversion reads: what it must hold (`accepts`, said as `expected`), whether
    JSON null stands for transformers' default (`nullable`) and whether an import needs it (`required`)."""

    expected: str
    accepts: Callable[[object], bool]
    nullable: bool = False
    required: bool = False


def _integer(minimum: int = 0, maximum: float = math.inf) -> Callable[[object], bool]:
    return lambda value: type(value) is int and minimum <= value <= maximum


def _number(accepts: Callable[[float], bool]) -> Callable[[object], bool]:
    return lambda value: type(value) in (int, float) and math.isfinite(value) and accepts(value)


def _list_of(accepts: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda value: type(value) is list and all(accepts(item) for item in value)


def _of_type(kind: type) -> Callable[[object], bool]:
    return lambda value: type(value) is kind


_POSITIVE = ConfigField("a positive integer", _integer(1), nullable=True)
_BOOLEAN = ConfigField("true or false", _of_type(bool))
_ROPE = ConfigField("an object (the RoPE settings)", _of_type(dict), nullable=True)
_NUMBER = ConfigField("a number", _number(lambda value: True), nullable=True)
# Every field of config.json the import (and the export, of the imported model's config) reads, and its type.
CONFIG_FIELDS = {
    "architectures": ConfigField("a list of class names", _list_of(_of_type(str)), nullable=True),
    "model_type": ConfigField("a string", _of_type(str), nullable=True),
    "num_hidden_layers": ConfigField(f"an integer in [1, {rules.MAX_LAYERS}]", _integer(1, rules.MAX_LAYERS),
                                     required=True),
    "hidden_size": ConfigField("a positive integer", _integer(1), required=True),
    "intermediate_size": ConfigField("a positive integer", _integer(1), required=True),
    "num_attention_heads": ConfigField("a positive integer", _integer(1), required=True),
    "num_key_value_heads": _POSITIVE, "head_dim": _POSITIVE, "max_position_embeddings": _POSITIVE,
    # Phi-3's spelling of YaRN's original length, which transformers puts before the rope parameters' own
    "original_max_position_embeddings": ConfigField("a positive integer", _integer(1)),
    "rms_norm_eps": ConfigField("a number > 0", _number(lambda value: value > 0)),
    "rope_theta": ConfigField("a number > 0", _number(lambda value: value > 0)),
    "rope_parameters": _ROPE, "rope_scaling": _ROPE,
    "partial_rotary_factor": ConfigField("a number in (0, 1]", _number(lambda value: 0 < value <= 1)),
    "hidden_act": ConfigField("a string", _of_type(str)),
    "mlp_bias": _BOOLEAN, "attention_bias": _BOOLEAN, "tie_word_embeddings": _BOOLEAN,
    "use_sliding_window": _BOOLEAN,
    "sliding_window": ConfigField("a non-negative integer", _integer(0), nullable=True),
    "layer_types": ConfigField("a list of strings", _list_of(_of_type(str)), nullable=True),
    # mixture of experts (a dense model may say 0 or null)
    "num_experts": ConfigField("a non-negative integer", _integer(0), nullable=True),
    "num_local_experts": ConfigField("a non-negative integer", _integer(0), nullable=True),
    "n_routed_experts": ConfigField("a non-negative integer", _integer(0), nullable=True),
    "num_experts_per_tok": _POSITIVE, "moe_intermediate_size": _POSITIVE,
    "decoder_sparse_step": ConfigField("a positive integer", _integer(1)),
    "mlp_only_layers": ConfigField("a list of layer numbers", _list_of(_integer(0)), nullable=True),
    "norm_topk_prob": _BOOLEAN,
    "router_aux_loss_coef": ConfigField("a number >= 0", _number(lambda value: value >= 0)),
    # Gated DeltaNet layers (Qwen3.5)
    **{key: ConfigField("a positive integer", _integer(1)) for key in LINEAR_SIZES},
    "full_attention_interval": ConfigField("a positive integer", _integer(1)),
}
# The fields of `rope_parameters` (transformers 5) or `rope_scaling` (transformers 4) it reads.
ROPE_FIELDS = {
    "rope_type": ConfigField("a string", _of_type(str)), "type": ConfigField("a string", _of_type(str)),
    "rope_theta": CONFIG_FIELDS["rope_theta"],
    "factor": ConfigField("a number > 0", _number(lambda value: value > 0)),
    "low_freq_factor": ConfigField("a number", _number(lambda value: True)),
    "high_freq_factor": ConfigField("a number", _number(lambda value: True)),
    "original_max_position_embeddings": ConfigField("a positive integer", _integer(1)),
    # YaRN (transformers reads a null or 0 beta as its default); Llama 4's query scaling
    "beta_fast": _NUMBER, "beta_slow": _NUMBER, "mscale": _NUMBER, "mscale_all_dim": _NUMBER,
    "attention_factor": ConfigField("a number > 0", _number(lambda value: value > 0), nullable=True),
    "truncate": _BOOLEAN,
    "llama_4_scaling_beta": ConfigField("a number >= 0", _number(lambda value: value >= 0)),
    "partial_rotary_factor": CONFIG_FIELDS["partial_rotary_factor"],
}


def check_config(config: dict, hf_dir: str, required: bool = False, where: str | None = None) -> None:
    """Refuses (one line naming the file and the field) a `config.json` field of the wrong type or range
    (`CONFIG_FIELDS`), and, when `required`, one an import needs that is missing, before anything else reads it."""
    path, where = os.path.join(hf_dir, "config.json"), where or f"--hf-dir {hf_dir}"
    fields = [(name, field, config, name) for name, field in CONFIG_FIELDS.items()]
    for table in ("rope_parameters", "rope_scaling"):
        if isinstance(config.get(table), dict):
            fields += [(f"{table}.{key}", field, config[table], key) for key, field in ROPE_FIELDS.items()]
    for name, field, holder, key in fields:
        if key not in holder or (holder[key] is None and field.nullable):
            if required and field.required:
                raise ConfigError(f"{where}: {path} lacks {name} ({field.expected}); restore the model's config.json")
            continue
        if not field.accepts(holder[key]):
            shown = json.dumps(holder[key])
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            raise ConfigError(f"{where}: {path}: {name} is {shown}, expected {field.expected}; restore the model's "
                              f"config.json")


YARN = "yarn"  # transformers' rope_type of YaRN
# Llama 3.x RoPE scaling as megatron-core implements it (`--use-rope-scaling`): only its factor is free.
LLAMA3_ROPE_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _rope(config: dict) -> tuple[str, float, dict]:
    parameters = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    theta = parameters.get("rope_theta", config.get("rope_theta", 10000.0))
    return kind, float(theta), parameters


def hf_positions(config: dict, name: str, family: Family) -> RotaryPositions:
    """YaRN and Llama 4's query scaling of an HF config, as transformers reads them (`_compute_yarn_parameters`,
    `standardize_rope_params`, Ministral 3's attention); refuses (one line) what megatron-core cannot express."""
    kind, _, parameters = _rope(config)
    beta = parameters.get("llama_4_scaling_beta")
    _refuse(family.query_scaling and (kind != YARN or beta is None),
            f"{name}: Llama 4's query scaling is converted with YaRN (rope_type yarn) and its llama_4_scaling_beta; "
            f"this config has rope_type {kind} and llama_4_scaling_beta {beta}")
    _refuse(not family.query_scaling and beta is not None,
            f"{name}: rope parameters name llama_4_scaling_beta, which transformers' {family.display} does not apply "
            f"(Ministral3ForCausalLM does); drop the key, or convert it as Ministral3ForCausalLM")
    if kind != YARN:
        return RotaryPositions()
    _refuse("factor" not in parameters, f"{name}: rope_type yarn without its factor; restore the model's config.json")
    factor = parameters["factor"]
    original = config.get("original_max_position_embeddings", parameters.get("original_max_position_embeddings",
                                                                            config.get("max_position_embeddings")))
    _refuse(original is None, f"{name}: rope_type yarn without original_max_position_embeddings (or "
                              f"max_position_embeddings); restore the model's config.json")
    mscale, all_dim = parameters.get("mscale"), parameters.get("mscale_all_dim")
    wanted = parameters.get("attention_factor")  # transformers' factor on cos and sin, given or derived so:
    if wanted is None:
        wanted = yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim) if mscale and all_dim else \
            yarn_mscale(factor, 1.0)
    common = dict(factor=factor, original_max_position_embeddings=original,
                  beta_fast=parameters.get("beta_fast") or 32.0, beta_slow=parameters.get("beta_slow") or 1.0,
                  correction_range_round_to_int=parameters.get("truncate", True))
    problems = []
    for pair in ((1.0 if mscale is None else mscale, 0.0 if all_dim is None else all_dim), (1.0, 0.0)):
        try:
            yarn = YaRN(**common, mscale=pair[0], mscale_all_dim=pair[1])
        except ConfigError as error:
            problems.append(f" ({error})")
            continue
        if yarn.attention_factor == wanted:
            return RotaryPositions(yarn, QueryScaling(beta, original) if family.query_scaling else None)
    raise UnsupportedModel(f"{name}: its yarn rope parameters (attention factor {wanted}) make no YaRN megatron-core "
                           f"computes from factor, mscale and mscale_all_dim{(problems or [''])[0]}; convert another "
                           f"model")


def rope_parameters(positions: RotaryPositions) -> dict:
    """transformers' rope parameters (beside the type and theta) of YaRN and the query scaling, which
    `hf_positions` reads back as `positions`: the attention factor is written where transformers would derive
    another one from the mscales."""
    yarn = positions.yarn
    if yarn is None:
        return {}
    written = {"rope_type": YARN, "factor": float(yarn.factor),
               "original_max_position_embeddings": yarn.original_max_position_embeddings,
               "beta_fast": float(yarn.beta_fast), "beta_slow": float(yarn.beta_slow), "mscale": float(yarn.mscale),
               "mscale_all_dim": float(yarn.mscale_all_dim), "truncate": yarn.correction_range_round_to_int}
    derived = yarn.attention_factor if yarn.mscale and yarn.mscale_all_dim else yarn_mscale(yarn.factor, 1.0)
    if derived != yarn.attention_factor:
        written["attention_factor"] = yarn.attention_factor
    if positions.query_scaling is not None:
        written["llama_4_scaling_beta"] = float(positions.query_scaling.beta)
    return written


def embedding_key(config: dict) -> str:
    """The HF name of the input embedding of a model with `config`."""
    if hf_diffusion_gemma.is_diffusion_gemma(config):
        return hf_diffusion_gemma.EMBEDDING
    return "model.embed_tokens.weight"


def model_name(config: dict) -> str:
    """The model's class (`architectures[0]`), else its `model_type`."""
    architectures = config.get("architectures") or []
    return architectures[0] if architectures else str(config.get("model_type"))


def model_family(config: dict) -> str:
    """A family's name (`FAMILIES`); refuses (one line) what the mapping cannot express."""
    name = model_name(config)
    moe = ("moe" in name.lower() or "mixtral" in name.lower()
           or any(config.get(key) for key in ("num_experts", "num_local_experts", "n_routed_experts")))
    _refuse(name in REFUSED_EXPERTS, f"{name} is a mixture-of-experts model that does not convert: "
                                     f"{REFUSED_EXPERTS.get(name)}")
    _refuse(moe and (name not in ARCHITECTURES or FAMILIES[ARCHITECTURES[name]].experts is None),
            f"{name} is a mixture-of-experts model the mapping does not know: of the mixture-of-experts models only "
            f"Qwen3-MoE (Qwen3MoeForCausalLM) converts, besides dense Llama/Mistral/Qwen2/Qwen3 models")
    _refuse(name not in ARCHITECTURES, f"architecture {name} is not supported: convert one of "
                                       f"{', '.join(ARCHITECTURES)} (decoder models)")
    family = ARCHITECTURES[name]
    experts, hybrid = FAMILIES[family].experts, FAMILIES[family].hybrid
    problem = experts.problem(name, config) if experts else hybrid.problem(name, config) if hybrid else None
    _refuse(problem is not None, problem or "")
    layer_types = set(config.get("layer_types") or [FULL_ATTENTION]) - ({LINEAR_ATTENTION} if hybrid else set())
    _refuse(LINEAR_ATTENTION in layer_types, f"{name}: linear-attention layers convert in Qwen3.5 "
                                             f"(Qwen3_5ForCausalLM) only")
    _refuse(not layer_types <= {FULL_ATTENTION, "sliding_attention"},
            f"{name}: layer_types {sorted(layer_types)}: only full- and sliding-attention layers convert")
    hf_windows(config, name, FAMILIES[family])
    kind, theta, parameters = _rope(config)
    _refuse(kind not in ("default", "llama3", YARN), f"{name}: rope scaling type '{kind}' is not implemented (plain "
                                                     f"RoPE, Llama 3's 'llama3' and 'yarn' are); convert another model")
    hf_positions(config, name, FAMILIES[family])
    fixed = {key: parameters.get(key) for key in LLAMA3_ROPE_FIXED}
    _refuse(kind == "llama3" and fixed != LLAMA3_ROPE_FIXED,
            f"{name}: llama3 rope scaling with {fixed} is not implemented (megatron-core's has {LLAMA3_ROPE_FIXED})")
    _refuse(theta != int(theta), f"{name}: rope_theta {theta} is not an integer (--rotary-base takes one)")
    rotary = hybrid.rotary_fraction(config) if hybrid else \
        _rope(config)[2].get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    _refuse(not hybrid and rotary != 1.0, f"{name}: partial rotary embeddings do not convert (but in Qwen3.5)")
    _refuse(config.get("hidden_act", "silu") != "silu", f"{name}: hidden_act {config.get('hidden_act')}: only "
                                                        f"SiLU-gated MLPs convert")
    _refuse(bool(config.get("mlp_bias")), f"{name}: mlp_bias cannot be expressed (megatron biases all or no linears)")
    _refuse(not FAMILIES[family].qkv_bias and bool(config.get("attention_bias")),
            f"{name}: attention_bias on q/k/v/o without an MLP bias cannot be expressed")
    return family


def hf_windows(config: dict, name: str, family: Family) -> tuple[int | None, list[int]]:
    """transformers' sliding window of `config` (`sliding_window`: the keys a token sees, itself included; None: no
    window) and which layers use it (1) or attend globally (0), as transformers builds the model: a Mistral or
    Ministral 3 windows every layer when `sliding_window` is set (Mistral's default 4096), a Qwen3-MoE too when
    `use_sliding_window`; a Qwen2 / Qwen3 with `use_sliding_window` the `layer_types` sliding layers (by default
    those from `max_window_layers` on). Refuses (one line) what cannot be expressed."""
    layers = config["num_hidden_layers"]
    window = config.get("sliding_window", 4096 if family.windowed_by_default or family.window_switch else None)
    if family.window_switch and not config.get("use_sliding_window", False):
        window = None
    types = config.get("layer_types")
    if not family.windows:
        _refuse(window is not None and config.get("use_sliding_window", True),
                f"{name}: sliding-window attention (sliding_window={window}) cannot be expressed for "
                f"{family.display}; only models with full attention in every layer convert")
        window = None
    if family.windows == PER_LAYER:
        types = types or ["sliding_attention" if window is not None and layer >= config.get(
            "max_window_layers", QWEN_MAX_WINDOW_LAYERS) else "full_attention" for layer in range(layers)]
        _refuse(len(types) != layers, f"{name}: layer_types names {len(types)} layers, num_hidden_layers is "
                                      f"{layers}; restore the model's config.json")
        pattern = [int(kind == "sliding_attention") for kind in types]
        _refuse(any(pattern) and window is None,
                f"{name}: layer_types names sliding-attention layers, but the config has no window (use_sliding_window "
                f"false or sliding_window null); restore the model's config.json")
    else:
        _refuse("sliding_attention" in (types or []),
                f"{name}: layer_types {sorted(set(types or []))}: {family.display} takes no per-layer sliding "
                f"window (transformers ignores layer_types there); drop layer_types or convert a Qwen2/Qwen3 model")
        pattern = [int(window is not None)] * layers
    if not any(pattern):
        return None, pattern
    _refuse(window < 1, f"{name}: sliding_window {window}: a window holds at least the token itself (>= 1)")
    return window, pattern


def window_flags(window: int | None, pattern: list[int]) -> dict:
    """Our `--window-size` / `--window-attn-skip-freq` (YAML keys) for transformers' `sliding_window` and layer
    pattern: a token sees the `sliding_window - 1` positions before it (`core.windows`)."""
    if window is None:
        return {}
    return {"window-size": [window - 1, 0], **({} if all(pattern) else {"window-attn-skip-freq": pattern})}


def model_flags(config: dict, hf_dir: str = ".") -> dict:
    """Our model flags (YAML keys) for the HF config of `hf_dir`."""
    _refuse(model_name(config) in REFUSED_MULTIMODAL, f"{model_name(config)}: its vision model does not convert; "
                                                      f"convert the text model alone, as Qwen3_5ForCausalLM")
    if hf_diffusion_gemma.is_diffusion_gemma(config):
        return hf_diffusion_gemma.model_flags(config)
    check_config(config, hf_dir, required=True)
    family = FAMILIES[model_family(config)]
    positions = hf_positions(config, model_name(config), family)
    heads = config["num_attention_heads"]
    groups = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    flags = {
        "num-layers": config["num_hidden_layers"], "hidden-size": config["hidden_size"],
        "ffn-hidden-size": config["intermediate_size"], "num-attention-heads": heads,
        "group-query-attention": groups != heads, "num-query-groups": groups, "kv-channels": head_dim,
        "max-position-embeddings": config.get("max_position_embeddings"),
        **positions.flags(), "rotary-base": int(_rope(config)[1]),
        "use-rope-scaling": _rope(config)[0] == "llama3",
        "rope-scaling-factor": float(_rope(config)[2].get("factor", 8.0)) if _rope(config)[0] == "llama3" else None,
        "normalization": "RMSNorm", "norm-epsilon": float(config.get("rms_norm_eps", 1e-6)), "swiglu": True,
        "disable-bias-linear": True, "add-qkv-bias": family.qkv_bias, "qk-layernorm": family.qk_norm,
        "untie-embeddings-and-output-weights": not config.get("tie_word_embeddings", False),
        "attention-dropout": 0.0, "hidden-dropout": 0.0,
        **(family.experts.flags(config) if family.experts else {}),
        **(family.hybrid.flags(config) if family.hybrid else {}),
        **window_flags(*hf_windows(config, model_name(config), family)),
    }
    return {key: value for key, value in flags.items() if value is not None}


def bdlm_config(objective: str, block_size: int, mask_token_id: int,
                clean_attention: str = BLOCK_CAUSAL.name) -> dict:
    """The `config.json` keys that say how the exported model decodes, which the weights alone cannot say.

    In the names the serving engines and reference decoders read, where they have one: `mask_token_id`
    (SDAR's and LLaDA2's config.json; lmdeploy reads it for LLaDA2), `block_size` (SDAR's config.json; the
    `block_size` of SGLang's `--dllm-algorithm-config`) and, for shifted labels only, `bd_size` (Fast-dLLM v2's
    config: its models predict token p+1 at row p, so a BD3-LM model must not claim it). Then our own,
    explicit ones: `bdlm_objective`, `bdlm_label_shift` (row p predicts token p + shift), `bdlm_block_size` and
    `bdlm_clean_attention` (what a committed token's row sees: its block whole, or the tokens up to its own)."""
    shift = objectives.objective_kind(objective).label_shift
    keys = {"mask_token_id": mask_token_id, "block_size": block_size, "bdlm_objective": objective,
            "bdlm_label_shift": shift, "bdlm_block_size": block_size, "bdlm_clean_attention": clean_attention}
    if shift:
        keys["bd_size"] = block_size
    return keys


@dataclass(frozen=True)
class Shape:
    """What the weight mapping needs to know of the model."""

    num_layers: int
    num_heads: int
    num_groups: int
    head_dim: int
    qkv_bias: bool
    qk_norm: bool
    tied: bool
    moe_layers: tuple[int, ...] = ()  # per layer: 1 MoE, 0 dense (empty: a dense model)
    num_experts: int = 0
    linear_layers: tuple[int, ...] = ()  # per layer: 1 Gated DeltaNet, 0 attention (empty: none)
    # the rows of a Gated DeltaNet layer's fused in_proj: q, k and v, the output gate z, b, a
    in_proj_rows: tuple[int, ...] = ()
    output_gate: bool = False  # the attention's output gate (megatron's --attention-output-gate)
    # Gemma 4's attention (DiffusionGemma, `hf_diffusion_gemma`): per layer 1 global, 0 sliding (empty: not Gemma 4),
    # and the global layers' head size and K/V heads
    gemma4_globals: tuple[int, ...] = ()
    global_head_dim: int = 0
    global_groups: int = 0

    @classmethod
    def from_args(cls, args) -> "Shape":
        return cls(args.num_layers, args.num_attention_heads, args.num_query_groups, args.kv_channels,
                   bool(getattr(args, "add_qkv_bias", False)), bool(getattr(args, "qk_layernorm", False)),
                   not args.untie_embeddings_and_output_weights, tuple(moe_layer_pattern(args)),
                   getattr(args, "num_experts", None) or 0,
                   *_linear_shape({name: getattr(args, name, None) for name in _LINEAR_ARGS}, args.num_layers),
                   output_gate=bool(getattr(args, "attention_output_gate", False)), **_gemma4_shape(args))

    @classmethod
    def from_flags(cls, flags: dict) -> "Shape":
        """The shape of the model flags `model_flags` gives."""
        experts = flags.get("num-experts") or 0
        pattern = rules.moe_layer_pattern(flags["moe-layer-freq"], flags["num-layers"]) if experts else []
        linear = _linear_shape({name: flags.get(name.replace("_", "-")) for name in _LINEAR_ARGS}, flags["num-layers"])
        gemma4 = {}
        if flags.get("gemma4-attention"):
            sliding = flags.get("window-attn-skip-freq") or [int("window-size" in flags)] * flags["num-layers"]
            gemma4 = dict(gemma4_globals=tuple(1 - layer for layer in sliding),
                          global_head_dim=flags["global-kv-channels"], global_groups=flags["global-num-query-groups"])
        return cls(flags["num-layers"], flags["num-attention-heads"], flags["num-query-groups"], flags["kv-channels"],
                   flags.get("add-qkv-bias", False), flags["qk-layernorm"],
                   not flags["untie-embeddings-and-output-weights"], tuple(pattern), experts, *linear,
                   output_gate=bool(flags.get("attention-output-gate", False)), **gemma4)


_LINEAR_ARGS = ("experimental_attention_variant", "linear_attention_freq", *LINEAR_SIZES)


def _gemma4_shape(args) -> dict:
    """`Shape`'s Gemma 4 fields of a checkpoint's (or an import's) resolved run: its global layers and their sizes."""
    if not getattr(args, "gemma4_attention", False):
        return {}
    from megatron_csbp.core.run_config import RunConfig

    run = RunConfig.from_args(args)
    attention = run.shape.gemma4_attention
    return dict(gemma4_globals=tuple(int(not window.sliding) for window in run.layer_windows),
                global_head_dim=attention.global_kv_channels, global_groups=attention.global_query_groups)


def _linear_shape(values: dict, num_layers: int) -> tuple[tuple, tuple]:
    """(Gated DeltaNet layer pattern, in_proj row sections) of a model's `_LINEAR_ARGS` values; both empty for a
    model without such layers."""
    if values["experimental_attention_variant"] != GATED_DELTA_NET:
        return (), ()
    qk = values["linear_key_head_dim"] * values["linear_num_key_heads"]
    v = values["linear_value_head_dim"] * values["linear_num_value_heads"]
    heads = values["linear_num_value_heads"]
    return linear_attention_pattern(values["linear_attention_freq"], num_layers), (2 * qk + v, v, heads, heads)


@dataclass(frozen=True)
class Vocabulary:
    """Rows of the embedding matrices: `hf_rows` in the HF model, `padded` in ours, MASK at `mask_id`.

    `new_mask`: MASK is a new token whose rows are initialised (mean of the rows of ids `< mean_of`).
    `rows`: the rows an export writes (the tokenizer's ids, MASK included)."""

    hf_rows: int
    padded: int
    mask_id: int
    new_mask: bool
    mean_of: int
    rows: int


_LAYER = "decoder.layers.{}."
_HF_LAYER = "model.layers.{}."


def _mlp_names(shape: Shape, sparse: bool) -> dict[str, list[str]]:
    """A layer's MLP: megatron name suffix -> the HF name suffixes (dense, or router and experts)."""
    if not sparse:
        return {"mlp.linear_fc1.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
                "mlp.linear_fc2.weight": ["mlp.down_proj.weight"]}
    names = {"mlp.router.weight": ["mlp.gate.weight"]}
    for expert in range(shape.num_experts):
        ours, theirs = f"mlp.experts.local_experts.{expert}.", f"mlp.experts.{expert}."
        names[ours + "linear_fc1.weight"] = [theirs + "gate_proj.weight", theirs + "up_proj.weight"]
        names[ours + "linear_fc2.weight"] = [theirs + "down_proj.weight"]
    return names


# A Gated DeltaNet layer (megatron-core's `GatedDeltaNet` as `self_attention`, transformers' `linear_attn`).
_GATED_DELTA_NAMES = {"in_proj.weight": ["in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight",
                                         "in_proj_a.weight"],
                      "conv1d.weight": ["conv1d.weight"], "dt_bias": ["dt_bias"], "A_log": ["A_log"],
                      "out_norm.weight": ["norm.weight"], "out_proj.weight": ["out_proj.weight"]}


def _layer_names(shape: Shape, sparse: bool = False, linear: bool = False) -> dict[str, list[str]]:
    """Per-layer megatron name suffix -> the HF name suffixes it is built from."""
    common = {"input_layernorm.weight": ["input_layernorm.weight"],
              "pre_mlp_layernorm.weight": ["post_attention_layernorm.weight"], **_mlp_names(shape, sparse)}
    if linear:
        return {**common, **{"self_attention." + ours: ["linear_attn." + name for name in theirs]
                             for ours, theirs in _GATED_DELTA_NAMES.items()}}
    names = {**common,
             "self_attention.linear_qkv.weight": ["self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                  "self_attn.v_proj.weight"],
             "self_attention.linear_proj.weight": ["self_attn.o_proj.weight"]}
    if shape.qkv_bias:
        names["self_attention.linear_qkv.bias"] = ["self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                                   "self_attn.v_proj.bias"]
    if shape.qk_norm:
        names["self_attention.q_layernorm.weight"] = ["self_attn.q_norm.weight"]
        names["self_attention.k_layernorm.weight"] = ["self_attn.k_norm.weight"]
    return names


def name_map(shape: Shape) -> dict[str, list[str]]:
    """Every megatron parameter name (one rank, no parallelism) -> the HF tensor names it is built from."""
    if shape.gemma4_globals:
        return hf_diffusion_gemma.name_map(shape)
    names = {"embedding.word_embeddings.weight": ["model.embed_tokens.weight"],
             "decoder.final_layernorm.weight": ["model.norm.weight"]}
    if not shape.tied:
        names["output_layer.weight"] = ["lm_head.weight"]
    for layer in range(shape.num_layers):
        sparse = bool(shape.moe_layers) and bool(shape.moe_layers[layer])
        linear = bool(shape.linear_layers) and bool(shape.linear_layers[layer])
        for ours, theirs in _layer_names(shape, sparse, linear).items():
            names[_LAYER.format(layer) + ours] = [_HF_LAYER.format(layer) + name for name in theirs]
    return names


def interleave_qkv(q, k, v, shape: Shape):
    """`[q ; k ; v]` (rows, or a bias) -> per query group `[q_g ; k_g ; v_g]`. With the output gate, `q` is HF's
    `q_proj`, per head `[q_h ; gate_h]`, and the groups are megatron-core's `[q_g ; gate_g ; k_g ; v_g]`."""
    g, d = shape.num_groups, shape.head_dim
    per_group = shape.num_heads // g
    rest = q.shape[1:]
    if shape.output_gate:
        heads = q.reshape(g, per_group, 2, d, *rest)
        queries = [heads[:, :, 0].reshape(g, per_group * d, *rest), heads[:, :, 1].reshape(g, per_group * d, *rest)]
    else:
        queries = [q.reshape(g, per_group * d, *rest)]
    return torch.cat([*queries, k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1).reshape(-1, *rest)


def split_qkv(qkv, shape: Shape):
    """Inverse of `interleave_qkv`: -> (q, k, v), `q` with the output gate as HF's `q_proj` holds it."""
    g, d = shape.num_groups, shape.head_dim
    per_group = shape.num_heads // g
    rest = qkv.shape[1:]
    queries = 2 if shape.output_gate else 1
    *q, k, v = qkv.reshape(g, (queries * per_group + 2) * d, *rest).split([per_group * d] * queries + [d, d], dim=1)
    if shape.output_gate:
        q = [torch.stack([part.reshape(g, per_group, d, *rest) for part in q], dim=2)]
    return q[0].reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _vocab_rows(hf_rows_tensor, vocab: Vocabulary, dtype):
    out = torch.zeros(vocab.padded, *hf_rows_tensor.shape[1:], dtype=dtype)
    kept = min(vocab.hf_rows, vocab.padded)
    out[:kept] = hf_rows_tensor[:kept]
    if vocab.new_mask:
        out[vocab.mask_id] = hf_rows_tensor[:vocab.mean_of].double().mean(0)
    return out


def to_megatron(name: str, hf_tensors: list, shape: Shape, vocab: Vocabulary, dtype) -> torch.Tensor:
    """The megatron parameter `name` from the HF tensors `name_map(shape)[name]` names (in that order)."""
    if shape.gemma4_globals:
        return hf_diffusion_gemma.to_megatron(name, hf_tensors, shape,
                                              lambda rows: _vocab_rows(rows, vocab, dtype)).to(dtype)
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return _vocab_rows(hf_tensors[0], vocab, dtype)
    if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
        return interleave_qkv(*hf_tensors, shape).to(dtype)
    return torch.cat(hf_tensors).to(dtype)  # linear_fc1: [gate ; up]; in_proj: [qkv ; z ; b ; a]; others: one


def to_hf(name: str, tensor: torch.Tensor, shape: Shape, vocab: Vocabulary) -> list[torch.Tensor]:
    """The HF tensors `name_map(shape)[name]` names, from the megatron parameter `name`."""
    if shape.gemma4_globals:
        return hf_diffusion_gemma.to_hf(name, tensor, shape, vocab.rows)
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return [tensor[:vocab.rows]]
    if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
        return list(split_qkv(tensor, shape))
    if name.endswith("linear_fc1.weight"):
        return list(tensor.chunk(2))
    if name.endswith("self_attention.in_proj.weight"):
        return list(tensor.split(list(shape.in_proj_rows)))
    return [tensor]


def hub_tensors(shape: Shape, tensors: dict) -> dict:
    """`tensors` (HF names) as the hub stores them: DiffusionGemma's experts fused per layer, the others as named."""
    return hf_diffusion_gemma.hub_tensors(tensors) if shape.gemma4_globals else tensors


INDEX = "model.safetensors.index.json"


def _shard_files(hf_dir: str) -> list[str]:
    """The safetensors files of `hf_dir`: those its index names (as transformers loads them; any other
    `*.safetensors` beside them is ignored), else every one there."""
    index_path = os.path.join(hf_dir, INDEX)
    if not os.path.isfile(index_path):
        files = sorted(name for name in os.listdir(hf_dir) if name.endswith(".safetensors"))
        if not files:
            raise ConfigError(f"--hf-dir {hf_dir}: no *.safetensors files (convert .bin weights to safetensors "
                              f"first; pickled weights are not read)")
        return files
    try:
        with open(index_path, encoding="utf-8") as handle:
            weight_map = json.load(handle)["weight_map"]
        files = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ConfigError(f"--hf-dir {hf_dir}: {INDEX} is not a readable index ({type(error).__name__}: "
                          f"{' '.join(str(error).split())[:120]}); restore it") from None
    missing = [name for name in files if not os.path.isfile(os.path.join(hf_dir, name))]
    if missing:
        raise ConfigError(f"--hf-dir {hf_dir}: {INDEX} names the shard {missing[0]}, which is missing"
                          f"{f' ({len(missing)} shards missing in all)' if len(missing) > 1 else ''}; copy the "
                          f"model's files again")
    return files


# transformers 5's fused experts (its `qwen2_moe` weight converter, which `qwen3_moe` shares): the stored tensor
# `[E, k * R, C]` per layer -> expert e's k hub tensors `[R, C]`, rows `[j * R, (j + 1) * R)` the j-th.
FUSED_EXPERTS = {"mlp.experts.gate_up_proj": ("mlp.experts.{}.gate_proj.weight", "mlp.experts.{}.up_proj.weight"),
                 "mlp.experts.down_proj": ("mlp.experts.{}.down_proj.weight",),
                 # DiffusionGemma's (Gemma 4's) layers hold their experts beside the dense MLP, as `experts`
                 "experts.gate_up_proj": ("experts.{}.gate_proj.weight", "experts.{}.up_proj.weight"),
                 "experts.down_proj": ("experts.{}.down_proj.weight",)}


def unfused_names(key: str, shape) -> dict[str, tuple[int, int, int, list[int]]]:
    """The hub's per-expert tensors a fused expert tensor `key` of `shape` holds: name -> (expert, start row,
    stop row, shape); {} for any other tensor."""
    suffix = next((fused for fused in FUSED_EXPERTS if key.endswith("." + fused)), None)
    if suffix is None or len(shape) != 3:
        return {}
    prefix, parts = key[: -len(suffix)], FUSED_EXPERTS[suffix]
    rows = shape[1] // len(parts)
    return {prefix + part.format(expert): (expert, j * rows, (j + 1) * rows, [rows, shape[2]])
            for expert in range(shape[0]) for j, part in enumerate(parts)}


class SafetensorsDir:
    """The tensors of a local HF directory's safetensors files, each read only when asked for, in the hub's names:
    fused expert tensors (`FUSED_EXPERTS`) are seen as their per-expert tensors, each read by itself."""

    def __init__(self, hf_dir: str):
        from safetensors import safe_open

        self._files = {}
        self._where = {}
        for name in _shard_files(hf_dir):
            try:
                handle = safe_open(os.path.join(hf_dir, name), framework="pt")
            except Exception as error:  # noqa: BLE001 - safetensors' own error type: any damage
                raise ConfigError(f"--hf-dir {hf_dir}: {name} is not a readable safetensors file, damaged or "
                                  f"truncated ({' '.join(str(error).split())[:120]}); copy it again") from None
            self._files[name] = handle
            for key in handle.keys():
                self._where[key] = name
        self._parts = {}  # per-expert name -> (fused tensor, expert, start row, stop row, shape)
        for key in list(self._where):
            for part, where in unfused_names(key, self.stored_shape(key)).items():
                self._parts[part] = (key, *where)
        self._fused = {fused for fused, *_ in self._parts.values()}

    def __contains__(self, key: str) -> bool:
        return key in self._parts or (key in self._where and key not in self._fused)

    def keys(self):
        """The hub's names of the tensors (a fused expert tensor: its per-expert names)."""
        return [key for key in self._where if key not in self._fused] + list(self._parts)

    def stored_keys(self):
        """The names the files hold."""
        return self._where.keys()

    def where(self, key: str) -> str:
        return self._where[self._parts[key][0] if key in self._parts else key]

    def stored_shape(self, key: str) -> list[int]:
        return self._files[self._where[key]].get_slice(key).get_shape()

    def shape(self, key: str) -> list[int]:
        self._check(key)
        return list(self._parts[key][4]) if key in self._parts else self.stored_shape(key)

    def numel(self) -> int:
        """Elements of all tensors (what an import writes, per byte of its dtype)."""
        total = 0
        for key in self._where:
            count = 1
            for size in self.stored_shape(key):
                count *= size
            total += count
        return total

    def _check(self, key: str) -> None:
        if key not in self:
            raise UnsupportedModel(f"the HF weights have no tensor {key}: not a model this mapping can express")

    def get(self, key: str) -> torch.Tensor:
        self._check(key)
        if key in self._parts:
            fused, expert, start, stop, _ = self._parts[key]
            return self._files[self._where[fused]].get_slice(fused)[expert:expert + 1, start:stop][0].contiguous()
        return self._files[self._where[key]].get_tensor(key)


def check_shapes(hf_dir: str, weights: SafetensorsDir) -> None:
    """Refuses weights whose shapes are not those `config.json` gives the model. The expected shapes are
    transformers' own: its model class built from the config on the meta device (no memory, no init)."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(hf_dir, local_files_only=True)
        model_class = AutoModelForCausalLM
        if config.model_type == hf_diffusion_gemma.MODEL_TYPE:  # a block-diffusion model, not a causal LM
            model_class = getattr(transformers, hf_diffusion_gemma.ARCHITECTURE)
        with torch.device("meta"):
            model = model_class(config) if model_class is not AutoModelForCausalLM else model_class.from_config(config)
            expected = {name: list(tensor.shape) for name, tensor in model.state_dict().items()}
    except Exception as error:  # noqa: BLE001 - transformers refusing the config, in its own words
        raise ConfigError(f"--hf-dir {hf_dir}: transformers cannot build a model from its config.json "
                          f"({type(error).__name__}: {' '.join(str(error).split())[:160]})") from None
    for key, shape in list(expected.items()):  # transformers' fused experts, and the hub's per-expert tensors
        expected.update({part: where[3] for part, where in unfused_names(key, shape).items()})
    for key in sorted(weights.stored_keys()):
        if key in expected and list(weights.stored_shape(key)) != expected[key]:
            raise ConfigError(f"--hf-dir {hf_dir}: config.json disagrees with the weights: {key} is "
                              f"{list(weights.stored_shape(key))} in {weights.where(key)}, config.json makes it "
                              f"{expected[key]}; restore the model's config.json")
