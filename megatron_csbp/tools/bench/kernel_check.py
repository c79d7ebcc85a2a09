"""`--kernel-check`: the CPU attention kernel on the BDLM mask against a dense matmul, and every rank's kernels of
the modes with a ring on that rank's own rows and plan, in one process, paired (does one layout's plan cost more
per pair than another's?)."""

import dataclasses
import math
import os
import sys
import time

import torch

from megatron_csbp.core import modes, rules
from megatron_csbp.tools.bench.mode_run import rank_attention_pairs
from megatron_csbp.tools.bench.records import record_of


@dataclasses.dataclass(frozen=True)
class KernelEfficiency:
    """GFLOP/s of the CPU kernel on the full BDLM mask and of a dense fp32 matmul, on one thread."""

    seq_length: int
    block_size: int
    threads: int
    load_average: float
    matmul_gflops: float
    attention_forward_gflops: float
    attention_train_gflops: float
    prefix_forward_gflops: float
    forward_fraction: float
    train_fraction: float
    prefix_forward_fraction: float

    def record(self) -> dict:
        return dict(mode="kernel", nproc=1, **record_of(self))


@dataclasses.dataclass(frozen=True)
class KernelPlanTiming:
    """One rank's kernels of one mode, timed on its own rows and plan (best of the repeats)."""

    mode: modes.ParallelMode
    rank: int
    seq_length: int
    rows: int
    row_groups: int
    real_pairs: int  # per head
    padded_pairs: int  # computed, per head
    forward_s: float
    backward_s: float  # the remote part's
    gflops: float  # on the real pairs

    def record(self) -> dict:
        return dict(record_of(self), mode=f"kernel-{self.mode.name}")


