"""Activation recomputation with CSBP: megatron-core's full (uniform, block) and selective core-attention
recompute give the same Megatron step as no recompute, and the forward collective runs twice.

One whole Megatron step (DDP, `finalize_model_grads`, `get_forward_backward_func`) of the composition
test's model on 2 gloo ranks, CSBP P=C=2 and the CP baseline, from the same weights and batches. Loss and
every gradient must equal the no-recompute step to 1e-5 relative; the attention ops' byte counters must
read exactly 1.5x (all-gather + reduce-scatter -> all-gather twice + reduce-scatter), and 1.25x when
the block method recomputes 2 of the 4 layers (so the counter is not merely a constant 1.5x).
"""

import dataclasses

import torch

from pretrain_runs import base, run, significant
from spawn import on_cpu_backend, run_ranks
from megatron_step import SEQ, Topology, _as_numpy, _config, _full, _global_name, _relative
from test_megatron_composition import MICRO_BATCH, TOLERANCE, _batches, _build_model

pytest_plugins = ["pretrain_runs"]  # corpus, reference_runs

TOPOLOGIES = [Topology("csbp P=C=2", block_parallel=2, clean_shards=2),
              Topology("cp baseline 2", mode="cp", block_parallel=2, clean_shards=2)]
# (name, TransformerConfig fields, bytes vs no recompute); megatron-core's default recompute_modules is
# ["core_attn"]
VARIANTS = [
    ("none", {}, 1),
    ("full uniform", dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1), 1.5),
    ("full block", dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=4), 1.5),
    ("full block, 2 of 4 layers", dict(recompute_granularity="full", recompute_method="block",
                                       recompute_num_layers=2), 1.25),
    ("selective core_attn", dict(recompute_granularity="selective", recompute_modules=["core_attn"]), 1.5),
]


def _step(topology, fields, weights):
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_csbp.core import comm
    from megatron_csbp.mcore import parallel_state
    from megatron_csbp.bdlm.forward_step import BDLMForwardStep
    from megatron_csbp.bdlm.objective import BDLMObjective
    from megatron_csbp.mcore.model import pipeline_seq_length

    parallel_state.initialize_model_parallel(context_block_parallel_size=topology.block_parallel,
                                             clean_shards=topology.clean_shards)
    try:
        torch.manual_seed(1234)
        model_parallel_cuda_manual_seed(1234)
        config = dataclasses.replace(_config(topology), **fields)
        model, layout = _build_model(topology, config)
        if weights is None:
            weights = {name: param.detach().clone() for name, param in model.named_parameters()}
        for name, param in model.named_parameters():
            param.data.copy_(weights[name])
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = ddp.no_sync
        ddp.zero_grad_buffer()
        batches = _batches(topology.seq, mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size())
        objective = BDLMObjective(block_size=topology.block, mask_token_id=63, seed=99)
        with comm.count_bytes() as counter:
            reports = get_forward_backward_func()(
                forward_step_func=BDLMForwardStep(objective, layout), data_iterator=iter(batches), model=[ddp],
                num_microbatches=len(batches), seq_length=pipeline_seq_length(layout, config),
                micro_batch_size=MICRO_BATCH, forward_only=False)
        total = torch.stack([r["lm loss"] for r in reports]).sum(0)
        torch.distributed.all_reduce(total, group=mpu.get_data_parallel_group(with_context_parallel=True))
        grads = {_global_name(model, n): _full(p, p.main_grad) for n, p in model.named_parameters()}
        return dict(loss=(total[0] / total[1]).item(), grads=grads, bytes_sent=counter.bytes_sent), weights
    finally:
        parallel_state.destroy_model_parallel()


@on_cpu_backend
def _run(rank, world_size):
    results = {}
    for topology in TOPOLOGIES:
        weights = None
        for name, fields, _ in VARIANTS:
            result, weights = _step(topology, fields, weights)
            results[topology.name, name] = _as_numpy(result)
    return results


def test_recompute_equals_no_recompute_and_sends_the_forward_twice():
    per_rank = run_ranks(_run, 2, timeout=600)
    for topology in TOPOLOGIES:
        for rank, results in enumerate(per_rank):
            plain = results[topology.name, "none"]
            assert plain["bytes_sent"] > 0
            for name, _, factor in VARIANTS[1:]:
                result = results[topology.name, name]
                error = max([abs(result["loss"] - plain["loss"]) / abs(plain["loss"])]
                            + [_relative(result["grads"][p], plain["grads"][p]) for p in plain["grads"]])
                assert set(result["grads"]) == set(plain["grads"])
                assert error <= TOLERANCE, f"{topology.name}, {name}, rank {rank}: relative error {error:.2e}"
                assert 4 * result["bytes_sent"] == 4 * factor * plain["bytes_sent"], \
                    f"{topology.name}, {name}: {result['bytes_sent']} bytes vs {plain['bytes_sent']} without recompute"


def test_selective_recompute_passes_validation():
    """`--recompute-granularity selective` (no method, no layer count) validates and reaches the config as
    megatron-core's selective core-attention recompute."""
    from megatron_csbp.training import arguments, flags, megatron_config

    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", str(SEQ),
            "--bdlm-block-size", "4", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
            "--data-path", "unused", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64",
            "--recompute-granularity", "selective"]
    args = arguments.validate_args(flags.build_parser().parse_args(argv), 1, on_accelerator=False,
                                   check_paths=False)
    config = megatron_config.transformer_config_from_args(args)
    assert config.recompute_granularity == "selective" and config.recompute_modules == ["core_attn"]


def test_training_with_selective_recompute_on_a_simulated_link_logs_the_reference_losses(corpus, reference_runs):
    """scripts/pretrain_bdlm.py on 2 CSBP ranks with `--recompute-granularity selective --link-gbps 1`: the flags
    reach the run (recompute and the slow link change no number) and the losses are the 1-rank run's."""
    done = run(2, base(corpus, context_block_parallel=2, recompute_granularity="selective", link_gbps=1.0))
    expected = {i: significant(v) for i, v in reference_runs["1 rank"].losses.items()}
    assert expected and {i: significant(v) for i, v in done.losses.items()} == expected, done.output
