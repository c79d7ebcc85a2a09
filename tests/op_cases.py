"""The attention op case by case on the ranks of one spawn, against the dense fp64 reference: the loop
test_attention and test_documents share. Each rank runs the op's forward and backward on its rows of a case's
random `2L` rows; `compare` puts the ranks' rows back together (summing the clean replicas' gradients) and
measures them against `attention_reference.dense_attention` under the case's mask."""

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from attention_reference import dense_attention, global_rows, relative_error


@dataclass(frozen=True)
class OpCase:
    name: str
    mode: str  # a --bdlm-parallel-mode: csbp | cp | cp-traffic | bp
    seq_length: int
    block_size: int
    clean_shards: int
    transport: str = "collective"
    heads: int = 4
    kv_heads: int = 2
    batch: int = 2
    head_dim: int = 8
    options: dict = field(default_factory=dict, hash=False)  # the layout's (schedule, clean layout)
    broken: str = ""  # a deliberate fault (the test's own): the comparison must then fail

    def layout(self, world_size, rank):
        from megatron_csbp.core.layout import layout_for

        return layout_for(self.mode, self.seq_length, self.block_size, world_size, self.clean_shards, rank,
                          **self.options)


def inputs(case, seed=0):
    """Query, key, value and the output's weight (the upstream gradient) of all `2L` rows: `[2L, b, heads, d]`."""
    gen = torch.Generator().manual_seed(seed)
    rows = 2 * case.seq_length
    shapes = [(rows, case.batch, case.heads, case.head_dim), (rows, case.batch, case.kv_heads, case.head_dim),
              (rows, case.batch, case.kv_heads, case.head_dim), (rows, case.batch, case.heads * case.head_dim)]
    return [torch.randn(shape, generator=gen) for shape in shapes]


def run_cases(rank, world_size, cases, kernels, attend, around=lambda case: contextlib.nullcontext()):
    """On one rank: `attend(case, layout, group, query, key, value)` (the op's call, returning its output) on this
    rank's rows of each case, and the backward of the weighted output, both within `around(case)` and the byte
    counter. `kernels`: the CPU kernels the op runs (their tiles). Returns, by case name, (global rows, output,
    dQ, dK, dV, bytes sent)."""
    from megatron_csbp.core import comm
    from megatron_csbp.core import kernels as kernel_families
    from megatron_csbp.core.process_groups import new_block_parallel_groups

    kernel_families._kernels["cpu"] = kernels
    groups, results = {}, {}
    for case in cases:
        layout = case.layout(world_size, rank)
        if case.clean_shards not in groups and world_size > 1:
            groups[case.clean_shards] = new_block_parallel_groups([list(range(world_size))], case.clean_shards,
                                                                  dist.group.WORLD)
        rows = global_rows(layout)
        query, key, value, weight = (t[rows] for t in inputs(case))
        query, key, value = (t.clone().requires_grad_() for t in (query, key, value))
        # Each of the num_rings replicas of a clean row carries an equal share of its upstream gradient,
        # as the model's loss would split it; their sum is the reference's.
        weight[layout.num_noisy_rows:] /= layout.num_rings
        with around(case), comm.count_bytes() as counter:
            out = attend(case, layout, groups.get(case.clean_shards), query, key, value)
            (out * weight).sum().backward()
        results[case.name] = (rows, out.detach(), query.grad, key.grad, value.grad, counter.bytes_sent)
    return results


def run_single(cases, kernels, attend, around=lambda case: contextlib.nullcontext()):
    """`run_cases` in this process as the only rank, the CPU kernels restored afterwards."""
    from megatron_csbp.core import kernels as kernel_families

    saved = kernel_families._kernels.pop("cpu", None)
    try:
        return run_cases(0, 1, cases, kernels, attend, around)
    finally:
        kernel_families._kernels.pop("cpu", None)
        if saved is not None:
            kernel_families._kernels["cpu"] = saved


def compare(case, per_rank, mask=None):
    """Relative errors of the output and the Q/K/V gradients of the ranks' rows, put together, against the dense
    reference under `mask` (`[2L, 2L]` bool; default: the BDLM mask)."""
    query, key, value, weight = inputs(case)
    reference_inputs = [t.double().requires_grad_() for t in (query, key, value)]
    reference = dense_attention(*reference_inputs, case.seq_length, case.block_size, mask=mask)
    (reference * weight.double()).sum().backward()
    out = torch.zeros_like(reference)
    grads = [torch.zeros_like(t, dtype=torch.float64) for t in reference_inputs]
    for rows, rank_out, *rank_grads, _ in (result[case.name] for result in per_rank):
        out[rows] = rank_out.double()
        for total, grad in zip(grads, rank_grads):
            total.index_add_(0, rows, grad.double())  # clean replicas each hold part of a clean token's grad
    errors = {"out": relative_error(out, reference)}
    errors.update({name: relative_error(g, t.grad) for name, g, t in zip("qkv", grads, reference_inputs)})
    return errors
