"""Side-by-side benchmark of CSBP, conventional CP and pure BP on one model, data and noise.

    python -m megatron_csbp.bench --modes csbp,cp,bp --seq-lengths 1024,4096,16384 --nproc 2 \
        [--block-size 64] [--num-layers 2 --hidden-size 128 ...] [--json out.json] [--plot out.png]

Every (mode, length) runs in freshly spawned ranks (gloo on the CPU, NCCL on GPUs), so each one's peak
memory is its own. Per rank it measures a forward+backward step of the BDLM GPT model (median of
`--steps` after `--warmup`), the bytes the attention ops sent (their counters), the peak memory (the
allocator's on a GPU; on the CPU the growth of the process's peak RSS over the steps, beside the exact
bytes autograd saved for backward), the real attention pairs the rank's rows may see, and tokens/s.
`--kernel-check` also times the CPU attention kernel on the BDLM mask against a dense matmul.
"""

import argparse
import json
import math
import os
import resource
import statistics
import sys
import time

import torch

MODES = ("csbp", "cp", "bp")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m megatron_csbp.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="csbp,cp,bp", help="comma-separated subset of csbp,cp,bp")
    parser.add_argument("--seq-lengths", default="1024,4096,16384", help="clean context lengths L, comma-separated")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (the block-parallel / CP size)")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--csbp-transport", default="collective", choices=("collective", "streaming"))
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--num-query-groups", type=int, default=2)
    parser.add_argument("--ffn-hidden-size", type=int, default=None)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="measured steps per run (the median is reported)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--kernel-check", action="store_true",
                        help="also time the CPU attention kernel at the longest length against dense matmul")
    parser.add_argument("--json", help="write the records to this file")
    parser.add_argument("--plot", help="write time / bytes / memory against sequence length to this PNG")
    args = parser.parse_args(argv)
    args.modes = args.modes.split(",")
    args.seq_lengths = [int(n) for n in args.seq_lengths.split(",")]
    unknown = set(args.modes) - set(MODES)
    if unknown:
        parser.error(f"--modes: {sorted(unknown)} unknown; choose from {','.join(MODES)}")
    for length in args.seq_lengths:
        if length % (2 * args.nproc * args.block_size):
            parser.error(f"--seq-lengths: {length} must be a multiple of 2 x nproc x block size = "
                         f"{2 * args.nproc * args.block_size} so every mode's layout can take it")
    if args.num_attention_heads % args.num_query_groups:
        parser.error("--num-attention-heads must be a multiple of --num-query-groups")
    return args


def layout_of(mode, seq_length, block_size, nproc, rank):
    from megatron_csbp.layout import layout_for

    return layout_for(mode, seq_length, block_size, nproc, rank=rank)  # C: P for csbp and cp, 1 for bp


def rank_attention_pairs(layout) -> int:
    """Query-key pairs the BDLM mask lets this rank's rows see, per head, layer and sample."""
    block = layout.block_size
    noisy = layout.noisy_positions // block
    clean = layout.clean_positions // block
    return int(((noisy + 1) * block).sum() + ((clean + 1) * block).sum())


def _saved_bytes_hooks(store):
    seen = set()

    def pack(tensor):
        key = (tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            store[0] += key[1]
        return tensor

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)


def _peak_memory(device, baseline_rss):
    if device.type != "cpu":
        return torch.get_device_module(device).max_memory_allocated(device)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return max(peak_rss - baseline_rss, 0)


def _rank_run(rank, world_size, args, mode, seq_length):
    """One (mode, length) on this rank, inside the CPU backend (a no-op on accelerators); returns its record."""
    from megatron_csbp import cpu_backend

    with cpu_backend.active():
        return _rank_record(rank, world_size, args, mode, seq_length)


