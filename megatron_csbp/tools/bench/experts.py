"""The bench's mixture of experts: the trainer's MoE layers in the bench's model, what each rank routes, holds and
keeps in the distributed optimizer, and the table that sets those beside the planner's figures."""

import functools
import sys

import torch

from megatron_csbp.tools.bench.records import OptimizerState, Routing


def moe_config(args) -> dict:
    """The `TransformerConfig` fields of the bench's experts: the trainer's mapping of its MoE flags
    (`megatron_config.moe_config_kwargs`), without linear biases (megatron-core's shared expert has none, and the
    planner counts none); nothing for a dense model."""
    if not args.num_experts:
        return {}
    from megatron_csbp.training.megatron_config import moe_config_kwargs

    return dict(moe_config_kwargs(args), add_bias_linear=False)


def round_robin_routing(router, logits, padding_mask=None):
    """Top-k routing that ignores the scores' order: the rank's row `i` (in `[s, b]` order) goes to experts
    `(i * topk + j) mod E`, `j < topk`, weighted by its softmax scores there. Over `R` rows with `E | R * topk`
    every expert gets `R * topk / E` (row, expert) pairs: the planner's uniform routing, exactly."""
    experts, topk = router.config.num_moe_experts, router.topk
    logits = logits.reshape(-1, experts)
    chosen = (torch.arange(logits.shape[0], device=logits.device).unsqueeze(1) * topk
              + torch.arange(topk, device=logits.device)) % experts
    routing_map = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device).scatter_(1, chosen, True)
    return torch.softmax(logits, dim=-1) * routing_map, routing_map


class MoERouting:
    """What this rank's MoE layers route in a step, read off each router's output (a forward hook, apart from the
    all-to-all counting): per router call, the (row, expert) pairs going to each expert-parallel rank's experts
    (`E / EP` consecutive experts each); and the rank's dense and expert parameters. With
    `--moe-round-robin-routing` the routers route by `round_robin_routing`."""

    def __init__(self, model, args):
        from megatron.core import parallel_state as mpu

        self.ep, self.ep_rank = mpu.get_expert_model_parallel_world_size(), mpu.get_expert_model_parallel_rank()
        self.ep_group = torch.distributed.get_process_group_ranks(mpu.get_expert_model_parallel_group())
        self.pairs, self.rows = [], []
        for layer in model.decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is None:
                continue
            if args.moe_round_robin_routing:
                router.routing = functools.partial(round_robin_routing, router)
            router.register_forward_hook(self._routed)
        # routed experts by module name: every MoE layer's `experts` (a shared expert is dense)
        sizes = [(".experts." in name, param.numel()) for name, param in model.named_parameters()]
        self.dense_parameters = sum(size for expert, size in sizes if not expert)
        self.expert_parameters = sum(size for expert, size in sizes if expert)

    def _routed(self, module, inputs, output):
        routing_map = output[1]
        self.rows.append(routing_map.shape[0])
        self.pairs.append(routing_map.reshape(routing_map.shape[0], self.ep, -1).sum(dim=(0, 2)).tolist())

    def clear(self):
        self.pairs, self.rows = [], []

    def record(self) -> Routing:
        """The last step's routing, and the parameters."""
        return Routing(self.ep_rank, self.ep_group, list(self.rows), list(self.pairs), self.dense_parameters,
                       self.expert_parameters)


