"""The bench's tables: every mode beside CP, the CSBP / CP summary per length, how each mode grows with the length,
the transports' memory, the logits' memory, the simulated link sweep and the overlap check."""

import dataclasses
import os
import statistics
import sys

from megatron_csbp.core import modes
from megatron_csbp.tools.bench.records import BASELINE, CPComparison


def load_warning(load_average, cores=None):
    """A line when the machine ran more work than it has cores during a run (its times are then slowed by
    others' work), else None."""
    cores = cores or os.cpu_count()
    if load_average > cores:
        return (f"WARNING: load average {load_average:.1f} above the {cores} cores during this run: its times "
                f"include waiting for other processes")
    return None


def step_ratio(record, cp, times="step_times_s"):
    """A step time (`times`: "step_times_s" wall clock, "cpu_times_s" CPU) against CP's. Interleaved, the median
    over rounds of each round's ratio: the two steps of a round ran side by side, so a slow spell of the machine
    divides out. Otherwise the ratio of the medians."""
    if record.condition.interleaved and cp.condition.interleaved:
        return statistics.median(a / b for a, b in zip(getattr(record, times), getattr(cp, times)))
    summary = {"step_times_s": "step_time_s", "cpu_times_s": "cpu_time_s"}[times]
    return getattr(record, summary) / getattr(cp, summary)


def versus_cp(records):
    """`records`, those of the main table (backend link, overlapped) compared with CP's at their length."""
    cp = {}
    for r in records:
        if r.condition.is_main and r.mode is BASELINE:
            cp.setdefault(r.seq_length, r)

    def compared(r):
        base = cp.get(r.seq_length)
        ratios = (step_ratio(r, base), step_ratio(r, base, "cpu_times_s")) if base else (None, None)
        return dataclasses.replace(r, versus_cp=CPComparison(*ratios))

    return [compared(r) if r.condition.is_main else r for r in records]


def _ratio(record, cp, key, digits=3) -> str:
    return f"{getattr(record, key) / getattr(cp, key):.{digits}f}" if cp and getattr(cp, key) else "-"


def print_table(records, out=None):
    out = out or sys.stdout
    header = (f"{'mode':<10} {'L':>7} {'rows/rank':>9} {'bytes/rank':>12} {'vs CP':>6} {'step (s)':>9} "
              f"{'vs CP':>6} {'CPU (s)':>8} {'vs CP':>6} {'exposed (s)':>11} {'share':>6} {'peak mem (MiB)':>14} "
              f"{'saved act (MiB)':>15} "
              f"{'pairs/rank':>12} {'tokens/s':>9} {'load':>5} {'kernels':>13} {'calls':>5} {'real pairs':>12} "
              f"{'computed':>12} {'comp/real':>9}")
    print("CP = the field's conventional CP (mode cp); kernels, calls, real and computed pairs: one layer's forward "
          "on the rank computing most, per head and sample, counted off the kernels' plans; CPU: the step's CPU "
          "seconds (the busiest rank's; not time waiting for a core or a peer); load: the load average during the "
          "run", file=out)
    if any(r.condition.interleaved for r in records):
        print("interleaved: each length's modes in the same ranks, steps alternating; step vs CP: the median of the "
              "rounds' ratios; peak mem: exact tensor bytes of one step (not the RSS growth of a run of its own)",
              file=out)
    print(header, file=out)
    print("-" * len(header), file=out)
    by_key = {(r.mode, r.seq_length): r for r in records}
    for r in records:
        cp = by_key.get((BASELINE, r.seq_length))
        time_ratio = f"{step_ratio(r, cp):.3f}" if cp else "-"
        cpu_ratio = f"{step_ratio(r, cp, 'cpu_times_s'):.3f}" if cp else "-"
        print(f"{r.mode.name:<10} {r.seq_length:>7} {r.rows_per_rank:>9} {r.bytes_sent_per_rank:>12,} "
              f"{_ratio(r, cp, 'bytes_sent_per_rank'):>6} {r.step_time_s:>9.3f} {time_ratio:>6} {r.cpu_time_s:>8.3f} "
              f"{cpu_ratio:>6} {r.exposed_comm_s:>11.3f} "
              f"{r.exposed_share:>6.1%} {r.peak_memory_bytes / 2**20:>14.1f} "
              f"{r.saved_activation_bytes / 2**20:>15.1f} {r.attention_pairs_per_rank:>12,} "
              f"{r.tokens_per_s:>9.0f} {r.load_average if r.load_average is not None else float('nan'):>5.1f} "
              f"{r.kernels:>13} {r.kernel_calls:>5} {r.kernel_real_pairs:>12,} {r.kernel_computed_pairs:>12,} "
              f"{r.kernel_computed_pairs / r.kernel_real_pairs:>9.3f}", file=out)


