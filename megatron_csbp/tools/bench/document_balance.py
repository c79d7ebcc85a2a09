"""`--document-balance N`: instead of timing, N random packings per length (documents log-uniform from 256 to 16K
tokens, block multiples), and the max/mean real attention pairs per rank of the static schedule, of the
document-balanced deal, and of conventional CP's chunks."""

import dataclasses
import math
import random
import statistics
import sys
import time

from megatron_csbp.tools.bench.records import BASELINE, OPTIONAL, record_of


@dataclasses.dataclass(frozen=True)
class DocumentBalance:
    """Max/mean real attention pairs per rank over the packings of one (length, clean shards): the static
    schedule's, and the document-balanced deal's with the seconds it took (none for CP's chunks, which are not
    dealt: `clean_shards` is then the mode's name)."""

    seq_length: int
    nproc: int
    clean_shards: int | str
    packings: int
    static_mean: float
    static_worst: float
    balanced_mean: float | None = dataclasses.field(default=None, metadata=OPTIONAL)
    balanced_worst: float | None = dataclasses.field(default=None, metadata=OPTIONAL)
    deal_seconds: float | None = dataclasses.field(default=None, metadata=OPTIONAL)

    def record(self) -> dict:
        return record_of(self)


def random_packing(seq_length, block_size, generator, shortest=256, longest=16384):
    """`Documents` of one packed sample: lengths log-uniform in [shortest, longest], rounded up to blocks."""
    from megatron_csbp.core.documents import Documents

    starts, position = [0], 0
    while True:
        length = math.exp(generator.uniform(math.log(shortest), math.log(min(longest, seq_length))))
        position += -(-int(length) // block_size) * block_size
        if position >= seq_length:
            return Documents(seq_length, tuple(starts))
        starts.append(position)


def _imbalance(pairs) -> float:
    """The busiest rank's pairs over the mean."""
    return max(pairs) * len(pairs) / sum(pairs)


def document_balance(args) -> list[DocumentBalance]:
    """The records of `--document-balance` random packings per length of `--seq-lengths`, on `--nproc` ranks."""
    from megatron_csbp.core.documents import document_balanced_schedule, rank_pairs
    from megatron_csbp.core.layout import CSBPLayout, layout_for

    records, generator, P = [], random.Random(0), args.nproc
    for seq_length in args.seq_lengths:
        packings = [random_packing(seq_length, args.block_size, generator) for _ in range(args.document_balance)]
        shards = sorted({P, *(c for c in (2, 1) if P % c == 0)}, reverse=True)
        for C in shards:
            layouts = [CSBPLayout(seq_length, args.block_size, P, C, r) for r in range(P)]
            static, balanced, seconds = [], [], []
            for documents in packings:
                static.append(_imbalance(rank_pairs(layouts, documents)))
                started = time.perf_counter()
                table = document_balanced_schedule(layouts[0], documents)
                seconds.append(time.perf_counter() - started)
                balanced.append(_imbalance(rank_pairs([layout.dealt(table) for layout in layouts], documents)))
            records.append(DocumentBalance(seq_length, P, C, len(packings), statistics.mean(static), max(static),
                                           statistics.mean(balanced), max(balanced), statistics.mean(seconds)))
        chunks = [layout_for(BASELINE, seq_length, args.block_size, P, rank=r) for r in range(P)]
        ratios = [_imbalance(rank_pairs(chunks, documents)) for documents in packings]
        records.append(DocumentBalance(seq_length, P, BASELINE.name, len(packings), statistics.mean(ratios),
                                       max(ratios)))
    return records


def print_document_balance(records, out=None):
    out = out or sys.stdout
    print("packed documents (256..16K tokens, log-uniform): max/mean real attention pairs per rank", file=out)
    print(f"{'L':>8} {'P':>3} {'C':>4} {'packings':>8} {'static mean':>11} {'worst':>6} {'balanced mean':>13} "
          f"{'worst':>6} {'deal s':>7}", file=out)
    for r in records:
        balanced = (f"{r.balanced_mean:>13.3f} {r.balanced_worst:>6.3f} {r.deal_seconds:>7.3f}"
                    if r.balanced_mean is not None else f"{'(zigzag chunks, not dealt)':>28}")
        print(f"{r.seq_length:>8} {r.nproc:>3} {r.clean_shards!s:>4} {r.packings:>8} "
              f"{r.static_mean:>11.3f} {r.static_worst:>6.3f} {balanced}", file=out)
