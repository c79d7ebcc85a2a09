"""One Megatron training step of a small GQA/RoPE GPTModel (tied embeddings) on any composition, and its
comparison with a reference step: the machinery test_megatron_composition, test_packing and test_moe share.

`train_step` runs megatron-core's DDP, `finalize_model_grads`, `get_forward_backward_func` and
`get_megatron_optimizer` with a BDLM forward step, from given weights (loaded by global layer number) or, for a
reference, from Megatron's initialisation perturbed so norms and biases are not trivial. It returns the loss,
every parameter's gradient (gathered over TP; an expert's over expert TP, numbered by its global expert index)
and every parameter after the optimizer step, by global name; `worst_error` is the largest relative difference
of all three (and of any named scalars) from a reference's, over every rank.
"""

from dataclasses import dataclass

import torch

from spawn import on_cpu_backend

SEQ, BLOCK, VOCAB, MASK = 32, 4, 64, 63


@dataclass(frozen=True)
class Topology:
    name: str
    mode: str = "csbp"  # "reference" or a --bdlm-parallel-mode: "csbp", "cp", "cp-traffic", "bp"
    tp: int = 1
    pp: int = 1
    block_parallel: int = 1
    clean_shards: int = 1
    ep: int = 1  # expert model parallel size
    etp: int | None = None  # expert tensor parallel size (None: TP)
    sequence_parallel: bool = False
    transport: str = "collective"
    seq: int = SEQ
    block: int = BLOCK
    megatron_rope: bool = False  # negative control
    logits_tile_rows: int | None = None  # the loss as a tiled linear cross-entropy (None: the whole logits)


def _config(topology, **overrides):
    """The model's TransformerConfig under `topology`; `overrides` (a mixture of experts, say) replace or add
    fields."""
    from megatron.core.transformer import TransformerConfig

    fields = dict(
        num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
        tensor_model_parallel_size=topology.tp, pipeline_model_parallel_size=topology.pp,
        context_parallel_size=topology.block_parallel, sequence_parallel=topology.sequence_parallel,
        expert_model_parallel_size=topology.ep, expert_tensor_parallel_size=topology.etp or topology.tp,
        normalization="RMSNorm", use_cpu_initialization=True, calculate_per_token_loss=True,
        hidden_dropout=0.0, attention_dropout=0.0, pipeline_dtype=torch.float32,
        # as megatron_config.transformer_config_kwargs sets them
        variable_seq_lengths=topology.pp > 1, moe_token_dispatcher_type="alltoall" if topology.pp > 1 else "allgather")
    return TransformerConfig(**{**fields, **overrides})


def _global_name(model, name):
    """Parameter name with the pipeline stage's local layer index replaced by the global one and each local expert
    numbered by its global expert index; the last stage's copy of the tied embedding is the embedding."""
    from megatron.core import parallel_state as mpu

    if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
        return "embedding.word_embeddings.weight"
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(model.decoder.layers[int(parts[2])].layer_number - 1)
    if "local_experts" in parts:
        at = parts.index("local_experts") + 1
        local = len(model.get_submodule(".".join(name.split(".")[:at])))
        parts[at] = str(mpu.get_expert_model_parallel_rank() * local + int(parts[at]))
    return ".".join(parts)


def _tp_group(param):
    """The group a parameter is split over: expert tensor parallelism for an expert's, TP for the rest."""
    from megatron.core import parallel_state as mpu

    is_expert = not getattr(param, "allreduce", True)
    return mpu.get_expert_tensor_parallel_group() if is_expert else mpu.get_tensor_model_parallel_group()


