"""--overlap-grad-reduce and --overlap-param-gather: megatron-core's DDP overlapping the gradient reduction with the
backward and the parameter gather with the next forward, wired as our loop wires them (`loop.data_parallel`).

Two Megatron training steps of the composition test's model on 2 gloo ranks (DP2, and CSBP P=C=2, whose
gradients are reduced over the block-parallel ranks) with the reduction overlapped (several buckets) equal the steps
without: loss, every gradient and every parameter after the optimizer step (<= 1e-5 relative), and in the second
step (the first records which gradients each bucket waits for) the buckets' reductions start during the backward,
which without the flag they never do. The distributed optimizer with both overlaps gives
the plain step's loss, grad norm and updated parameters too (megatron-core's, on gloo; our loop takes
--use-distributed-optimizer, and so --overlap-param-gather, on a GPU only). End to end, scripts/pretrain_bdlm.py
at DP2 with --overlap-grad-reduce logs the losses of the run without it.
"""

import dataclasses

import pytest

from megatron_step import Topology, run_steps, train_step, worst_error
from pretrain_runs import base, run, significant
from spawn import run_ranks
from test_megatron_composition import MICRO_BATCH, TOLERANCE, _batches, _build_model

pytest_plugins = ["pretrain_runs"]  # corpus
BUCKET = 4000  # parameters per bucket: the model's ~70K make several


@dataclasses.dataclass(frozen=True)
class Case:
    topology: Topology
    overlap_grad_reduce: bool = False
    distributed_optimizer: bool = False
    overlap_param_gather: bool = False


def _step(case, weights):
    from megatron_csbp.bdlm.forward_step import BDLMForwardStep
    from megatron_csbp.bdlm.objective import BDLMObjective

    seen = dict(during_backward=0, starts=0, bucket_groups=0)

    def watch_reductions(ddp):
        """Counts each bucket's reduction start, and those outside the schedule's finalize_model_grads (during the
        backward)."""
        finalize, finalizing = ddp.config.finalize_model_grads_func, []

        def finalize_model_grads(*args, **kwargs):
            finalizing.append(True)
            try:
                return finalize(*args, **kwargs)
            finally:
                finalizing.pop()

        ddp.config.finalize_model_grads_func = finalize_model_grads
        for group in ddp.bucket_groups:
            start = group.start_grad_sync

            def counted(*args, start=start, **kwargs):
                seen["starts"] += 1
                seen["during_backward"] += not finalizing
                return start(*args, **kwargs)
            group.start_grad_sync = counted
        seen["bucket_groups"] = len(ddp.bucket_groups)

    objective = BDLMObjective(block_size=case.topology.block, mask_token_id=63, seed=99)
    options = dict(overlap_grad_reduce=case.overlap_grad_reduce, use_distributed_optimizer=case.distributed_optimizer,
                   overlap_param_gather=case.overlap_param_gather, bucket_size=BUCKET)
    return train_step(case.topology, weights, _build_model, lambda layout: BDLMForwardStep(objective, layout),
                      lambda dp_rank, dp_size: _batches(case.topology.seq, dp_rank, dp_size), MICRO_BATCH,
                      before_step=watch_reductions, after_step=lambda micro_batches: dict(reductions=dict(seen)),
                      ddp_options=options, iterations=2)


def _relative(a, b):
    return abs(a - b) / abs(b)


def test_overlapped_reductions_and_gathers_give_the_plain_step():
    import torch

    topologies = [Topology("dp2"), Topology("csbp P=C=2", block_parallel=2, clean_shards=2)]
    cases = [Case(topology, *flags) for topology in topologies
             for flags in ((), (True,), (False, True), (True, True, True))]
    (first,) = run_ranks(run_steps, 1, _step, [Case(Topology("reference"))], None, timeout=300)[0]
    per_rank = run_ranks(run_steps, 2, _step, cases, first["initial"], timeout=900)
    for index, case in enumerate(cases):
        results = [per_rank[rank][index] for rank in range(2)]
        plain = per_rank[0][cases.index(Case(case.topology))]
        reductions = results[0]["reductions"]
        label = (f"{case.topology.name}, overlap_grad_reduce={case.overlap_grad_reduce}, distributed optimizer="
                 f"{case.distributed_optimizer}, overlap_param_gather={case.overlap_param_gather}")
        if case.distributed_optimizer:  # each rank holds its shard of the reduced gradients: loss, norm, parameters
            error = max([_relative(r["loss"], plain["loss"]) for r in results]
                        + [_relative(r["grad_norm"], plain["grad_norm"]) for r in results]
                        + [float((torch.as_tensor(r["after"][name]).double() - torch.as_tensor(value).double()).norm()
                                 / torch.as_tensor(value).double().norm())
                           for r in results for name, value in plain["after"].items()])
        else:
            error = worst_error(results, plain)
        print(f"{label}: worst relative error {error:.2e}; {reductions['during_backward']} of "
              f"{reductions['starts']} bucket reductions started during the backward ({reductions['bucket_groups']} "
              f"buckets)")
        assert error <= TOLERANCE, f"{label}: {error:.2e}"
        assert reductions["bucket_groups"] > (1 if case.overlap_grad_reduce else 0)
        assert (reductions["during_backward"] > 0) == case.overlap_grad_reduce, (label, reductions)
    # the same steps as one rank's (the data-parallel replicas split its micro-batches)
    assert worst_error([per_rank[rank][0] for rank in range(2)], first) <= TOLERANCE


def test_a_dp2_run_with_overlapped_reductions_logs_the_losses_without(corpus):
    """scripts/pretrain_bdlm.py on 2 data-parallel ranks: --overlap-grad-reduce changes no logged number."""
    settings = base(corpus, train_iters=4, eval_interval=4, eval_iters=1)
    plain, overlapped = run(2, settings), run(2, {**settings, "overlap_grad_reduce": True})
    expected = {i: significant(v) for i, v in plain.losses.items()}
    assert sorted(expected) == [1, 2, 3, 4], plain.output[-3000:]
    assert {i: significant(v) for i, v in overlapped.losses.items()} == expected, overlapped.output[-3000:]
    assert overlapped.validation == plain.validation


@pytest.mark.parametrize("extra, line", [
    (["--overlap-param-gather"], "--overlap-param-gather gathers the distributed optimizer's updated shards bucket by "
                                 "bucket: it needs --use-distributed-optimizer and --overlap-grad-reduce"),
    (["--overlap-param-gather", "--overlap-grad-reduce", "--use-distributed-optimizer"],
     "--use-distributed-optimizer needs a GPU"),
])
def test_overlapped_gathers_are_refused_on_cpu_with_the_reason(extra, line):
    from megatron_csbp.core.rules import ConfigError
    from megatron_csbp.training.arguments import validate_args
    from megatron_csbp.training.flags import build_parser

    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--micro-batch-size", "1", "--train-iters", "4", "--lr", "1e-3", "--data-path", "unused", *extra]
    with pytest.raises(ConfigError) as refused:
        validate_args(build_parser().parse_args(argv), 2, on_accelerator=False, check_paths=False)
    assert str(refused.value).startswith(line) and "\n" not in str(refused.value), refused.value
    on_a_gpu = validate_args(build_parser().parse_args(argv[:-len(extra)] + [
        "--overlap-param-gather", "--overlap-grad-reduce", "--use-distributed-optimizer"]), 2, on_accelerator=True,
        check_paths=False)
    assert on_a_gpu.overlap_param_gather and on_a_gpu.overlap_grad_reduce
