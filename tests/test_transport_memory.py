"""The streaming transport is bounded in memory: its forward folds each ring step into one running output, so
its peak stays at or below the collective transport's (which holds all `C` gathered shards), and far below
a forward that keeps every step's partial output (the negative control: the measurement sees the difference).

Peaks are exact tensor bytes from torch's profiler (`bench.peak_tensor_memory`), on 4 gloo ranks, C = 4.
"""

import torch

from spawn import run_ranks

SEQ, BLOCK, HEADS, KV_HEADS, HEAD_DIM, RANKS = 2048, 16, 4, 2, 16, 4


class _KeepingPartials:
    """CPU kernels whose prefix outputs are all kept alive, as a forward that merges only at the end holds them."""

    def __init__(self):
        from megatron_csbp.core.kernels import CPUKernels

        self.inner, self.kept = CPUKernels(), []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def prefix_forward(self, *args):
        part = self.inner.prefix_forward(*args)
        self.kept.append(part)
        return part


def _peaks(rank, world_size):
    import torch.distributed as dist

    from megatron_csbp.tools.bench.memory import peak_tensor_memory
    from megatron_csbp.core.kernels import CPUKernels
    from megatron_csbp.core.layout import CSBPLayout
    from megatron_csbp.core.ops import context_sharded_block_attention, ring_plan

    layout, device = CSBPLayout(SEQ, BLOCK, world_size, world_size, rank), torch.device("cpu")
    generator = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(layout.num_rows, 1, heads, HEAD_DIM, generator=generator).requires_grad_()
               for heads in (HEADS, KV_HEADS, KV_HEADS))
    keeping, kernels = _KeepingPartials(), CPUKernels()
    runs = {"collective": ("collective", ring_plan(layout, device, kernels)),
            "streaming": ("streaming", ring_plan(layout, device, kernels)),
            "streaming, partials kept": ("streaming", ring_plan(layout, device, keeping))}
    peaks, outputs = {}, {}
    for name, (transport, plan) in runs.items():
        for _ in range(2):  # the first call warms up the plans' masks; the second is measured
            keeping.kept.clear()
            dist.barrier()
            with peak_tensor_memory(device) as forward:
                out = context_sharded_block_attention(q, k, v, layout, dist.group.WORLD, transport=transport,
                                                      plan=plan)
            dist.barrier()
            with peak_tensor_memory(device) as backward:
                out.backward(torch.ones_like(out))
            outputs[name] = out.detach()
            del out
            q.grad = k.grad = v.grad = None
        peaks[name] = (forward.bytes, backward.bytes)
    same = max((outputs[name] - outputs["collective"]).abs().max().item() for name in outputs)
    return peaks, same, layout.num_rows * HEADS * HEAD_DIM * 4


def test_streaming_forward_holds_one_running_output():
    per_rank = run_ranks(_peaks, RANKS, timeout=600)
    out_bytes = per_rank[0][2]
    for rank, (peaks, same, _) in enumerate(per_rank):
        assert same < 1e-5, f"rank {rank}: the transports disagree by {same}"
        (collective_fwd, collective_bwd), (streaming_fwd, streaming_bwd) = peaks["collective"], peaks["streaming"]
        kept_fwd, _ = peaks["streaming, partials kept"]
        assert streaming_fwd <= collective_fwd and streaming_bwd <= collective_bwd, (rank, peaks)
        # keeping every step's partial (C outputs by the last step, where the running merge holds one) must show
        # at the peak (measured: 1.1-1.6 outputs more; the peak may fall on a step where fewer are kept)
        assert kept_fwd - streaming_fwd >= out_bytes // 2, (rank, peaks, out_bytes)