def print_versus_cp(records, seq_lengths, out=None):
    """One line per length: CSBP over CP in bytes, step time, exposed communication, memory and computed pairs."""
    for seq_length in seq_lengths:
        by_mode = {r.mode: r for r in records if r.seq_length == seq_length}
        if modes.CSBP in by_mode and BASELINE in by_mode:
            csbp, cp = by_mode[modes.CSBP], by_mode[BASELINE]
            print(f"L={seq_length}: CSBP/CP bytes {csbp.bytes_sent_per_rank / cp.bytes_sent_per_rank:.3f}, "
                  f"step time {step_ratio(csbp, cp):.3f} (CPU {step_ratio(csbp, cp, 'cpu_times_s'):.3f}), "
                  f"exposed comm {csbp.exposed_comm_s:.3f} vs {cp.exposed_comm_s:.3f} s, "
                  f"saved activations {csbp.saved_activation_bytes / cp.saved_activation_bytes:.3f}, "
                  f"peak memory {csbp.peak_memory_bytes / max(cp.peak_memory_bytes, 1):.3f}, "
                  f"computed pairs {csbp.kernel_computed_pairs / cp.kernel_computed_pairs:.3f}", file=out or sys.stdout)


def print_scaling(records, out=None):
    """How each mode's cost grows between its two longest lengths, where attention dominates:
    activations per rank ~ L (L/C of clean rows), step time ~ L²."""
    out = out or sys.stdout
    for mode in modes.PARALLEL_MODES.values():
        points = sorted(((r.seq_length, r) for r in records if r.mode is mode), key=lambda point: point[0])
        if len(points) < 2:
            continue
        (short, first), (long, last) = points[-2], points[-1]
        growth = long / short
        print(f"{mode.name}: L {short} -> {long} (x{growth:g}): saved activations per rank "
              f"x{last.saved_activation_bytes / first.saved_activation_bytes:.2f} (linear x{growth:g}), "
              f"peak memory x{last.peak_memory_bytes / max(first.peak_memory_bytes, 1):.2f}, "
              f"step time x{last.step_time_s / first.step_time_s:.1f} (quadratic x{growth ** 2:g})", file=out)


def print_transport_memory(records, out=None):
    """Peak tensor memory per rank under each transport (`--transport-memory`), the largest rank's."""
    out = out or sys.stdout
    rows = [r for r in records if r.transport_memory]
    if not rows:
        return
    print("\ntransport memory: peak tensor MiB per rank (largest rank), collective / streaming", file=out)
    header = (f"{'mode':<10} {'L':>7} {'ranks':>5} {'C':>3} {'transport':<10} {'step':>9} {'attention fwd':>13} "
              f"{'attention fwd+bwd':>17}")
    print(header, file=out)
    print("-" * len(header), file=out)
    for r in rows:
        for peaks in r.transport_memory.peaks:
            print(f"{r.mode.name:<10} {r.seq_length:>7} {r.nproc:>5} {r.mode.clean_shards(r.nproc):>3} "
                  f"{peaks.transport:<10} {peaks.step / 2**20:>9.1f} {peaks.attention_forward / 2**20:>13.1f} "
                  f"{peaks.attention / 2**20:>17.1f}", file=out)