def _rank_record(rank, world_size, args, mode, seq_length):
    import psutil
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from megatron_csbp import comm, parallel_state
    from megatron_csbp.bdlm import BDLMForwardStep, BDLMObjective
    from megatron_csbp.device import default_device
    from megatron_csbp.model import model_provider

    device = default_device()
    clean_shards = layout_of(mode, seq_length, args.block_size, world_size, 0).clean_shards
    parallel_state.initialize_model_parallel(context_block_parallel_size=world_size, clean_shards=clean_shards)
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    layout = layout_of(mode, seq_length, args.block_size, world_size, mpu.get_context_parallel_rank())
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size,
        context_parallel_size=world_size, normalization="RMSNorm", use_cpu_initialization=True,
        calculate_per_token_loss=True, hidden_dropout=0.0, attention_dropout=0.0)
    mask_token = args.vocab_size - 1
    model = model_provider(config=config, layout=layout, vocab_size=args.vocab_size, mask_token_id=mask_token,
                           group=parallel_state.get_block_parallel_groups(), transport=args.csbp_transport).to(device)
    forward_step = BDLMForwardStep(BDLMObjective(block_size=args.block_size, mask_token_id=mask_token, seed=7),
                                   layout)
    generator = torch.Generator().manual_seed(42)
    batch = {"tokens": torch.randint(0, mask_token, (args.micro_batch_size, seq_length), generator=generator),
             "sample_index": torch.arange(args.micro_batch_size)}
    baseline_rss = psutil.Process().memory_info().rss
    if device.type != "cpu":
        torch.get_device_module(device).reset_peak_memory_stats(device)

    times, saved = [], [0]
    for step in range(args.warmup + args.steps):
        measured = step >= args.warmup
        torch.distributed.barrier()
        start = time.perf_counter()
        with comm.count_bytes() as counter, _saved_bytes_hooks(saved if step == 0 else [0]):
            output, loss_func = forward_step(iter([batch]), model)
            loss_sum, num_tokens, _ = loss_func(output)
            (loss_sum / num_tokens.clamp(min=1)).backward()
        if device.type != "cpu":
            torch.accelerator.synchronize()
        if measured:
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    step_time = statistics.median(times)
    parallel_state.destroy_model_parallel()
    return dict(mode=mode, seq_length=seq_length, block_size=args.block_size, nproc=world_size, rank=rank,
                transport=args.csbp_transport, bytes_sent_per_rank=counter.bytes_sent, step_time_s=step_time,
                peak_memory_bytes=_peak_memory(device, baseline_rss), saved_activation_bytes=saved[0],
                rows_per_rank=layout.num_rows, attention_pairs_per_rank=rank_attention_pairs(layout)
                * config.num_attention_heads * config.num_layers * args.micro_batch_size,
                tokens_per_s=args.micro_batch_size * seq_length / step_time)


def _spawn_run(args, mode, seq_length):
    from megatron_csbp.launch import run_ranks

    return run_ranks(_rank_run, args.nproc, args, mode, seq_length)


def summarise(per_rank):
    """One record per (mode, length): the slowest rank's time, the largest rank's bytes and memory."""
    first = per_rank[0]
    record = {key: first[key] for key in ("mode", "seq_length", "block_size", "nproc", "transport")}
    for key in ("bytes_sent_per_rank", "step_time_s", "peak_memory_bytes", "saved_activation_bytes",
                "rows_per_rank", "attention_pairs_per_rank"):
        record[key] = max(r[key] for r in per_rank)
    record["tokens_per_s"] = min(r["tokens_per_s"] for r in per_rank)
    return record


