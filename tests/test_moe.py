"""Mixture-of-experts under CSBP: one Megatron training step of a tiny MoE BDLM (4 experts, top-2, megatron-core's
MoE layers under the CSBP layer spec) on every composition equals the one-rank run.

Compositions: CSBP2 alone, EP2 x CSBP2 (EP carved from DP x CP as megatron-core does), EP2 x TP2 + SP (the
alltoall dispatcher over expert and tensor parallelism), MoE + PP2 (1F1B) and DP2 x EP2 (expert gradients reduced
over the expert-data-parallel group). Loss, grad norm, every parameter's gradient (experts gathered by global
expert index, TP shards gathered) and every parameter after the optimizer step match the one-rank run to 1e-5
relative, with the load-balancing (aux) loss on. Routing is deterministic: no capacity (no token dropping), and the
router's fp32 logits of random weights have no ties. The one-rank reference is the same model with dense BD3-LM
attention (`test_megatron_composition.dense_bdlm_attention_class`), independent of the CSBP op.
Negative control: EP2 x CSBP2 whose expert gradients are not reduced over the expert-data-parallel group must
not match.
"""

import os
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

import megatron_step
import test_megatron_composition as composition
from spawn import on_cpu_backend, run_ranks

pytest_plugins = ["pretrain_runs"]  # the corpus fixture
SEQ, BLOCK, VOCAB, MASK = megatron_step.SEQ, megatron_step.BLOCK, megatron_step.VOCAB, megatron_step.MASK
MICRO_BATCH, NUM_MICRO = composition.MICRO_BATCH, composition.NUM_MICRO
EXPERTS, TOPK, AUX_LOSS_COEFF = 4, 2, 1e-2
MOE_LAYERS = (1, 0, 1, 1)  # layer 2 dense
TOLERANCE = 1e-5


@dataclass(frozen=True)
class MoETopology:
    name: str
    mode: str = "csbp"  # "reference" or "csbp"
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None  # expert tensor parallel size (None: TP)
    block_parallel: int = 1
    clean_shards: int = 1
    sequence_parallel: bool = False
    dispatcher: str = "alltoall"
    skip_expert_grad_reduction: bool = False  # negative control
    megatron_router: bool = False  # negative control: megatron-core's router, its aux-loss gradient / (TP x CP)
    seq: int = SEQ
    block: int = BLOCK
    transport: str = "collective"
    megatron_rope: bool = False


REFERENCE = MoETopology("reference", mode="reference")
WORLD_2 = [
    MoETopology("csbp2", block_parallel=2, clean_shards=2),
    MoETopology("ep2 x csbp2", ep=2, block_parallel=2, clean_shards=2),
    MoETopology("ep2 x csbp2, allgather dispatcher", ep=2, block_parallel=2, clean_shards=2, dispatcher="allgather"),
    MoETopology("control: csbp2, megatron-core's router", block_parallel=2, clean_shards=2, megatron_router=True),
]
WORLD_4 = [
    # Experts not split over TP (ETP1) with the alltoall dispatcher: with ETP2 it all-gathers uneven token counts
    # over TP, which gloo cannot (NCCL can); the allgather dispatcher splits the experts over TP (ETP2).
    MoETopology("ep2 x tp2 + sp x csbp2, etp1", tp=2, ep=2, etp=1, block_parallel=2, clean_shards=2,
                sequence_parallel=True),
    MoETopology("ep2 x tp2 + sp x csbp2, etp2, allgather", tp=2, ep=2, block_parallel=2, clean_shards=2,
                sequence_parallel=True, dispatcher="allgather"),
    MoETopology("moe + pp2 x csbp2 (1f1b)", pp=2, ep=2, block_parallel=2, clean_shards=2),
    MoETopology("dp2 x ep2 x csbp2", ep=2, block_parallel=2, clean_shards=2),
    MoETopology("ep4 x csbp2 x dp2", ep=4, block_parallel=2, clean_shards=2),
    # each expert on two ranks (expert-data-parallel group of 2), its gradient never summed over them
    MoETopology("control: dp2 x ep2 x csbp2, expert grads not reduced", ep=2, block_parallel=2, clean_shards=2,
                skip_expert_grad_reduction=True),
]