def print_logits_memory(records, out=None):
    """Peak tensor memory of a step per rank with the LM head's logits whole and tiled (`--logits-memory`), the
    largest rank's, beside the logits' bytes."""
    out = out or sys.stdout
    rows = [r for r in records if r.logits_memory]
    if not rows:
        return
    print("\nlogits memory: peak tensor MiB of a step per rank (largest rank), the LM head's logits whole / as a "
          "tiled linear cross-entropy", file=out)
    header = f"{'mode':<10} {'L':>7} {'ranks':>5} {'logits':>9} {'whole':>9} {'tiled':>9} {'saved':>9}"
    print(header, file=out)
    print("-" * len(header), file=out)
    for r in rows:
        memory = r.logits_memory
        saved = memory.whole_logits_step_peak_bytes - memory.tiled_logits_step_peak_bytes
        mib = [value / 2**20 for value in (memory.logits_bytes, memory.whole_logits_step_peak_bytes,
                                           memory.tiled_logits_step_peak_bytes, saved)]
        print(f"{r.mode.name:<10} {r.seq_length:>7} {r.nproc:>5} " + " ".join(f"{value:>9.1f}" for value in mib),
              file=out)


def print_link_sweep(records, out=None):
    """Step time and exposed communication of each mode as the link slows, and CSBP / CP."""
    out = out or sys.stdout
    rows = [r for r in records if r.condition.overlap]
    links = sorted({r.condition.link_gbps for r in rows}, key=lambda g: -(g or float("inf")))
    if len(links) < 2:
        return
    shown = [mode for mode in modes.PARALLEL_MODES.values() if any(r.mode is mode for r in rows)]
    print("\nsimulated link sweep: step s (exposed comm s, share of the step)", file=out)
    print(f"{'L':>7} {'link':>10} " + " ".join(f"{m.name:>22}" for m in shown) + f" {'CSBP/CP':>8}", file=out)
    by_key = {(r.mode, r.seq_length, r.condition.link_gbps): r for r in rows}
    for length in sorted({r.seq_length for r in rows}):
        for gbps in links:
            cells, found = [], {}
            for mode in shown:
                r = found[mode] = by_key.get((mode, length, gbps))
                cells.append(f"{r.step_time_s:8.3f} ({r.exposed_comm_s:6.3f}, {r.exposed_share:4.0%})"
                             if r else f"{'-':>22}")
            ratio = (f"{found[modes.CSBP].step_time_s / found[BASELINE].step_time_s:8.3f}"
                     if found.get(modes.CSBP) and found.get(BASELINE) else f"{'-':>8}")
            label = "backend" if gbps is None else f"{gbps:g} Gb/s"
            print(f"{length:>7} {label:>10} " + " ".join(cells) + f" {ratio}", file=out)


def print_overlap(records, out=None):
    """Exposed communication with the overlap and with every collective waited for at issue: the difference is
    what the local noisy attention hid."""
    out = out or sys.stdout
    serial = {(r.mode, r.seq_length): r for r in records if not r.condition.overlap}
    if not serial:
        return
    print("\noverlap check (backend link): exposed comm s with overlap | serialised (the collectives alone) | hidden",
          file=out)
    for r in records:
        s = serial.get((r.mode, r.seq_length))
        if not r.condition.is_main or s is None or not s.bytes_sent_per_rank:
            continue
        hidden = s.exposed_comm_s - r.exposed_comm_s
        print(f"  {r.mode.name:<10} L={r.seq_length:<6} {r.exposed_comm_s:7.3f} | {s.exposed_comm_s:7.3f} | "
              f"{hidden:7.3f} s ({hidden / max(s.exposed_comm_s, 1e-12):.0%} of the collectives' time); step "
              f"{r.step_time_s:.3f} s vs {s.step_time_s:.3f} s serialised", file=out)
