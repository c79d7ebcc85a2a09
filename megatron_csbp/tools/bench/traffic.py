"""Bytes per rank of the bench's runs, counted off the plans: the attention ops' traffic of one step, rank by rank.

In a sliding layer (`--window-size`) CSBP's ranks send different amounts (each sends the clean rows another rank's
rows see, `core.exchange`), the field's CP all-gathers K/V as in a global layer, and pure BP sends nothing, so the
bench sets every rank's measured counter beside this count. `--bytes-only` prints the counts without running the
model (any length, any machine: they are exact).
"""

from megatron_csbp.bdlm import flops
from megatron_csbp.core import modes
from megatron_csbp.core.windows import GLOBAL

BYTES_PER_ELEMENT = 4  # the bench's model runs in fp32


def exact_bytes(run, rank: int, windowed: bool = True, recompute: bool = False) -> int:
    """Bytes rank `rank` of `run` (a `RunConfig`) sends in one forward + backward step, every layer (every layer
    global with `windowed=False`; the forward twice with full recomputation)."""
    shape, C = run.shape, run.clean_shards
    layers = run.layer_windows if windowed else (GLOBAL,) * shape.num_layers
    per_window = {window: flops.rank_traffic_bytes(
        run.mode, run.seq_length, run.block_size, run.block_parallel_size, C, rank,
        shape.num_query_groups // run.tensor_parallel_size, shape.kv_channels, BYTES_PER_ELEMENT, run.transport,
        recompute=recompute, clean_attention=run.clean_attention, window=window) for window in set(layers)}
    return run.micro_batch_size * sum(per_window[window] for window in layers)


def exact_bytes_by_rank(run, windowed: bool = True, recompute: bool = False) -> tuple:
    return tuple(exact_bytes(run, rank, windowed, recompute) for rank in range(run.block_parallel_size))


def window_label(args) -> str:
    if args.window_size is None:
        return "every layer global"
    skip = args.window_attn_skip_freq
    pattern = "every layer sliding" if skip is None else (
        f"every {skip}-th layer global" if isinstance(skip, int) else f"pattern {list(skip)}")
    return f"--window-size {args.window_size[0]},{args.window_size[1]}, {pattern}"


def print_bytes_only(args, runs, out=None):
    """`--bytes-only`: per length and mode, each rank's bytes of one step with the run's windows, and with every layer
    global, and the largest rank's over the field's CP's (same length and windows)."""
    recompute = args.recompute_granularity == "full"
    print(f"bytes per rank of one step (forward + backward{', the forward twice' if recompute else ''}, "
          f"{args.num_layers} layers, fp32, counted off the plans; {window_label(args)}, {args.csbp_transport} "
          f"transport)", file=out)
    print(f"{'mode':<10} {'L':>7} {'P':>2} {'C':>2} {'windowed, by rank':>40} {'every layer global, by rank':>40} "
          f"{'max vs CP':>9}", file=out)
    baseline = next(mode for mode in modes.PARALLEL_MODES.values() if mode.is_baseline)
    counts = {(run.seq_length, run.mode): run for run in runs}
    for run in runs:
        windowed, whole = exact_bytes_by_rank(run, True, recompute), exact_bytes_by_rank(run, False, recompute)
        cp = counts.get((run.seq_length, baseline))
        cp_bytes = max(exact_bytes_by_rank(cp, True, recompute)) if cp else 0
        versus = f"{max(windowed) / cp_bytes:.4f}" if cp_bytes else "-"
        print(f"{run.mode.name:<10} {run.seq_length:>7} {run.block_parallel_size:>2} {run.clean_shards:>2} "
              f"{_joined(windowed):>40} {_joined(whole):>40} {versus:>9}", file=out)


def print_rank_bytes(records, out=None):
    """Each measured run's bytes rank by rank: the ops' counters beside the count off the plans."""
    print("bytes per rank, measured (the attention ops' counters) | counted off the plans", file=out)
    for r in records:
        same = "equal" if tuple(r.bytes_sent_by_rank) == tuple(r.exact_bytes_by_rank) else "DIFFER"
        print(f"{r.mode.name:<10} {r.seq_length:>7} {_joined(r.bytes_sent_by_rank):>40} | "
              f"{_joined(r.exact_bytes_by_rank):>40} {same}", file=out)


def _joined(values) -> str:
    return " ".join(f"{value:,}" for value in values)