def _config(topology):
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
        tensor_model_parallel_size=topology.tp, pipeline_model_parallel_size=topology.pp,
        context_parallel_size=topology.block_parallel, sequence_parallel=topology.sequence_parallel,
        expert_model_parallel_size=topology.ep, expert_tensor_parallel_size=topology.etp or topology.tp,
        normalization="RMSNorm", use_cpu_initialization=True,
        calculate_per_token_loss=True, hidden_dropout=0.0, attention_dropout=0.0, pipeline_dtype=torch.float32,
        variable_seq_lengths=topology.pp > 1,
        # the MoE: layers 1, 3 and 4 (2 dense), a shared expert, softmax top-2 with the load-balancing loss
        num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=48, moe_layer_freq=list(MOE_LAYERS),
        moe_shared_expert_intermediate_size=40, moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=AUX_LOSS_COEFF, moe_token_dispatcher_type=topology.dispatcher,
        moe_router_dtype="fp32", add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu)


def _build_model(topology, config):
    """The MoE BDLM of `topology`: the model provider's, or (reference) the same layer specs with dense BD3-LM
    attention on one rank."""
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_csbp.core.layout import CSBPLayout, layout_for
    from megatron_csbp.mcore import parallel_state
    from megatron_csbp.mcore.model import BDLMGPTModel, model_provider
    from megatron_csbp.mcore.spec import get_csbp_block_spec

    stages = dict(pre_process=mpu.is_pipeline_first_stage(), post_process=mpu.is_pipeline_last_stage())
    common = dict(vocab_size=VOCAB, mask_token_id=MASK, share_embeddings_and_output_weights=True)
    if topology.mode == "reference":
        layout = CSBPLayout(topology.seq, topology.block, 1, 1, 0, schedule="contiguous", clean_layout="contiguous")
        block = get_csbp_block_spec(config)
        dense = ModuleSpec(module=composition.dense_bdlm_attention_class(), params={"layout": layout})
        for spec in block.layer_specs:
            spec.submodules.self_attention.submodules.core_attention = dense
        model = BDLMGPTModel(config=config, transformer_layer_spec=block, max_sequence_length=topology.seq,
                             position_embedding_type="rope", layout=layout, **stages, **common)
    else:
        layout = layout_for(topology.mode, topology.seq, topology.block, topology.block_parallel,
                            topology.clean_shards, rank=mpu.get_context_parallel_rank())
        model = model_provider(config=config, layout=layout, group=parallel_state.get_block_parallel_groups(),
                               transport=topology.transport, **stages, **common)
    if topology.megatron_router:
        from megatron.core.transformer.moe.router import TopKRouter

        for layer in model.decoder.layers:
            if hasattr(layer.mlp, "router"):
                layer.mlp.router.__class__ = TopKRouter
    return model, layout


def _global_name(model, name):
    """`megatron_step._global_name`, with each local expert numbered by its global expert index."""
    from megatron.core import parallel_state as mpu

    name = megatron_step._global_name(model, name)
    parts = name.split(".")
    if "local_experts" in parts:
        at = parts.index("local_experts") + 1
        local = EXPERTS // mpu.get_expert_model_parallel_world_size()
        parts[at] = str(mpu.get_expert_model_parallel_rank() * local + int(parts[at]))
    return ".".join(parts)


def _is_expert(param) -> bool:
    return not getattr(param, "allreduce", True)


def _tp_group(param):
    from megatron.core import parallel_state as mpu

    return mpu.get_expert_tensor_parallel_group() if _is_expert(param) else mpu.get_tensor_model_parallel_group()


