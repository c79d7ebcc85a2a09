"""megatron-core's configs from validated arguments, as Megatron-LM maps its flags (our subset): the
`TransformerConfig`, the `OptimizerConfig`, and the lr schedule's lengths in samples.
"""

import argparse


def lr_schedule_steps(args: argparse.Namespace) -> tuple[float, int]:
    """(warmup, decay) lengths in samples, as Megatron-LM's `get_optimizer_param_scheduler` computes them."""
    decay = args.lr_decay_iters * args.global_batch_size
    if args.lr_warmup_fraction is not None:
        return args.lr_warmup_fraction * decay, decay
    return args.lr_warmup_iters * args.global_batch_size, decay


def transformer_config_kwargs(args: argparse.Namespace) -> dict:
    """megatron-core `TransformerConfig` fields from validated args (Megatron-LM's mapping, our subset)."""
    import torch
    import torch.nn.functional as F

    params_dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    return dict(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels, tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size, sequence_parallel=args.sequence_parallel,
        normalization=args.normalization, layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu, activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=args.add_bias_linear, add_qkv_bias=getattr(args, "add_qkv_bias", False),
        qk_layernorm=getattr(args, "qk_layernorm", False), init_method_std=args.init_method_std,
        # sliding-window layers, read by the core attention as megatron-core reads them (spec.layer_window)
        window_size=getattr(args, "window_size", None),
        window_attn_skip_freq=getattr(args, "window_attn_skip_freq", None),
        attention_dropout=args.attention_dropout, hidden_dropout=args.hidden_dropout,
        bf16=args.bf16, fp16=args.fp16, params_dtype=params_dtype, pipeline_dtype=params_dtype,
        recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers, recompute_modules=getattr(args, "recompute_modules", None),
        moe_layer_recompute=bool(getattr(args, "moe_layer_recompute", False)),
        calculate_per_token_loss=args.calculate_per_token_loss,
        use_cpu_initialization=bool(args.use_cpu_initialization),
        # Pipeline stages exchange this rank's CSBP rows (|owned noisy| + L/C, uneven when the blocks do not
        # split evenly), not Megatron's `seq_length / cp`: let the schedule send each message's shape.
        variable_seq_lengths=args.pipeline_model_parallel_size > 1,
        # megatron-core refuses variable_seq_lengths beside its default MoE dispatcher, even without MoE.
        **({"moe_token_dispatcher_type": "alltoall"} if args.pipeline_model_parallel_size > 1 else {}),
        **(moe_config_kwargs(args) if getattr(args, "num_experts", None) else {}),
    )


def moe_config_kwargs(args: argparse.Namespace) -> dict:
    """The MoE fields of the `TransformerConfig` (Megatron-LM's mapping of its MoE flags, our subset)."""
    def single(value):  # Megatron-LM's nargs='+' flags, read as one value when one is given
        return value[0] if isinstance(value, list) and len(value) == 1 else value

    return dict(
        num_moe_experts=args.num_experts, moe_layer_freq=args.moe_layer_freq,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_router_topk=args.moe_router_topk, moe_router_score_function=args.moe_router_score_function,
        moe_router_pre_softmax=bool(getattr(args, "moe_router_pre_softmax", False)),
        moe_router_dtype=args.moe_router_dtype,
        moe_router_load_balancing_type=single(args.moe_router_load_balancing_type),
        moe_aux_loss_coeff=single(args.moe_aux_loss_coeff),
        moe_token_dispatcher_type=args.moe_token_dispatcher_type, moe_grouped_gemm=args.moe_grouped_gemm,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size)


def transformer_config_from_args(args: argparse.Namespace):
    """A megatron-core `TransformerConfig` from validated args."""
    from megatron.core.transformer import TransformerConfig
    return TransformerConfig(**transformer_config_kwargs(args))


def optimizer_config_from_args(args: argparse.Namespace):
    """A megatron-core `OptimizerConfig` from validated args."""
    from megatron.core.optimizer import OptimizerConfig
    return OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        clip_grad=args.clip_grad, bf16=args.bf16, fp16=args.fp16,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