def kernel_efficiency(seq_length, block_size, heads=8, head_dim=64, repeats=2):
    """GFLOP/s of the CPU kernel on the full BDLM mask (real pairs only) and of a dense fp32 matmul."""
    from megatron_csbp.layout import CSBPLayout
    from megatron_csbp.ops import context_sharded_block_attention

    size = 2048
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    matmul = 2 * size ** 3 * repeats / (time.perf_counter() - start) / 1e9

    layout = CSBPLayout(seq_length, block_size, 1, 1)
    rows = layout.num_rows
    q = torch.randn(rows, 1, heads, head_dim, requires_grad=True)
    k = torch.randn(rows, 1, heads // 2, head_dim, requires_grad=True)
    v = torch.randn(rows, 1, heads // 2, head_dim, requires_grad=True)
    pairs = (seq_length ** 2 + seq_length * block_size) * heads
    context_sharded_block_attention(q, k, v, layout).sum().backward()  # warm-up: plans, caches, allocator
    forward_time = backward_time = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        out = context_sharded_block_attention(q, k, v, layout)
        middle = time.perf_counter()
        out.sum().backward()
        forward_time += middle - start
        backward_time += time.perf_counter() - middle
    forward = 4 * head_dim * pairs * repeats / forward_time / 1e9
    both = 14 * head_dim * pairs * repeats / (forward_time + backward_time) / 1e9
    return dict(seq_length=seq_length, block_size=block_size, threads=torch.get_num_threads(),
                matmul_gflops=matmul, attention_forward_gflops=forward, attention_train_gflops=both,
                forward_fraction=forward / matmul, train_fraction=both / matmul)


def print_table(records, out=sys.stdout):
    header = (f"{'mode':<5} {'L':>7} {'rows/rank':>9} {'bytes/rank':>12} {'vs CP':>6} {'step (s)':>9} "
              f"{'vs CP':>6} {'peak mem (MiB)':>14} {'saved act (MiB)':>15} {'pairs/rank':>12} {'tokens/s':>9}")
    print(header, file=out)
    print("-" * len(header), file=out)
    by_key = {(r["mode"], r["seq_length"]): r for r in records}
    for r in records:
        cp = by_key.get(("cp", r["seq_length"]))
        byte_ratio = f"{r['bytes_sent_per_rank'] / cp['bytes_sent_per_rank']:.3f}" if cp and cp["bytes_sent_per_rank"] else "-"
        time_ratio = f"{r['step_time_s'] / cp['step_time_s']:.3f}" if cp else "-"
        print(f"{r['mode']:<5} {r['seq_length']:>7} {r['rows_per_rank']:>9} {r['bytes_sent_per_rank']:>12,} "
              f"{byte_ratio:>6} {r['step_time_s']:>9.3f} {time_ratio:>6} {r['peak_memory_bytes'] / 2**20:>14.1f} "
              f"{r['saved_activation_bytes'] / 2**20:>15.1f} {r['attention_pairs_per_rank']:>12,} "
              f"{r['tokens_per_s']:>9.0f}", file=out)


def print_scaling(records, out=sys.stdout):
    """How each mode's cost grows between its two longest lengths, where attention dominates:
    activations per rank ~ L (L/C of clean rows), step time ~ L²."""
    for mode in MODES:
        points = sorted((r["seq_length"], r) for r in records if r["mode"] == mode)
        if len(points) < 2:
            continue
        (short, first), (long, last) = points[-2], points[-1]
        growth = long / short
        print(f"{mode}: L {short} -> {long} (x{growth:g}): saved activations per rank "
              f"x{last['saved_activation_bytes'] / first['saved_activation_bytes']:.2f} (linear x{growth:g}), "
              f"peak memory x{last['peak_memory_bytes'] / max(first['peak_memory_bytes'], 1):.2f}, "
              f"step time x{last['step_time_s'] / first['step_time_s']:.1f} (quadratic x{growth ** 2:g})", file=out)


def plot(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("step_time_s", "step time (s)"), ("bytes_sent_per_rank", "attention bytes sent per rank"),
              ("peak_memory_bytes", "peak memory growth (bytes)"), ("saved_activation_bytes", "saved activations (bytes)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for axis, (key, title) in zip(axes, panels):
        for mode in MODES:
            points = sorted((r["seq_length"], r[key]) for r in records if r["mode"] == mode)
            if points:
                axis.plot(*zip(*points), marker="o", label=mode)
        axis.set_xscale("log", base=2)
        axis.set_xlabel("clean sequence length L")
        axis.set_title(title)
        axis.grid(True, alpha=0.3)
        axis.legend()
    nproc = records[0]["nproc"]
    fig.suptitle(f"CSBP vs conventional CP vs pure BP, {nproc} ranks, block size {records[0]['block_size']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    args = parse_args(argv)
    records = []
    for seq_length in args.seq_lengths:
        for mode in args.modes:
            records.append(summarise(_spawn_run(args, mode, seq_length)))
            print(f"measured {mode} L={seq_length}: {records[-1]['step_time_s']:.3f} s/step", file=sys.stderr)
    print_table(records)
    for seq_length in args.seq_lengths:
        by_mode = {r["mode"]: r for r in records if r["seq_length"] == seq_length}
        if "csbp" in by_mode and "cp" in by_mode:
            csbp, cp = by_mode["csbp"], by_mode["cp"]
            print(f"L={seq_length}: CSBP/CP bytes {csbp['bytes_sent_per_rank'] / cp['bytes_sent_per_rank']:.3f}, "
                  f"step time {csbp['step_time_s'] / cp['step_time_s']:.3f}, "
                  f"saved activations {csbp['saved_activation_bytes'] / cp['saved_activation_bytes']:.3f}, "
                  f"peak memory {csbp['peak_memory_bytes'] / max(cp['peak_memory_bytes'], 1):.3f}")
    print_scaling(records)
    if args.kernel_check:
        efficiency = kernel_efficiency(max(args.seq_lengths), args.block_size)
        records.append(dict(mode="kernel", nproc=1, **efficiency))
        print(f"CPU kernel at L={efficiency['seq_length']} ({efficiency['threads']} threads): forward "
              f"{efficiency['attention_forward_gflops']:.1f} GFLOP/s = {efficiency['forward_fraction']:.0%} of dense "
              f"matmul {efficiency['matmul_gflops']:.1f} GFLOP/s; forward+backward "
              f"{efficiency['attention_train_gflops']:.1f} GFLOP/s = {efficiency['train_fraction']:.0%}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(records, handle, indent=2)
    if args.plot:
        plot([r for r in records if r["mode"] in MODES], args.plot)
        print(f"plot written to {args.plot}")
    return records


if __name__ == "__main__":
    main()
