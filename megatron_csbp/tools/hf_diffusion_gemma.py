"""Hugging Face <-> megatron-core weights for DiffusionGemma (transformers' `DiffusionGemmaForBlockDiffusion`).

transformers' model is a causal encoder and a canvas decoder sharing every weight: the encoder reads the clean
prefix into the KV cache, the decoder denoises a canvas against it. Ours is one decoder over `[x_t ; x_0]` rows,
the clean rows its encoder (a token-causal clean stream), so the decoder's weights are ours. The hub's checkpoint
holds the decoder's tensors (`model.decoder.*`), the encoder's `layer_scalar` buffers beside them (buffers are not
tied: they must equal the decoder's) and the vision tower, which is not converted (training here reads text;
transformers builds a vision tower of the config's shape at load).

Per layer (`model.decoder.layers.i.` -> `decoder.layers.i.`): the norms by name (the attention's output norm
`post_attention_layernorm` is `self_attention.post_attention_layernorm`; the feed-forward block's five are
`mcore.gemma4_moe`'s), `layer_scalar` a buffer; the fused `linear_qkv` is, per K/V group, `[q_g ; k_g ; v_g]` on
sliding layers and `[q_g ; k_g]` on global ones (no `v_proj`: the key is the value); `q_norm`, `k_norm`, `o_proj`
are `q_layernorm`, `k_layernorm`, `linear_proj`. The MoE block: `router.proj` is the router's weight, its `scale`
and `per_expert_scale` by name; the dense MLP is the shared expert (`linear_fc1` `[gate_proj ; up_proj]`); expert
`e`'s `linear_fc1` / `linear_fc2` are `experts.gate_up_proj[e]` (`[gate ; up]`) and `experts.down_proj[e]`, read one
expert at a time (`hf.SafetensorsDir`) and written fused, as transformers stores them (`hub_tensors`). The
self-conditioning block's four tensors, the final norm and the (tied) embedding by name.

The model's flags (`model_flags`) come from transformers' own reading of the config (its per-layer head size and
K/V heads, its rope parameters): Gemma 4's attention and MoE block, the windows (`sliding_window - 1` keys before a
token, `layer_types`' sliding layers), the softcap, the embedding scale, and the objective the release was trained
with: `diffusion-gemma` with the canvas as the block, its causal encoder as the token-causal clean stream and its
AR co-loss (weight 1, Turbo-dLLM's recipe).
"""

import re

import torch

from megatron_csbp.core import objectives
from megatron_csbp.core.clean_attention import TOKEN_CAUSAL
from megatron_csbp.core.rules import ConfigError

