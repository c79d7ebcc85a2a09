"""The bench's plots: time, bytes and memory against the length (`--plot`), and step time against the simulated
link (`--link-plot`)."""

from megatron_csbp.core import modes
from megatron_csbp.tools.bench.records import BASELINE


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _curves(axis, rows, x, y):
    """One line per mode of `rows` (each point `(x(r), y(r))`), labelled with its name."""
    for mode in modes.PARALLEL_MODES.values():
        points = sorted((x(r), y(r)) for r in rows if r.mode is mode)
        if points:
            axis.plot(*zip(*points), marker="o", label=mode.name)


def _finish(fig, axes, title, path):
    for axis in axes:
        axis.grid(True, alpha=0.3)
        axis.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_links(records, path):
    """Step time against the simulated link speed, one panel per length, with CSBP / CP beside."""
    plt = _pyplot()
    rows = [r for r in records if r.condition.overlap and r.condition.link_gbps]
    lengths = sorted({r.seq_length for r in rows})
    fig, axes = plt.subplots(1, len(lengths) + 1, figsize=(5 * (len(lengths) + 1), 4), squeeze=False)
    for axis, length in zip(axes[0], lengths):
        _curves(axis, [r for r in rows if r.seq_length == length], lambda r: r.condition.link_gbps,
                lambda r: r.step_time_s)
        axis.set_title(f"step time (s), L = {length}")
    ratio_axis = axes[0][-1]
    for length in lengths:
        by = {(r.mode, r.condition.link_gbps): r.step_time_s for r in rows if r.seq_length == length}
        points = sorted((g, by[modes.CSBP, g] / by[BASELINE, g]) for m, g in by
                        if m is modes.CSBP and (BASELINE, g) in by)
        if points:
            ratio_axis.plot(*zip(*points), marker="o", label=f"L = {length}")
    ratio_axis.axhline(1.0, color="grey", linewidth=0.8)
    ratio_axis.set_title("CSBP / CP step time")
    for axis in axes[0]:
        axis.set_xscale("log")
        axis.set_xlabel("simulated link (Gb/s)")
    _finish(fig, axes[0], f"simulated link sweep, {rows[0].nproc} ranks, block size {rows[0].block_size}", path)


def plot(records, path):
    plt = _pyplot()
    panels = [("step_time_s", "step time (s)"), ("bytes_sent_per_rank", "attention bytes sent per rank"),
              ("peak_memory_bytes", "peak memory growth (bytes)"),
              ("saved_activation_bytes", "saved activations (bytes)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for axis, (key, title) in zip(axes, panels):
        _curves(axis, records, lambda r: r.seq_length, lambda r, key=key: getattr(r, key))
        axis.set_xscale("log", base=2)
        axis.set_xlabel("clean sequence length L")
        axis.set_title(title)
    _finish(fig, axes, f"CSBP vs conventional CP vs pure BP, {records[0].nproc} ranks, block size "
                       f"{records[0].block_size}", path)