def _full(param, tensor):
    """`tensor` (a TP shard of `param`'s shape) gathered over its TP group, strided shards (SwiGLU's fc1 holds
    `[gate_r ; up_r]`) put back in the full weight's order."""
    group = _tp_group(param)
    if not getattr(param, "tensor_model_parallel", False) or group.size() == 1:
        return tensor.detach().clone()
    shards = [torch.empty_like(tensor) for _ in range(group.size())]
    torch.distributed.all_gather(shards, tensor.detach().contiguous(), group=group)
    stride, dim = getattr(param, "partition_stride", 1), param.partition_dim
    pieces = [shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([pieces[rank][part] for part in range(stride) for rank in range(group.size())], dim=dim)


def _load(model, weights):
    """The full `weights` into this rank's shards (the inverse of `_full`)."""
    for name, param in model.named_parameters():
        full = weights[_global_name(model, name)]
        group = _tp_group(param)
        if getattr(param, "tensor_model_parallel", False) and group.size() > 1:
            stride, dim = getattr(param, "partition_stride", 1), param.partition_dim
            chunks = full.chunk(group.size() * stride, dim=dim)
            full = torch.cat(chunks[group.rank()::group.size()], dim=dim)
        param.data.copy_(full)


def _train_step(topology, weights):
    """One Megatron training step; returns loss, grad norm, aux loss, gathered grads and parameters after it."""
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.moe_utils import (clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker,
                                                         reduce_aux_losses_tracker_across_ranks)

    from megatron_csbp.bdlm.forward_step import BDLMForwardStep
    from megatron_csbp.bdlm.objective import BDLMObjective
    from megatron_csbp.mcore import parallel_state
    from megatron_csbp.mcore.model import pipeline_seq_length

    parallel_state.initialize_model_parallel(topology.tp, topology.pp, context_block_parallel_size=topology.block_parallel,
                                             clean_shards=topology.clean_shards,
                                             expert_model_parallel_size=topology.ep,
                                             expert_tensor_parallel_size=topology.etp or topology.tp)
    try:
        torch.manual_seed(1234)
        model_parallel_cuda_manual_seed(1234)
        config = _config(topology)
        model, layout = _build_model(topology, config)
        if weights is None:
            generator = torch.Generator().manual_seed(7)
            for _, param in sorted(model.named_parameters()):
                param.data.add_(0.05 * torch.randn(param.shape, generator=generator))
            initial = {name: param.detach().clone() for name, param in model.named_parameters()}
        else:
            _load(model, weights)
            initial = None
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
        if topology.skip_expert_grad_reduction:
            for bucket_group in ddp.expert_parallel_bucket_groups:
                bucket_group.start_grad_sync = lambda *args, **kwargs: None
                bucket_group.finish_grad_sync = lambda *args, **kwargs: None
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = ddp.no_sync
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.01, adam_eps=1e-4, clip_grad=1.0,
                            params_dtype=torch.float32), [ddp])
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        clear_aux_losses_tracker()
        batches = composition._batches(topology.seq, mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size())
        objective = BDLMObjective(block_size=topology.block, mask_token_id=MASK, seed=99)
        reports = get_forward_backward_func()(
            forward_step_func=BDLMForwardStep(objective, layout), data_iterator=iter(batches), model=[ddp],
            num_microbatches=len(batches), seq_length=SEQ if topology.pp > 1 else pipeline_seq_length(layout, config),
            micro_batch_size=MICRO_BATCH, forward_only=False)
        loss = None
        if mpu.is_pipeline_last_stage():
            total = torch.stack([r["lm loss"] for r in reports]).sum(0)
            torch.distributed.all_reduce(total, group=mpu.get_data_parallel_group(with_context_parallel=True))
            loss = (total[0] / total[1]).item()
        reduce_aux_losses_tracker_across_ranks()
        tracker = get_moe_layer_wise_logging_tracker()
        # what Megatron-LM logs as load_balancing_loss: the mean over MoE layers and this rank's micro-batches
        aux = float(tracker["load_balancing_loss"]["values"].sum()) / (sum(MOE_LAYERS) * len(batches))
        grads = {_global_name(model, n): _full(p, p.main_grad) for n, p in model.named_parameters()}
        success, grad_norm, _ = optimizer.step()
        assert success
        after = {_global_name(model, n): _full(p, p) for n, p in model.named_parameters()}
        return dict(loss=loss, grads=grads, after=after, initial=initial, grad_norm=grad_norm, aux=aux)
    finally:
        parallel_state.destroy_model_parallel()