def kernel_efficiency(seq_length, block_size, heads=8, head_dim=64, repeats=3) -> KernelEfficiency:
    """GFLOP/s of the CPU kernel on the full BDLM mask (real pairs only, model FLOPs: `rules.step_passes`) and of
    a dense fp32 matmul, on ONE thread, as this thread's CPU time (`time.thread_time`: other processes' load
    on a shared machine does not enter it as it would a wall clock), each the best of `repeats` rounds that
    alternate matmul, forward and backward (a burst cannot favour one). `prefix_forward_fraction`: the clean-
    prefix kernel alone (`CPUKernels.prefix_forward` on the op's plan), the op's bulk."""
    from megatron_csbp.bdlm import flops
    from megatron_csbp.core import ops
    from megatron_csbp.core.kernels import CPUKernels
    from megatron_csbp.core.layout import CSBPLayout
    from megatron_csbp.core.ops import context_sharded_block_attention

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    size = 2048
    a, b = torch.randn(size, size), torch.randn(size, size)
    layout = CSBPLayout(seq_length, block_size, 1, 1)
    rows = layout.num_rows
    q = torch.randn(rows, 1, heads, head_dim, requires_grad=True)
    k = torch.randn(rows, 1, heads // 2, head_dim, requires_grad=True)
    v = torch.randn(rows, 1, heads // 2, head_dim, requires_grad=True)
    kernels = CPUKernels()
    plan = ops.ring_plan(layout, torch.device("cpu"), kernels).gathered
    pq = torch.randn(1, heads // 2, 2, rows, head_dim)
    pk, pv = (torch.randn(1, heads // 2, seq_length, head_dim) for _ in range(2))

    def timed(function):
        start = time.thread_time()
        result = function()
        return time.thread_time() - start, result

    matmul_s = forward_s = backward_s = prefix_s = math.inf
    context_sharded_block_attention(q, k, v, layout).sum().backward()  # warm-up: plans, caches, allocator
    kernels.prefix_forward(pq, pk, pv, plan, 0.125)
    for _ in range(repeats):
        matmul_s = min(matmul_s, timed(lambda: a @ b)[0])
        seconds, out = timed(lambda: context_sharded_block_attention(q, k, v, layout))
        forward_s = min(forward_s, seconds)
        backward_s = min(backward_s, timed(lambda: out.sum().backward())[0])
        prefix_s = min(prefix_s, timed(lambda: kernels.prefix_forward(pq, pk, pv, plan, 0.125))[0])
    torch.set_num_threads(threads)
    matmul = 2 * size ** 3 / matmul_s / 1e9
    parts = flops.bdlm_attention_pair_parts(seq_length, block_size)
    per_pair = flops.attention_flops_per_pair(heads, head_dim)
    forward_flops = sum(parts.values()) * per_pair
    forward = forward_flops / forward_s / 1e9
    both = rules.step_passes() * forward_flops / (forward_s + backward_s) / 1e9
    prefix = (parts["noisy_clean"] + parts["clean_clean"]) * per_pair / prefix_s / 1e9
    return KernelEfficiency(seq_length, block_size, threads=1, load_average=os.getloadavg()[0], matmul_gflops=matmul,
                            attention_forward_gflops=forward, attention_train_gflops=both,
                            prefix_forward_gflops=prefix, forward_fraction=forward / matmul,
                            train_fraction=both / matmul, prefix_forward_fraction=prefix / matmul)


def print_efficiency(e: KernelEfficiency, out=None):
    print(f"CPU kernel at L={e.seq_length} (1 thread, thread CPU time, load average {e.load_average:.1f}): forward "
          f"{e.attention_forward_gflops:.1f} GFLOP/s = {e.forward_fraction:.0%} of dense matmul "
          f"{e.matmul_gflops:.1f} GFLOP/s (the prefix kernel alone {e.prefix_forward_fraction:.0%}); forward+backward "
          f"{e.attention_train_gflops:.1f} GFLOP/s = {e.train_fraction:.0%}", file=out or sys.stdout)


def kernel_plans_check(runs, heads=4, groups=2, head_dim=32, repeats=3) -> list[KernelPlanTiming]:
    """The attention kernels of every rank of every run (`RunConfig`s, `cli.kernel_check_runs`) on that
    rank's own rows and plan, timed in ONE process, modes alternating in each repeat (paired, best of
    `repeats`), so a load burst cannot favour one mode.

    It answers whether a layout's plan costs more per pair than another's: CSBP and CP compute the same real
    pairs per rank but cut them into different row groups (kernel calls of other shapes)."""
    from megatron_csbp.bdlm import flops
    from megatron_csbp.core import ops
    from megatron_csbp.core.kernels import CPUKernels

    kernels, device, threads = CPUKernels(), torch.device("cpu"), torch.get_num_threads()
    torch.set_num_threads(1)  # as each bench rank computes
    cases = []
    for run in runs:
        for rank in range(run.block_parallel_size):
            layout = run.layout(rank)
            ring = ops.ring_plan(layout, device, kernels)
            plan, noisy = ring.gathered, layout.num_noisy_rows if ring.block_diagonal else 0
            q = torch.randn(1, groups, heads // groups, layout.num_rows, head_dim)
            k, v = (torch.randn(1, groups, ring.num_keys, head_dim) for _ in range(2))
            out, lse = ring.remote_forward(q, k, v, plan, 0.1)
            cases.append(dict(mode=run.mode, rank=rank, layout=layout, ring=ring, plan=plan, q=q, k=k, v=v, out=out,
                              lse=lse, dout=torch.randn_like(out), noisy_k=k[:, :, :noisy], noisy_v=v[:, :, :noisy],
                              forward_s=math.inf, backward_s=math.inf))

    def forward(c):
        c["ring"].remote_forward(c["q"], c["k"], c["v"], c["plan"], 0.1)
        if c["noisy_k"].shape[2]:
            kernels.block_diagonal_forward(c["q"][..., :c["noisy_k"].shape[2], :], c["noisy_k"], c["noisy_v"],
                                           c["layout"].block_size, 0.1)

    def backward(c):
        c["ring"].remote_backward(c["dout"], c["q"], c["k"], c["v"], c["out"], c["lse"], c["plan"], 0.1)

    for _ in range(repeats):
        for c in cases:
            for key, function in (("forward_s", forward), ("backward_s", backward)):
                start = time.perf_counter()
                function(c)
                c[key] = min(c[key], time.perf_counter() - start)
    torch.set_num_threads(threads)
    results = []
    for c in cases:
        real = rank_attention_pairs(c["layout"])
        seconds = c["forward_s"] + c["backward_s"]
        computed = sum(call.computed_pairs * call.calls for call in c["ring"].kernel_calls())
        results.append(KernelPlanTiming(
            c["mode"], c["rank"], c["layout"].seq_length, c["layout"].num_rows, len(c["plan"].groups), real, computed,
            c["forward_s"], c["backward_s"],
            rules.step_passes() * real * flops.attention_flops_per_pair(heads, head_dim) / seconds / 1e9))
    return results


def print_kernel_plans(results, out=None):
    baseline = {r.rank: r for r in results if r.mode.is_baseline}
    print("| mode | L | rank | rows | row groups | real pairs/head | computed pairs/head | forward (s) "
          "| backward: remote part (s) | GFLOP/s (real pairs) | time vs CP's same rank |", file=out)
    print("|---|---|---|---|---|---|---|---|---|---|---|", file=out)
    for r in results:
        cp = baseline[r.rank]
        versus = (r.forward_s + r.backward_s) / (cp.forward_s + cp.backward_s)
        print(f"| {r.mode.name} | {r.seq_length} | {r.rank} | {r.rows} | {r.row_groups} | {r.real_pairs:,} "
              f"| {r.padded_pairs:,} | {r.forward_s:.3f} | {r.backward_s:.3f} | {r.gflops:.1f} | {versus:.2f} |",
              file=out)