def optimizer_state(model, config) -> OptimizerState:
    """The memory megatron-core's distributed optimizer gives this rank, measured on `model`: the fp32 gradient
    buffers DDP allocates (whole, dense and expert, padded as megatron-core pads them), and Adam's state tensors
    for the shard of the parameters megatron-core assigns this rank (the dense parameters' sharded over DP x CP,
    the experts' over the expert-data-parallel group, which is DP x CP under EP1; the plugin gives the experts
    their own optimizer on every EP size, `mcore.model`). The state is allocated by the inner torch optimizer's own
    step on those shards, given zero gradients: the shards are megatron-core's, the step needs no gradient
    exchange (which gloo cannot coalesce)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                                        use_distributed_optimizer=True), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, use_distributed_optimizer=True,
                                                       params_dtype=torch.float32), [ddp])
    state = {False: 0, True: 0}  # Adam's state bytes of the dense (False) and the expert (True) parameters
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = sub.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                param.grad = torch.zeros_like(param)
        inner.step()
        for group in inner.param_groups:
            for param in group["params"]:
                tensors = [t for t in inner.state.get(param, {}).values()
                           if torch.is_tensor(t) and t.dim() > 0]  # Adam's moments (not its step count)
                state[bool(group["is_expert_parallel"])] += sum(
                    t.numel() * t.element_size() for t in tensors)
    gradient = lambda buffers: sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers)  # noqa: E731
    return OptimizerState(state[False], state[True], gradient(ddp.buffers), gradient(ddp.expert_parallel_buffers))


def planned_experts(args, mode, seq_length):
    """The planner's figures for `mode` at `seq_length` on the bench's MoE model, layout and EP (bytes do not
    depend on the GPU): the prediction, whose `all_to_all_bytes` assume uniform routing."""
    from megatron_csbp.core import modes
    from megatron_csbp.tools import plan

    model = plan.Model(num_layers=args.num_layers, hidden_size=args.hidden_size,
                       num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
                       ffn_hidden_size=args.ffn_hidden_size, vocab_size=args.vocab_size - 2, untie_embeddings=True,
                       seq_length=seq_length, block_size=args.block_size, bytes_per_elem=4,
                       recompute=args.recompute_granularity, micro_batch_size=args.micro_batch_size,
                       transport=args.csbp_transport, num_experts=args.num_experts,
                       moe_router_topk=args.moe_router_topk, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
                       moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
                       moe_layer_freq=args.moe_layer_freq, moe_router_dtype=args.moe_router_dtype)
    mode, nproc = modes.parallel_mode(mode), args.nproc
    topology = plan.Topology(mode, 1, 1, nproc, mode.clean_shards(nproc), 1, args.expert_model_parallel_size,
                             args.expert_tensor_parallel_size)
    return plan.predict(model, plan.Cluster(nproc, nproc, plan.GPU_PRESETS["h200"]), topology)


def print_experts(args, records, out=None):
    """Per rank of each MoE run: the all-to-all bytes it sent (counted off the collectives) beside the planner's
    uniform-routing figure, the (row, expert) pairs its rows sent to other EP ranks and received from them (off
    the routers' outputs), its dense and expert parameters and the distributed optimizer's state, beside the
    planner's."""
    out = out or sys.stdout
    rows = [r for r in records if r.experts]
    if not rows:
        return
    routing = " (round robin: uniform)" if args.moe_round_robin_routing else ""
    print(f"\nexperts: {args.num_experts} per MoE layer, top-{args.moe_router_topk}, EP"
          f"{args.expert_model_parallel_size}, {args.moe_token_dispatcher_type} dispatcher{routing}; per rank, "
          f"measured | planner", file=out)
    header = (f"{'mode':<10} {'L':>7} {'rank':>4} {'a2a bytes':>12} {'planner':>12} {'pairs out':>9} {'pairs in':>8} "
              f"{'dense params':>12} {'planner':>10} {'expert params':>13} {'planner':>10} {'Adam dense B':>12} "
              f"{'Adam expert B':>13} {'planner':>10}")
    print(header, file=out)
    print("-" * len(header), file=out)
    for r in rows:
        q = planned_experts(args, r.mode, r.seq_length)
        routing = r.experts.routing
        for rank, (sent, mine, state) in enumerate(zip(r.all_to_all_bytes_by_rank, routing, r.experts.state)):
            pairs_out = sum(sum(layer) - layer[mine.ep_rank] for layer in mine.routed_pairs_to_ep_ranks)
            pairs_in = sum(layer[mine.ep_rank] for other in mine.ep_group if other != rank
                           for layer in routing[other].routed_pairs_to_ep_ranks)
            print(f"{r.mode.name:<10} {r.seq_length:>7} {rank:>4} {sent:>12,} {q.all_to_all_bytes:>12,.0f} "
                  f"{pairs_out:>9,} {pairs_in:>8,} {mine.dense_parameters:>12,} "
                  f"{q.dense_params_per_rank:>10,.0f} {mine.expert_parameters:>13,} "
                  f"{q.expert_params_per_rank:>10,.0f} {state.optimizer_dense_state_bytes:>12,} "
                  f"{state.optimizer_expert_state_bytes:>13,} {q.optimizer_bytes:>10,.0f}", file=out)