@on_cpu_backend
def _run(rank, world_size, topologies, weights):
    if weights is not None:
        weights = {name: torch.from_numpy(array) for name, array in weights.items()}
    results = []
    for topology in topologies:
        result = _train_step(topology, weights)
        results.append(megatron_step._as_numpy(result))
    return results


def _worst_error(per_rank, reference):
    losses = [r["loss"] for r in per_rank if r["loss"] is not None]
    assert losses, "no rank reported a loss"
    worst = max(abs(loss - reference["loss"]) / abs(reference["loss"]) for loss in losses)
    worst = max([worst] + [abs(r["grad_norm"] - reference["grad_norm"]) / reference["grad_norm"] for r in per_rank])
    # the load-balancing loss Megatron logs (reduced over TP x CP, averaged over DP)
    worst = max([worst] + [abs(r["aux"] - reference["aux"]) / reference["aux"] for r in per_rank])
    for field in ("grads", "after"):
        seen = set()
        for result in per_rank:
            for name, tensor in result[field].items():
                worst = max(worst, megatron_step._relative(tensor, reference[field][name]))
                seen.add(name)
        assert seen == set(reference[field]), f"{field}: missing {set(reference[field]) - seen}"
    return worst


@pytest.fixture(scope="module")
def reference():
    return run_ranks(_run, 1, [REFERENCE], None, timeout=300)[0][0]


def _check_world(world_size, topologies, reference, timeout):
    results = run_ranks(_run, world_size, topologies, reference["initial"], timeout=timeout)
    for index, topology in enumerate(topologies):
        per_rank = [results[rank][index] for rank in range(world_size)]
        error = _worst_error(per_rank, reference)
        print(f"{topology.name}: worst relative error {error:.2e} (loss {per_rank[-1]['loss']}, "
              f"grad norm {per_rank[-1]['grad_norm']}, aux {per_rank[-1]['aux']}; reference {reference['loss']}, "
              f"{reference['grad_norm']}, {reference['aux']})")
        if topology.skip_expert_grad_reduction or topology.megatron_router:
            assert error > 1e-3, f"{topology.name} should not match the reference (error {error:.2e})"
        else:
            assert error <= TOLERANCE, f"{topology.name}: relative error {error:.2e}"


def test_world_2_moe_compositions_and_negative_control(reference):
    from megatron_csbp.bdlm import flops

    assert reference["aux"] > 0
    # the model's parameters, as the checkpoint-size estimate counts them (flops.parameter_count)
    moe = flops.MoEShape(EXPERTS, TOPK, ffn_hidden_size=48, num_moe_layers=sum(MOE_LAYERS),
                         shared_expert_ffn_hidden_size=40)
    assert sum(array.size for array in reference["initial"].values()) == flops.parameter_count(
        num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, padded_vocab_size=VOCAB,
        ffn_hidden_size=64, swiglu=True, add_bias_linear=False, layernorm_bias=False, moe=moe)
    _check_world(2, WORLD_2, reference, timeout=600)


def test_world_4_moe_compositions(reference):
    _check_world(4, WORLD_4, reference, timeout=900)


# --- the training script: both loops, as users run them ---------------------------------------------------------

MOE_FLAGS = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, moe_aux_loss_coeff=0.01,
                 moe_token_dispatcher_type="alltoall", moe_shared_expert_intermediate_size=32,
                 moe_layer_freq="[0,1]")
AUX_LINE = re.compile(r"iteration\s+(\d+)/.*?lm loss:\s*(\S+) \| load_balancing_loss:\s*(\S+) \|.*?grad norm:\s*(\S+) \|")


def _logged(run) -> dict:
    """{iteration: (lm loss, load_balancing_loss, grad norm)} as printed."""
    return {int(m.group(1)): m.groups()[1:] for m in AUX_LINE.finditer(run.output)}


