"""The parallel modes — CSBP, the field's conventional CP over `[x_t ; x_0]`, its bytes-only ablation
`cp-traffic`, pure BP — as objects that state their facts.

Every fact that differs between the modes lives on its mode: how many clean shards it takes, which geometry
its layout needs, how many rows and attention pairs a rank holds, how many tokens' K/V its ring gathers,
which layout describes a rank and which kernel calls a rank makes (`kernel_calls`: real and computed
query-key pairs per call, `core.kernel_work`). The trainer's checks (`rules`), the layouts, the FLOP and byte counts
(`flops`), the planner and the bench ask the mode (`parallel_mode(name)`) instead of testing its name, so
a new mode is one class here (docs/algorithm.md §4–§5 for the layouts; `core.layout.layout_for` builds the
rows a mode gives a rank).

Standard library only (the planner runs without torch).
"""

import dataclasses

from megatron_csbp.core import kernel_work
from megatron_csbp.core.clean_attention import BLOCK_CAUSAL
from megatron_csbp.core.kernel_work import KernelCall
from megatron_csbp.core.schedule import DUAL_END, ZIGZAG
from megatron_csbp.core.variants import Registry, named
from megatron_csbp.core.windows import GLOBAL


@named
@dataclasses.dataclass(frozen=True)
class ParallelMode:
    """One way to split `[x_t ; x_0]` over `P` block-parallel ranks with `C` clean shards (base: CSBP's)."""

    name: str
    summary: str
    # Copies of the sequence whose K/V the ring carries: CSBP the clean copy, CP both, BP none.
    transported_copies: int
    is_baseline: bool = False  # what the field runs; the others are compared with it
    # One masked kernel call over the rank's rows (the field's CP), or CSBP's block-diagonal and prefix calls.
    masked_attention = False  # a class fact, not a field
    # Zigzag chunks of both copies by position (conventional CP), or whole noisy blocks and a clean shard.
    shards_both_copies = False

    def clean_shard_choices(self, parallel_size: int) -> list[int]:
        """The `C` worth planning at `P` ranks: CSBP with `C = 1` is pure BP, and at `P = 1` all modes are
        the same run (the baseline stands for it)."""
        return [c for c in range(2, parallel_size + 1) if parallel_size % c == 0]

    def traits(self, parallel_size: int, clean_shards: int) -> list[str]:
        """What sets a layout of this mode apart, in a few words (the planner's reasons)."""
        if parallel_size > clean_shards:
            return [f"clean rows replicated {parallel_size // clean_shards}x"]
        return []

    @property
    def compared_with_baseline(self) -> bool:
        """Whether its traffic is worth setting beside the baseline's (it has a ring and is not the baseline)."""
        return self.transported_copies > 0 and not self.is_baseline

    def clean_shards(self, parallel_size: int, given: int | None = None) -> int:
        """`C`: the clean-shards flag, or `P` when it is unset."""
        return parallel_size if given is None else given

    def clean_shards_problem(self, parallel_size: int, given: int | None, flags) -> str | None:
        """What this mode refuses of the clean-shards flag (`given`, None when unset)."""
        return None

    def geometry_problem(self, seq_length: int, block_size: int, parallel_size: int, clean_shards: int,
                         clean_layout, flags) -> str | None:
        """This mode's cut of the sequence, past the rules every mode shares (whole blocks, a block per rank):
        the clean sequence cut into its clean layout's (`core.schedule.CleanLayout`) equal chunks."""
        chunks = clean_layout.chunks(clean_shards)
        if seq_length % chunks == 0:
            return None
        return (f"{flags.seq_length} {seq_length} cannot be cut into {chunks} equal clean chunks ({flags.clean_layout} "
                f"{clean_layout}, {flags.clean_shards} {clean_shards}); use a multiple of {chunks}")

    def rows(self, seq_length: int, parallel_size: int, clean_shards: int) -> tuple[int, int]:
        """(noisy, clean) rows of one rank: whole blocks of the `L/P` noisy rows, a `1/C` shard of the clean."""
        return seq_length // parallel_size, seq_length // clean_shards

    def attention_pairs(self, parts: dict, parallel_size: int, clean_shards: int) -> tuple[float, float]:
        """(all, local) query-key pairs of one rank, from the whole mask's parts (`flops.bdlm_attention_pair_
        parts`): local pairs need no key from another rank, so they can hide the ring's traffic."""
        P, C = parallel_size, clean_shards
        return ((parts["noisy_noisy"] + parts["noisy_clean"]) / P + parts["clean_clean"] / C,
                parts["noisy_noisy"] / P)

    def gathered_tokens(self, seq_length: int, clean_shards: int) -> int:
        """Tokens whose K/V one layer's ring gathers on every rank (none without a ring)."""
        return self.transported_copies * seq_length if clean_shards > 1 else 0

    def row_spans(self, seq_length: int, block_size: int, parallel_size: int, clean_shards: int,
                  rank: int, schedule=DUAL_END, clean_layout=ZIGZAG) -> tuple[list, list]:
        """(noisy, clean) position spans `[(start, stop)]` of rank `rank`'s rows, in row order: the stdlib twin
        of the layout's `noisy_positions` and `clean_positions`."""
        L, B = seq_length, block_size
        noisy = [(b * B, (b + 1) * B) for b in schedule.deal(L // B, parallel_size)[rank]]
        return noisy, clean_layout.spans(L, clean_shards, rank % clean_shards)

    def exchanged_rows(self, seq_length: int, block_size: int, parallel_size: int, clean_shards: int, rank: int,
                       clean_attention=BLOCK_CAUSAL, window=GLOBAL) -> tuple[int, int]:
        """(sent, received): the K/V rows rank `rank` sends to and receives from its ring in one layer's forward.
        A ring moves the `(C-1)/C` of the transported copies a rank does not own; in a sliding layer under CSBP
        (`core.exchange`) only the rows another member's rows see: with `S_j` the clean positions member `j`'s rows
        see and `O_j` those it holds, it sends `Σ_{j≠r} |O_r ∩ S_j|` and receives `|S_r \ O_r|`."""
        C = clean_shards
        if C == 1 or not self.transported_copies:
            return 0, 0
        if not window.sliding or self.shards_both_copies:
            rows = self.gathered_tokens(seq_length, C) // C * (C - 1)
            return rows, rows
        members = [rank // C * C + j for j in range(C)]
        spans = [self.row_spans(seq_length, block_size, parallel_size, C, member) for member in members]
        seen = [_union(key_ranges(*member_spans, block_size, clean_attention, window)) for member_spans in spans]
        held = [sorted(clean) for _, clean in spans]
        me = rank % C
        sent = sum(_overlap(held[me], seen[j]) for j in range(C) if j != me)
        received = sum(_overlap(held[j], seen[me]) for j in range(C) if j != me)
        return sent, received

    def kernel_calls(self, seq_length: int, block_size: int, parallel_size: int, clean_shards: int, rank: int,
                     tile: int, clean_attention=BLOCK_CAUSAL, window=GLOBAL) -> tuple[KernelCall, ...]:
        """The attention kernel calls rank `rank` makes in one layer's forward, per head and sample, under the
        collective transport (streaming makes the remote call once per ring step, over the same rows): the
        block-diagonal call of its noisy blocks ("dense": whole `B×B` blocks, no padding) and the call of every
        row against its clean keys sorted by position ("prefix"), which computes each row's keys from the start of
        the `tile`-wide key tile holding its first visible key to the end of the one holding its last (the CPU
        prefix and range plans). The keys are the whole clean copy, or in a sliding layer whose ring exchanges
        windows (`core.exchange`) the clean positions the rank's rows see."""
        L, B = seq_length, block_size
        noisy, clean = self.row_spans(L, B, parallel_size, clean_shards, rank)
        ranges = list(key_ranges(noisy, clean, B, clean_attention, window))
        keys = _KeyIndex(_union(ranges) if window.sliding and clean_shards > 1 and not self.shards_both_copies
                         else [(0, L)])
        real = computed = 0
        for start, limit, rows in ranges:
            first, stop = keys.index(start), keys.index(limit)
            if stop > first:
                real += rows * (stop - first)
                computed += rows * (min(-(-stop // tile) * tile, keys.size) - first // tile * tile)
        noisy_pairs = sum(stop - start for start, stop in noisy) * B
        calls = [KernelCall(kernel_work.DENSE, noisy_pairs, noisy_pairs)] if noisy_pairs else []
        return tuple(calls + [KernelCall(kernel_work.PREFIX, real, computed)])


class _PureBlockParallel(ParallelMode):
    """Every rank keeps the whole clean sequence: nothing travels, the clean prefix is computed `P` times."""

    def clean_shard_choices(self, parallel_size):
        return [1] if parallel_size > 1 else []

    def traits(self, parallel_size, clean_shards):
        return ["no attention traffic, every rank recomputes the clean prefix"]

    def clean_shards(self, parallel_size, given=None):
        return 1

    def clean_shards_problem(self, parallel_size, given, flags):
        if given in (None, 1):
            return None
        return (f"{flags.mode} bp replicates the clean sequence (one clean shard); drop {flags.clean_shards} {given} "
                f"or use {flags.mode} csbp")


def key_ranges(noisy_spans, clean_spans, block_size, clean_attention=BLOCK_CAUSAL, window=GLOBAL):
    """`(start, limit, rows)` per run of rows sharing their clean keys, the positions `[start, limit)`: the
    clean-attention rule's limits (`core.clean_attention`), from the window's start in a sliding layer
    (`core.windows`; docs/algorithm.md §3). Noisy rows first, then clean ones, as a rank holds them."""
    for spans, clean in ((noisy_spans, False), (clean_spans, True)):
        for anchor, limit, rows in clean_attention.key_runs(spans, clean, block_size):
            yield max(window.starts(anchor), 0), limit, rows


def _union(ranges):
    """The positions some of `ranges` covers, as sorted disjoint `(start, stop)` intervals."""
    merged = []
    for start, stop, _ in sorted(ranges):
        if stop <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    return [tuple(interval) for interval in merged]


def _overlap(intervals, others) -> int:
    """Positions two lists of disjoint `(start, stop)` intervals have in common."""
    return sum(max(0, min(stop, other_stop) - max(start, other_start))
               for start, stop in intervals for other_start, other_stop in others)


class _KeyIndex:
    """The keys of a call, sorted intervals of positions: `index(p)` is how many keys lie below position `p`."""

    def __init__(self, intervals):
        self.intervals, self.before, total = intervals, [], 0
        for start, stop in intervals:
            self.before.append(total)
            total += stop - start
        self.size = total

    def index(self, position) -> int:
        count = 0
        for (start, stop), before in zip(self.intervals, self.before):
            if position <= start:
                break
            count = before + min(position, stop) - start
        return count


class _ContextParallel(ParallelMode):
    """Megatron's context parallelism applied to the `2L` rows: `2P` zigzag chunks of `[x_t ; x_0]`, whose
    K/V all travel. This class computes with CSBP's two kernels (`cp-traffic`, the ablation that isolates
    bytes); `_FieldContextParallel` with the field's one masked call."""

    shards_both_copies = True

    def clean_shard_choices(self, parallel_size):
        return [parallel_size]

    def traits(self, parallel_size, clean_shards):
        if clean_shards > 1:
            return ["gathers K/V of all 2L rows behind the same local noisy attention"]
        return ["no sequence sharding"]

    def clean_shards(self, parallel_size, given=None):
        return parallel_size

    def clean_shards_problem(self, parallel_size, given, flags):
        if given in (None, parallel_size):
            return None
        return (f"{flags.mode} {self.name} shards both copies over all {parallel_size} ranks; drop "
                f"{flags.clean_shards} {given}")

    def geometry_problem(self, seq_length, block_size, parallel_size, clean_shards, clean_layout, flags):
        L, B, P = seq_length, block_size, parallel_size
        if L % (P * B) == 0:
            return None
        return (f"{flags.mode} {self.name} cuts [x_t ; x_0] into {2 * P} chunks of whole blocks: "
                f"{flags.seq_length} {L} "
                f"must be a multiple of {P * B} ({flags.parallel_size} x {flags.block_size})")

    def rows(self, seq_length, parallel_size, clean_shards):
        return seq_length // clean_shards, seq_length // clean_shards

    def attention_pairs(self, parts, parallel_size, clean_shards):
        return sum(parts.values()) / clean_shards, parts["noisy_noisy"] / clean_shards

    def row_spans(self, seq_length, block_size, parallel_size, clean_shards, rank):
        chunk = seq_length // clean_shards
        mirror = clean_shards - 1 - rank
        return [(rank * chunk, (rank + 1) * chunk)], [(mirror * chunk, (mirror + 1) * chunk)]


class _FieldContextParallel(_ContextParallel):
    """The context parallelism a Megatron user with a masked kernel runs on `[x_t ; x_0]`: the `2C` zigzag
    chunks of `_ContextParallel`, K/V of all `2L` tokens gathered (or streamed), and ONE masked attention call
    per rank (per ring step when streamed) over its rows against them, under the BDLM mask."""

    masked_attention = True

    def traits(self, parallel_size, clean_shards):
        if clean_shards > 1:
            return ["gathers K/V of all 2L rows, one masked attention call over them"]
        return ["no sequence sharding, one masked attention call"]

    def kernel_calls(self, seq_length, block_size, parallel_size, clean_shards, rank, tile,
                     clean_attention=BLOCK_CAUSAL, window=GLOBAL):
        """One "masked" call: the rank's `2L/C` rows (its noisy chunk, then its clean chunk) against the `2L`
        keys in position order (noisy copy, then clean), both cut into `tile`-sized tiles as flex cuts them;
        a key tile is computed for a query tile when any of its pairs is visible (`core.kernels.MaskedPlan`)."""
        L, B, t = seq_length, block_size, tile
        (noisy,), (clean,) = self.row_spans(L, B, parallel_size, clean_shards, rank)
        rows = [(noisy, False), (clean, True)]  # (span, clean copy?) in row order
        # a noisy row sees its own block's B noisy keys besides its clean keys
        real = (sum(rows * (max(limit - start, 0) + B) for start, limit, rows in key_ranges([noisy], [], B,
                                                                                            clean_attention, window))
                + sum(rows * max(limit - start, 0) for start, limit, rows in key_ranges([], [clean], B,
                                                                                         clean_attention, window)))
        n, computed = 2 * (L // clean_shards), 0
        for lo in range(0, n, t):
            hi = min(lo + t, n)
            intervals = []  # key index intervals some row of this query tile sees (noisy keys [0, L), clean [L, 2L))
            for (start, stop), clean_copy in rows:
                offset = noisy[1] - noisy[0] if clean_copy else 0
                first, last = max(lo, offset), min(hi, offset + stop - start)
                if first >= last:
                    continue
                p0, p1 = start + first - offset, start + last - offset  # positions of those rows: [p0, p1)
                spans = ([(p0, p1)], []) if not clean_copy else ([], [(p0, p1)])
                intervals += [(L + key_start, L + limit)
                              for key_start, limit, _ in key_ranges(*spans, B, clean_attention, window)]
                if not clean_copy:  # and their blocks' noisy keys
                    intervals.append((p0 // B * B, ((p1 - 1) // B + 1) * B))
            computed += (hi - lo) * _tile_span(intervals, 2 * L, t)
        return (KernelCall(kernel_work.MASKED, real, computed),)


CSBP = ParallelMode("csbp", "CSBP: whole noisy blocks per rank (dual-end), a zigzag shard of the clean copy; "
                            "only clean K/V travel", transported_copies=1)
CP = _FieldContextParallel("cp", "conventional context parallelism over [x_t ; x_0], as the field runs it (the "
                                "baseline): K/V of both copies travel, one masked attention call per rank",
                           transported_copies=2, is_baseline=True)
CP_TRAFFIC = _ContextParallel("cp-traffic", "cp's layout and traffic computed with CSBP's two kernels: an ablation "
                                            "that isolates the bytes", transported_copies=2)
BP = _PureBlockParallel("bp", "pure block parallelism: the clean copy replicated on every rank, nothing travels",
                        transported_copies=0)

PARALLEL_MODES = Registry("--bdlm-parallel-mode", CSBP, CP, CP_TRAFFIC, BP)  # the flag's choices, in its order


def _tile_span(intervals, total, tile):
    """Keys in the `tile`-wide tiles of `[0, total)` that meet any of `intervals` (half-open, empty ones ignored)."""
    ranges = sorted((start // tile, (stop - 1) // tile) for start, stop in intervals if stop > start)
    keys, covered = 0, -1
    for first, last in ranges:
        first = max(first, covered + 1)
        if first <= last:
            keys += min((last + 1) * tile, total) - first * tile
            covered = last
    return keys


parallel_mode = PARALLEL_MODES  # parallel_mode(name or mode) -> the mode; ValueError naming the choices