def _full(param, tensor):
    """`tensor` (a TP shard of `param`'s shape) gathered over its TP group, strided shards (SwiGLU's fc1 holds
    `[gate_r ; up_r]`) put back in the full weight's order."""
    group = _tp_group(param)
    if not getattr(param, "tensor_model_parallel", False) or group.size() == 1:
        return tensor.detach().clone()
    shards = [torch.empty_like(tensor) for _ in range(group.size())]
    torch.distributed.all_gather(shards, tensor.detach().contiguous(), group=group)
    sections = getattr(param, "tensor_parallel_sections", None)
    if sections is not None:  # each rank holds its slice of every section (Gated DeltaNet's in_proj, conv1d)
        pieces = [shard.split([size // group.size() for size in sections]) for shard in shards]
        return torch.cat([pieces[rank][part] for part in range(len(sections)) for rank in range(group.size())])
    stride, dim = getattr(param, "partition_stride", 1), getattr(param, "partition_dim", 0)
    pieces = [shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([pieces[rank][part] for part in range(stride) for rank in range(group.size())], dim=dim)


def _load(model, weights):
    """The full `weights` into this rank's shards (the inverse of `_full`)."""
    for name, param in model.named_parameters():
        full = weights[_global_name(model, name)]
        group = _tp_group(param)
        sections = getattr(param, "tensor_parallel_sections", None)
        if getattr(param, "tensor_model_parallel", False) and group.size() > 1 and sections is not None:
            full = torch.cat([section.chunk(group.size())[group.rank()] for section in full.split(list(sections))])
        elif getattr(param, "tensor_model_parallel", False) and group.size() > 1:
            stride, dim = getattr(param, "partition_stride", 1), getattr(param, "partition_dim", 0)
            chunks = full.chunk(group.size() * stride, dim=dim)
            full = torch.cat(chunks[group.rank()::group.size()], dim=dim)
        param.data.copy_(full)


def micro_batches(dp_rank, dp_size, *, micro_batch, num_micro, seq=SEQ, seed=2024):
    """This data-parallel rank's share of `num_micro` micro-batches of `micro_batch` random clean samples (`seq`
    ids below MASK, drawn from `seed`), each with its sample index (100 on): the same samples on every layout."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, MASK, (micro_batch * num_micro, seq), generator=generator)
    sample_index = torch.arange(micro_batch * num_micro) + 100
    per_rank = num_micro // dp_size
    return [{"tokens": tokens[m * micro_batch:(m + 1) * micro_batch],
             "sample_index": sample_index[m * micro_batch:(m + 1) * micro_batch]}
            for m in range(dp_rank * per_rank, (dp_rank + 1) * per_rank)]


def train_step(topology, weights, build_model, forward_step, batches, micro_batch_size, make_config=_config,
               before_step=None, after_step=None, ddp_options=None, iterations=1):
    """One Megatron training step under `topology` from `weights` (full tensors by global name; None: Megatron's
    initialisation perturbed, returned as "initial"). `make_config(topology)`: its TransformerConfig,
    `build_model(topology, config) -> (model, layout)`, `forward_step(layout)`: the step's forward-step function,
    `batches(dp_rank, dp_size)`: this rank's micro-batches; `before_step(ddp)` runs before the forward and
    `after_step(num_microbatches) -> dict` after the backward, its entries joining the result; `ddp_options`: our
    loop's `data_parallel` options (overlap, the distributed optimizer), which wrap the model as the loop does;
    `iterations`: steps taken on the same batches, the last one's results returned. Returns the loss
    (on the last pipeline stage, else None), the gathered grads and the parameters after the step by global name,
    the initial weights and the grad norm."""
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_csbp.mcore import parallel_state
    from megatron_csbp.mcore.model import pipeline_seq_length
    from megatron_csbp.training.loop import data_parallel, synced_parameters

    parallel_state.initialize_model_parallel(
        topology.tp, topology.pp, context_block_parallel_size=topology.block_parallel,
        clean_shards=topology.clean_shards, expert_model_parallel_size=topology.ep,
        expert_tensor_parallel_size=topology.etp or topology.tp)
    try:
        torch.manual_seed(1234)
        model_parallel_cuda_manual_seed(1234)
        config = make_config(topology)
        model, layout = build_model(topology, config)
        if weights is None:  # the reference: perturb Megatron's init so norms and biases are not trivial
            generator = torch.Generator().manual_seed(7)
            for _, param in sorted(model.named_parameters()):
                param.data.add_(0.05 * torch.randn(param.shape, generator=generator))
            initial = {name: param.detach().clone() for name, param in model.named_parameters()}
        else:
            _load(model, weights)
            initial = None
        ddp_options = ddp_options or {}
        ddp = data_parallel(model, config, **ddp_options)
        config.finalize_model_grads_func = finalize_model_grads
        # adam_eps well above rounding noise: grads that are zero in exact arithmetic (the key bias's)
        # come out ~1e-10, and Adam with eps=1e-8 would turn that noise into lr-sized updates.
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.01, adam_eps=1e-4, clip_grad=1.0,
                            params_dtype=torch.float32,
                            use_distributed_optimizer=ddp_options.get("use_distributed_optimizer", False)), [ddp])
        if before_step:
            before_step(ddp)
        for _ in range(iterations):
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            rank_batches = batches(mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size())
            reports = get_forward_backward_func()(
                forward_step_func=forward_step(layout), data_iterator=iter(rank_batches), model=[ddp],
                # Under pipeline parallelism the clean length L stands here, as Megatron-LM's pretrain() passes
                # it: the shapes travel with the messages (variable_seq_lengths), so it must not matter.
                num_microbatches=len(rank_batches),
                seq_length=topology.seq if topology.pp > 1 else pipeline_seq_length(layout, config),
                micro_batch_size=micro_batch_size, forward_only=False)
            loss, losses = None, {}
            if mpu.is_pipeline_last_stage():  # each reported loss (the lm loss, and its parts where it has two)
                for name in sorted(reports[0]):
                    total = torch.stack([r[name] for r in reports]).sum(0)
                    torch.distributed.all_reduce(total, group=mpu.get_data_parallel_group(with_context_parallel=True))
                    losses[name] = (total[0] / total[1]).item()
                loss = losses["lm loss"]
            observed = after_step(len(rank_batches)) if after_step else {}
            grads = {_global_name(model, n): _full(p, p.main_grad) for n, p in model.named_parameters()}
            success, grad_norm, _ = optimizer.step()
            assert success
        synced_parameters(ddp)  # --overlap-param-gather leaves the gather of the updated parameters to the next forward
        after = {_global_name(model, n): _full(p, p) for n, p in model.named_parameters()}
        return dict(loss=loss, losses=losses, grads=grads, after=after, initial=initial, grad_norm=grad_norm,
                    **observed)
    finally:
        parallel_state.destroy_model_parallel()


@on_cpu_backend
def run_steps(rank, world_size, step, items, weights):
    """On each rank of a spawn: `step(item, weights)` for each of `items` in order, from `weights` (numpy arrays by
    global name; None: the first step's own initial weights, which the later steps then start from)."""
    if weights is not None:
        weights = {name: torch.from_numpy(array) for name, array in weights.items()}
    results = []
    for item in items:
        result = step(item, weights)
        weights = weights if weights is not None else result["initial"]
        results.append(_as_numpy(result))
    return results


def _as_numpy(result):
    """Tensors leave a rank as numpy arrays: torch tensors would travel as shared memory the exiting
    rank takes with it."""
    if isinstance(result, dict):
        return {key: _as_numpy(value) for key, value in result.items()}
    return result.numpy() if isinstance(result, torch.Tensor) else result


def _relative(a, b):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).norm() / b.norm()).item()


def worst_error(per_rank, reference, scalars=()):
    """Largest relative error of loss, grads, updated params and each of `scalars` (every rank's) over all ranks;
    checks every param is seen."""
    losses = [r["loss"] for r in per_rank if r["loss"] is not None]
    assert losses, "no rank reported a loss"
    worst = max(abs(loss - reference["loss"]) / abs(reference["loss"]) for loss in losses)
    for scalar in scalars:
        worst = max([worst] + [abs(r[scalar] - reference[scalar]) / abs(reference[scalar]) for r in per_rank])
    for field in ("grads", "after"):
        seen = set()
        for result in per_rank:
            for name, tensor in result[field].items():
                worst = max(worst, _relative(tensor, reference[field][name]))
                seen.add(name)
        assert seen == set(reference[field]), f"{field}: missing {set(reference[field]) - seen}"
    return worst