ARCHITECTURE = "DiffusionGemmaForBlockDiffusion"
MODEL_TYPE, TEXT_MODEL_TYPE = "diffusion_gemma", "diffusion_gemma_text"
EMBEDDING = "model.decoder.embed_tokens.weight"
SLIDING, GLOBAL = "sliding_attention", "full_attention"
AR_LOSS_WEIGHT = 1.0  # the clean encoder's next-token loss, Turbo-dLLM's diffusiongemma recipe
DROPPED_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")
ENCODER_SCALAR = "model.encoder.language_model.layers.{}.layer_scalar"
_EXPERT = re.compile(r"^(.*\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def is_diffusion_gemma(config: dict) -> bool:
    return (config.get("architectures") or [None])[0] == ARCHITECTURE or config.get("model_type") == MODEL_TYPE


def _text_config(config: dict, name: str):
    """transformers' resolved text config (per-layer sizes, rope parameters, layer types), or one line why not."""
    from transformers.models.diffusion_gemma.configuration_diffusion_gemma import DiffusionGemmaTextConfig

    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{name}: config.json has no text_config object; restore the model's config.json")
    try:
        return DiffusionGemmaTextConfig(**{key: value for key, value in text.items() if key != "model_type"})
    except Exception as error:  # noqa: BLE001 - transformers refusing the config, in its own words
        raise ConfigError(f"{name}: transformers cannot read its text_config ({type(error).__name__}: "
                          f"{' '.join(str(error).split())[:160]})") from None


def _attention_sizes(text, kind: str, name: str) -> tuple[int, int] | None:
    """(head size, K/V heads) of the layers of `kind`, one shape for all of them (None: no such layer)."""
    sizes = {(text.per_layer_config[i].head_dim, text.per_layer_config[i].num_key_value_heads)
             for i, layer_kind in enumerate(text.layer_types) if layer_kind == kind}
    if len(sizes) > 1:
        raise ConfigError(f"{name}: its {kind} layers have {len(sizes)} attention shapes {sorted(sizes)}; one converts")
    return sizes.pop() if sizes else None


def model_flags(config: dict) -> dict:
    """Our flags (YAML keys) of a DiffusionGemma `config.json`; one line where it cannot be expressed."""
    name = ARCHITECTURE
    text = _text_config(config, name)

    def refuse(condition, message):
        if condition:
            raise ConfigError(f"{name}: {message}")

    types = list(text.layer_types)
    refuse(not set(types) <= {SLIDING, GLOBAL}, f"layer_types {sorted(set(types))}: only sliding- and full-attention "
                                                f"layers convert")
    refuse(text.use_bidirectional_attention is not None,
           f"use_bidirectional_attention {text.use_bidirectional_attention!r}: the encoder converts as causal (the "
           f"token-causal clean stream) only")
    refuse(not text.num_experts or not text.top_k_experts, "a DiffusionGemma without experts does not convert")
    refuse(text.hidden_activation != "gelu_pytorch_tanh", f"hidden_activation {text.hidden_activation}: Gemma 4's "
                                                          f"block is gelu_pytorch_tanh")
    refuse(bool(text.attention_bias), "attention_bias cannot be expressed (Gemma 4's attention has no biases)")
    refuse(not text.final_logit_softcapping, "final_logit_softcapping must be set (DiffusionGemma caps its logits)")
    rope = text.rope_parameters
    refuse(rope[SLIDING].get("rope_type", "default") != "default" or rope[SLIDING].get("partial_rotary_factor", 1.0)
           != 1.0, f"sliding layers' rope {rope[SLIDING]}: plain RoPE over the whole head converts")
    refuse(rope[GLOBAL].get("rope_type") != "proportional" or rope[GLOBAL].get("factor", 1.0) != 1.0,
           f"global layers' rope {rope[GLOBAL]}: proportional RoPE without scaling converts")
    theta = rope[SLIDING]["rope_theta"]
    refuse(theta != int(theta), f"the sliding layers' rope_theta {theta} is not an integer (--rotary-base takes one)")
    global_head, global_groups = _attention_sizes(text, GLOBAL, name)
    head, groups = _attention_sizes(text, SLIDING, name) or (global_head, global_groups)
    sliding = [int(kind == SLIDING) for kind in types]
    canvas = config.get("canvas_length") or 256
    flags = {
        "num-layers": text.num_hidden_layers, "hidden-size": text.hidden_size,
        "ffn-hidden-size": text.intermediate_size, "num-attention-heads": text.num_attention_heads,
        "group-query-attention": groups != text.num_attention_heads, "num-query-groups": groups, "kv-channels": head,
        "max-position-embeddings": text.max_position_embeddings, "position-embedding-type": "rope",
        "rotary-base": int(theta), "normalization": "RMSNorm", "norm-epsilon": float(text.rms_norm_eps),
        "disable-bias-linear": True, "qk-layernorm": True, "untie-embeddings-and-output-weights": False,
        "attention-dropout": 0.0, "hidden-dropout": 0.0,
        "num-experts": text.num_experts, "moe-router-topk": text.top_k_experts,
        "moe-ffn-hidden-size": text.moe_intermediate_size, "moe-shared-expert-intermediate-size":
            text.intermediate_size, "moe-layer-freq": 1, "moe-router-score-function": "softmax", "gemma4-moe": True,
        "gemma4-attention": True, "global-kv-channels": global_head, "global-num-query-groups": global_groups,
        "global-rotary-base": float(rope[GLOBAL]["rope_theta"]),
        "global-rotary-percent": float(rope[GLOBAL].get("partial_rotary_factor", 1.0)),
        "final-logit-softcapping": float(text.final_logit_softcapping), "scale-embeddings": True,
        "bdlm-objective": objectives.DIFFUSION_GEMMA.name, "bdlm-block-size": canvas,
        "bdlm-clean-attention": TOKEN_CAUSAL.name, "bdlm-ar-loss-weight": AR_LOSS_WEIGHT,
    }
    if any(sliding):
        flags["window-size"] = [text.sliding_window - 1, 0]
        flags["window-attn-skip-freq"] = sliding
    return flags


def weights_problem(weights, num_layers: int) -> str | None:
    """What of the HF weights (`hf.SafetensorsDir`) is not one model (one line), or None: the encoder's layer
    scalars, buffers stored beside the decoder's, must equal them."""
    for layer in range(num_layers):
        decoder, encoder = f"model.decoder.layers.{layer}.layer_scalar", ENCODER_SCALAR.format(layer)
        if decoder in weights and encoder in weights and not torch.equal(weights.get(decoder), weights.get(encoder)):
            return (f"{encoder} ({weights.get(encoder).tolist()}) is not {decoder} ({weights.get(decoder).tolist()}): "
                    f"transformers' encoder and decoder are one model only when they agree; restore the weights")
    return None


def name_map(shape) -> dict[str, list[str]]:
    """Every megatron tensor name (one rank; `layer_scalar` is a buffer) -> the HF tensor names it is built from."""
    names = {"embedding.word_embeddings.weight": [EMBEDDING],
             "decoder.final_layernorm.weight": ["model.decoder.norm.weight"],
             **{"self_conditioning." + ours: ["model.decoder.self_conditioning." + theirs]
                for ours, theirs in (("pre_norm_weight", "pre_norm.weight"), ("gate", "gate_proj.weight"),
                                     ("up", "up_proj.weight"), ("down", "down_proj.weight"))}}
    for layer in range(shape.num_layers):
        ours, theirs = f"decoder.layers.{layer}.", f"model.decoder.layers.{layer}."
        attention = ["self_attn.q_proj.weight", "self_attn.k_proj.weight"]
        if not shape.gemma4_globals[layer]:
            attention.append("self_attn.v_proj.weight")
        per_layer = {
            "layer_scalar": ["layer_scalar"], "input_layernorm.weight": ["input_layernorm.weight"],
            "self_attention.linear_qkv.weight": attention,
            "self_attention.linear_proj.weight": ["self_attn.o_proj.weight"],
            "self_attention.q_layernorm.weight": ["self_attn.q_norm.weight"],
            "self_attention.k_layernorm.weight": ["self_attn.k_norm.weight"],
            "self_attention.post_attention_layernorm.weight": ["post_attention_layernorm.weight"],
            "mlp.router.weight": ["router.proj.weight"], "mlp.router.scale": ["router.scale"],
            "mlp.router.per_expert_scale": ["router.per_expert_scale"],
            "mlp.shared_experts.linear_fc1.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
            "mlp.shared_experts.linear_fc2.weight": ["mlp.down_proj.weight"],
            "mlp.pre_feedforward_layernorm.weight": ["pre_feedforward_layernorm.weight"],
            "mlp.post_dense_layernorm.weight": ["post_feedforward_layernorm_1.weight"],
            "mlp.pre_experts_layernorm.weight": ["pre_feedforward_layernorm_2.weight"],
            "mlp.post_experts_layernorm.weight": ["post_feedforward_layernorm_2.weight"],
            "mlp.post_feedforward_layernorm.weight": ["post_feedforward_layernorm.weight"]}
        for expert in range(shape.num_experts):
            per_layer[f"mlp.experts.local_experts.{expert}.linear_fc1.weight"] = [
                f"experts.{expert}.gate_proj.weight", f"experts.{expert}.up_proj.weight"]
            per_layer[f"mlp.experts.local_experts.{expert}.linear_fc2.weight"] = [f"experts.{expert}.down_proj.weight"]
        for suffix, hf_names in per_layer.items():
            names[ours + suffix] = [theirs + name for name in hf_names]
        names[ours + "layer_scalar"].append(ENCODER_SCALAR.format(layer))
    return names


def _attention_shape(name: str, shape) -> tuple[int, int, bool]:
    """(K/V groups, head size, key is the value) of the layer the megatron `name` is in."""
    layer = int(name.split(".")[2])
    if shape.gemma4_globals[layer]:
        return shape.global_groups, shape.global_head_dim, True
    return shape.num_groups, shape.head_dim, False


def to_megatron(name: str, hf_tensors: list, shape, vocab_rows) -> torch.Tensor:
    """The megatron tensor `name` from the HF tensors `name_map(shape)[name]` names (in that order);
    `vocab_rows(tensor)`: the embedding padded to ours (`hf._vocab_rows`)."""
    if name == "embedding.word_embeddings.weight":
        return vocab_rows(hf_tensors[0])
    if name.endswith("layer_scalar"):  # the decoder's (the encoder's equal: `weights_problem`)
        return hf_tensors[0]
    if name.endswith("linear_qkv.weight"):
        groups, head, shared = _attention_shape(name, shape)
        q, k = hf_tensors[0].view(groups, -1, hf_tensors[0].shape[-1]), hf_tensors[1].view(groups, head, -1)
        parts = [q, k] if shared else [q, k, hf_tensors[2].view(groups, head, -1)]
        return torch.cat(parts, dim=1).reshape(-1, hf_tensors[0].shape[-1])
    return torch.cat(hf_tensors)  # linear_fc1: [gate ; up]; the others: one tensor


def to_hf(name: str, tensor: torch.Tensor, shape, rows: int) -> list[torch.Tensor]:
    """The HF tensors `name_map(shape)[name]` names, from the megatron tensor `name` (the embedding's first `rows`)."""
    if name == "embedding.word_embeddings.weight":
        return [tensor[:rows]]
    if name.endswith("layer_scalar"):
        return [tensor, tensor]
    if name.endswith("linear_qkv.weight"):
        groups, head, shared = _attention_shape(name, shape)
        per_group = tensor.view(groups, -1, tensor.shape[-1])
        queries = per_group.shape[1] - head * (1 if shared else 2)
        parts = per_group.split([queries, head] + ([] if shared else [head]), dim=1)
        return [part.reshape(-1, tensor.shape[-1]) for part in parts]
    if name.endswith("linear_fc1.weight"):
        return list(tensor.chunk(2))
    return [tensor]


def hub_tensors(tensors: dict) -> dict:
    """`tensors` (HF names) with each layer's per-expert tensors fused as transformers stores them:
    `experts.gate_up_proj [E, 2I, H]` (`[gate ; up]` per expert) and `experts.down_proj [E, H, I]`."""
    fused, experts = {}, {}
    for key, tensor in tensors.items():
        match = _EXPERT.match(key)
        if match is None:
            fused[key] = tensor
            continue
        prefix, expert, part = match.group(1), int(match.group(2)), match.group(3)
        experts.setdefault(prefix, {}).setdefault(expert, {})[part] = tensor
    for prefix, by_expert in experts.items():
        order = sorted(by_expert)
        if order != list(range(len(order))):
            raise RuntimeError(f"{prefix}: experts {order} are not all in one shard")
        fused[prefix + "gate_up_proj"] = torch.stack([torch.cat([by_expert[e]["gate_proj"], by_expert[e]["up_proj"]])
                                                      for e in order])
        fused[prefix + "down_proj"] = torch.stack([by_expert[e]["down_proj"] for e in order])
    return fused


def export_config(args, base: dict | None, rows: int, dtype, bdlm_keys: dict) -> dict:
    """The `config.json` of our DiffusionGemma checkpoint: the imported one updated (its vision config and token
    ids kept), else one built from the flags; `bdlm_keys`: how it decodes (`hf.bdlm_config`)."""
    from megatron_csbp.core.run_config import RunConfig

    run = RunConfig.from_args(args)
    shape, attention = run.shape, run.shape.gemma4_attention
    windows = run.layer_windows
    types = [SLIDING if window.sliding else GLOBAL for window in windows]
    sliding_windows = {window.hf_sliding_window for window in windows if window.sliding}
    config = dict(base) if base else {}
    text = dict(config.get("text_config") or {})
    for stale in ("per_layer_config", "rope_scaling", "rope_theta"):
        text.pop(stale, None)
    text.update(
        model_type=TEXT_MODEL_TYPE, vocab_size=rows, hidden_size=shape.hidden_size,
        intermediate_size=shape.moe.shared_expert_ffn_hidden_size, moe_intermediate_size=shape.moe.ffn_hidden_size,
        num_experts=shape.moe.num_experts, top_k_experts=shape.moe.topk, num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_attention_heads, num_key_value_heads=shape.num_query_groups,
        head_dim=shape.kv_channels, global_head_dim=attention.global_kv_channels,
        num_global_key_value_heads=attention.global_query_groups, attention_k_eq_v=True, layer_types=types,
        sliding_window=sliding_windows.pop() if sliding_windows else text.get("sliding_window", 512),
        rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": float(args.rotary_base)},
                         GLOBAL: {"rope_type": "proportional", "rope_theta": float(attention.global_rotary_base),
                                  "partial_rotary_factor": float(attention.global_rotary_fraction)}},
        rms_norm_eps=args.norm_epsilon, final_logit_softcapping=float(run.final_logit_softcapping),
        hidden_activation="gelu_pytorch_tanh", attention_bias=False, tie_word_embeddings=True,
        max_position_embeddings=args.max_position_embeddings, use_bidirectional_attention=None)
    config.update(architectures=[ARCHITECTURE], model_type=MODEL_TYPE, text_config=text, tie_word_embeddings=True,
                  canvas_length=args.bdlm_block_size, dtype=str(dtype).removeprefix("torch."), **bdlm_keys)
    return config


def export_problem(args) -> str | None:
    """What of a checkpoint with Gemma 4's attention DiffusionGemma cannot hold (one line), or None."""
    from megatron_csbp.core.run_config import RunConfig

    run = RunConfig.from_args(args)
    if run.objective is not objectives.DIFFUSION_GEMMA or run.clean_attention is not TOKEN_CAUSAL:
        return ("--gemma4-attention exports as DiffusionGemma (DiffusionGemmaForBlockDiffusion), whose decoder is "
                "trained with --bdlm-objective diffusion-gemma and a token-causal clean stream; this checkpoint is "
                f"{run.objective.name} with {run.clean_attention.name} clean attention")
    if not run.final_logit_softcapping or not run.scale_embeddings or not run.self_conditioning:
        return ("a DiffusionGemma caps its logits, scales its embeddings and self-conditions: this checkpoint lacks "
                "--final-logit-softcapping, --scale-embeddings or its self-conditioning block")
    if run.shape.untied_output:
        return "--untie-embeddings-and-output-weights: DiffusionGemma ties its head to the embedding"
    return None
