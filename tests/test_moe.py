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

import megatron_step
import test_megatron_composition as composition
from spawn import run_ranks

pytest_plugins = ["pretrain_runs"]  # the corpus fixture
SEQ, BLOCK, VOCAB, MASK = megatron_step.SEQ, megatron_step.BLOCK, megatron_step.VOCAB, megatron_step.MASK
MICRO_BATCH, NUM_MICRO = composition.MICRO_BATCH, composition.NUM_MICRO
EXPERTS, TOPK, AUX_LOSS_COEFF = 4, 2, 1e-2
MOE_LAYERS = (1, 0, 1, 1)  # layer 2 dense
TOLERANCE = 1e-5


@dataclass(frozen=True)
class MoETopology(megatron_step.Topology):
    dispatcher: str = "alltoall"
    skip_expert_grad_reduction: bool = False  # negative control
    megatron_router: bool = False  # negative control: megatron-core's router, its aux-loss gradient / (TP x CP)


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
    """`megatron_step._config` with the MoE: layers 1, 3 and 4 (2 dense), SwiGLU experts and a shared expert,
    softmax top-2 with the load-balancing loss."""
    import torch.nn.functional as F

    return megatron_step._config(
        topology, num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=48,
        moe_layer_freq=list(MOE_LAYERS), moe_shared_expert_intermediate_size=40,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=AUX_LOSS_COEFF,
        moe_token_dispatcher_type=topology.dispatcher, moe_router_dtype="fp32", add_bias_linear=False,
        gated_linear_unit=True, activation_func=F.silu)


def _build_model(topology, config):
    """`test_megatron_composition._build_model`, with megatron-core's own router where the control asks for it."""
    model, layout = composition._build_model(topology, config)
    if topology.megatron_router:
        from megatron.core.transformer.moe.router import TopKRouter

        for layer in model.decoder.layers:
            if hasattr(layer.mlp, "router"):
                layer.mlp.router.__class__ = TopKRouter
    return model, layout


def _train_step(topology, weights):
    """One Megatron training step (`megatron_step.train_step`) with the load-balancing loss Megatron-LM logs."""
    from megatron.core.transformer.moe.moe_utils import (clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker,
                                                         reduce_aux_losses_tracker_across_ranks)

    from megatron_csbp.bdlm.forward_step import BDLMForwardStep
    from megatron_csbp.bdlm.objective import BDLMObjective

    def before_step(ddp):
        if topology.skip_expert_grad_reduction:
            for bucket_group in ddp.expert_parallel_bucket_groups:
                bucket_group.start_grad_sync = lambda *args, **kwargs: None
                bucket_group.finish_grad_sync = lambda *args, **kwargs: None
        clear_aux_losses_tracker()

    def load_balancing_loss(num_microbatches):
        reduce_aux_losses_tracker_across_ranks()
        tracker = get_moe_layer_wise_logging_tracker()
        # what Megatron-LM logs as load_balancing_loss: the mean over MoE layers and this rank's micro-batches
        return dict(aux=float(tracker["load_balancing_loss"]["values"].sum()) / (sum(MOE_LAYERS) * num_microbatches))

    objective = BDLMObjective(block_size=topology.block, mask_token_id=MASK, seed=99)
    return megatron_step.train_step(topology, weights, _build_model, lambda layout: BDLMForwardStep(objective, layout),
                                    lambda dp_rank, dp_size: composition._batches(topology.seq, dp_rank, dp_size),
                                    MICRO_BATCH, make_config=_config, before_step=before_step,
                                    after_step=load_balancing_loss)


@pytest.fixture(scope="module")
def reference():
    return run_ranks(megatron_step.run_steps, 1, _train_step, [REFERENCE], None, timeout=300)[0][0]


def _check_world(world_size, topologies, reference, timeout):
    results = run_ranks(megatron_step.run_steps, world_size, _train_step, topologies, reference["initial"],
                        timeout=timeout)
    for index, topology in enumerate(topologies):
        per_rank = [results[rank][index] for rank in range(world_size)]
        # the grad norm, and the load-balancing loss Megatron logs (reduced over TP x CP, averaged over DP)
        error = megatron_step.worst_error(per_rank, reference, scalars=("grad_norm", "aux"))
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
    assert sum(array.size for array in reference["initial"].values()) == flops.parameter_count(flops.ModelShape(
        num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64, swiglu=True,
        add_bias_linear=False, layernorm_bias=False, moe=moe), VOCAB)
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