def test_the_training_script_logs_the_same_numbers_on_every_moe_layout(corpus):
    """Our loop from the command line, the tiny MoE model (an MoE layer after a dense one, a shared expert, top-2 of
    4, load-balancing loss on) trained from its initialisation: every printed lm loss, load_balancing_loss and grad
    norm of EP2 x CSBP2 and of DP2 x EP2 equal the one-rank run's, digit for digit (experts initialised alike on
    every EP layout: spec.LayoutInvariantSequentialMLP). (TP is left to the composition tests above, from one set of
    weights: the vocabulary padding, a multiple of 128 x TP, changes the initial draws on TP layouts, dense or not.)"""
    from pretrain_runs import run

    settings = dict(data_path=corpus, train_iters=3, eval_iters=0, **MOE_FLAGS)
    one = _logged(run(1, settings))
    assert sorted(one) == [1, 2, 3] and all(float(aux) > 0 for _, aux, _ in one.values()), one
    for nproc, parallel in ((2, dict(context_block_parallel=2, expert_model_parallel_size=2)),
                            (2, dict(expert_model_parallel_size=2))):
        assert _logged(run(nproc, {**settings, **parallel})) == one, parallel


def test_moe_checkpoints_resume_bit_exact_and_reshard_across_ep_sizes(corpus, tmp_path):
    """torch_dist checkpoints of an MoE run: EP2 x CSBP2 saved at iteration 2 and resumed prints iterations 3-4
    exactly as the uninterrupted run (and as one rank); the one-rank checkpoint's weights load into EP2 x CSBP2
    (experts resharded) and the next step's lm loss, load-balancing loss and grad norm are the one-rank run's; with
    its optimizer state too (EP1 -> EP2 x CSBP2, and EP2 x CSBP2 -> one rank) every later step is the one-rank
    run's, where fresh optimizer moments (weights only) are not."""
    from pretrain_runs import REPO, copy_checkpoint, environment, run

    settings = dict(data_path=corpus, train_iters=4, eval_iters=0, lr_warmup_iters=1, save_interval=2, **MOE_FLAGS)
    ep2 = dict(context_block_parallel=2, expert_model_parallel_size=2)
    one = _logged(run(1, {**settings, "save": tmp_path / "one"}))
    whole = _logged(run(2, {**settings, **ep2, "save": tmp_path / "ep2"}))
    assert whole == one and sorted(one) == [1, 2, 3, 4], (whole, one)
    resumed = _logged(run(2, {**settings, **ep2, "load": copy_checkpoint(tmp_path / "ep2", 2, tmp_path / "ep2@2")}))
    assert resumed == {i: one[i] for i in (3, 4)}, resumed
    from_one = copy_checkpoint(tmp_path / "one", 2, tmp_path / "one@2")
    weights_only = _logged(run(2, {**settings, **ep2, "load": from_one, "no_load_optim": True}))
    assert weights_only[3] == one[3] and weights_only[4] != one[4], (weights_only, one)  # fresh Adam moments differ
    resharded = _logged(run(2, {**settings, **ep2, "load": from_one}))  # weights and optimizer state, EP1 -> EP2
    assert resharded == {i: one[i] for i in (3, 4)}, (resharded, one)
    back = _logged(run(1, {**settings, "load": copy_checkpoint(tmp_path / "ep2", 2, tmp_path / "ep2@2b")}))
    assert back == {i: one[i] for i in (3, 4)}, (back, one)  # EP2 x CSBP2 -> one rank, optimizer state too
    # the evaluator loads either checkpoint of iteration 4 (EP1, EP2) on one rank, every expert there: one NELBO
    nelbo = set()
    for save in ("one", "ep2"):
        done = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "evaluate_bdlm.py"), "--load",
                               str(tmp_path / save), "--data-path", corpus, "--eval-sequences", "4",
                               "--noise-samples", "1"], cwd=REPO, env=environment(), capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        nelbo.update(re.findall(r"lm loss value \(NELBO per token\): (\S+)", done.stdout))
    assert len(nelbo) == 1, nelbo
