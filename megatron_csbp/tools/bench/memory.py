"""How the bench measures memory: the bytes autograd saves for backward, a run's peak memory, the exact peak
tensor bytes of a block of code, each transport's peaks (`--transport-memory`) and a step's peak with the LM
head's logits whole and tiled (`--logits-memory`)."""

import contextlib
import dataclasses
import resource

import torch

from megatron_csbp.core import transports
from megatron_csbp.tools.bench.records import LogitsMemory, TransportMemory, TransportPeaks


def saved_bytes_hooks(store):
    """`with saved_bytes_hooks(store): ...` adds to `store[0]` the bytes of every storage autograd saves for backward
    inside the block (each storage once)."""
    seen = set()

    def pack(tensor):
        key = (tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            store[0] += key[1]
        return tensor

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)


def peak_memory(device, baseline_rss) -> int:
    """The allocator's peak on an accelerator; on the CPU the growth of the process's peak RSS over `baseline_rss`."""
    if device.type != "cpu":
        return torch.get_device_module(device).max_memory_allocated(device)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return max(peak_rss - baseline_rss, 0)


@dataclasses.dataclass
class PeakBytes:
    bytes: int = 0


@contextlib.contextmanager
def peak_tensor_memory(device):
    """`with peak_tensor_memory(device) as peak: ...`, then `peak.bytes`: the most bytes of tensors alive at
    once inside the block beyond those alive when it began (frees of older tensors count). On an accelerator
    the allocator's peak; on the CPU the allocations and frees torch's profiler records, in order: exact
    tensor bytes, unlike the process's RSS, which the allocator's caching and the model's setup blur."""
    peak = PeakBytes()
    if device.type != "cpu":
        module = torch.get_device_module(device)
        module.synchronize(device)
        module.reset_peak_memory_stats(device)
        start = module.memory_allocated(device)
        yield peak
        module.synchronize(device)
        peak.bytes = module.max_memory_allocated(device) - start
        return
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        yield peak
    allocations, pending = [], list(profiler.profiler.kineto_results.experimental_event_tree())
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        if event.tag == _EventType.Allocation:
            allocations.append((event.start_time_ns, event.extra_fields.alloc_size))
    alive = 0
    for _, size in sorted(allocations):
        alive += size
        peak.bytes = max(peak.bytes, alive)


def transport_memory(build_model, forward_step, batch, layout, group, config, micro_batch_size,
                     device) -> TransportMemory:
    """Peak tensor bytes under each transport, in this rank: of one training step of the model `build_model(
    transport)` returns (after a warm-up step), and of the attention op alone on this rank's rows of one layer
    (forward, and forward+backward)."""
    from megatron_csbp.core.ops import context_sharded_block_attention, ring_plan

    head_dim, plan = config.kv_channels, ring_plan(layout, device)
    q = torch.randn(layout.num_rows, micro_batch_size, config.num_attention_heads, head_dim, device=device)
    k, v = (torch.randn(layout.num_rows, micro_batch_size, config.num_query_groups, head_dim, device=device)
            for _ in range(2))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    peaks = []
    for transport in transports.TRANSPORTS.values():
        model = build_model(transport)

        def attention(backward):
            out = context_sharded_block_attention(q, k, v, layout, group, transport=transport, plan=plan)
            if backward:
                out.sum().backward()
                q.grad = k.grad = v.grad = None

        parts = (lambda: train_step(model, forward_step, batch), lambda: attention(False), lambda: attention(True))
        peaks.append(TransportPeaks(transport.name, *(measured_peak(run, device) for run in parts)))  # PEAK_PARTS
        del model
    return TransportMemory(tuple(peaks))


def train_step(model, forward_step, batch) -> None:
    """One forward and backward of `model` on `batch`, its gradients then dropped."""
    output, loss_func = forward_step(iter([batch]), model)
    loss_sum, num_tokens, _ = loss_func(output)
    (loss_sum / num_tokens.clamp(min=1)).backward()
    model.zero_grad(set_to_none=True)


def measured_peak(run, device) -> int:
    """Peak tensor bytes of `run()` in this rank, after a warm-up call (plans, masks, first-call allocations)."""
    run()
    torch.distributed.barrier()
    with peak_tensor_memory(device) as peak:
        run()
    return peak.bytes


def head_logits_bytes(model, micro_batch_size: int) -> int:
    """Bytes of the fp32 logits the LM head makes of this rank's rows whole: head rows x micro-batch x this TP
    rank's vocabulary columns x 4."""
    layout = model.layout
    rows = layout.num_rows if model.clean_logits else layout.num_noisy_rows
    return rows * micro_batch_size * model.shared_embedding_or_output_weight().shape[0] * 4


def logits_memory(build_model, forward_step, batch, micro_batch_size, device, tile_rows: int) -> LogitsMemory:
    """A training step's peak tensor bytes in this rank with the head's logits whole and as a tiled linear
    cross-entropy of `tile_rows` rows (`build_model(logits_tile_rows)`: the model, None for whole logits)."""
    peaks = []
    for tile in (None, tile_rows):
        model = build_model(tile)
        peaks.append(measured_peak(lambda: train_step(model, forward_step, batch), device))
        logits = head_logits_bytes(model, micro_batch_size)
        del model
    return LogitsMemory(logits, *peaks)
