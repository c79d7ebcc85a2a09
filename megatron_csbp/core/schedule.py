"""How a layout deals the sequence to block-parallel ranks: which noisy blocks each rank owns (the block
schedules) and which clean positions each ring member holds (the clean layouts), as objects (docs/algorithm.md §4).

Standard library only: the layouts (`core.layout`) and the modes' analytic kernel counts
(`core.modes.ParallelMode.kernel_calls`, which the planner runs without torch) deal the blocks the same way.
"""

import dataclasses

from megatron_csbp.core.variants import Registry, named


def block_cost(block: int) -> int:
    """Attention work of noisy block `b` in units of B² query-key pairs: `b` clean blocks plus itself."""
    return block + 1


def dual_end_schedule(num_blocks: int, num_ranks: int) -> list[list[int]]:
    """Pairs `(k, NB-1-k)` cost the same, so contiguous runs of pairs balance the ranks; blocks left
    over (fewer pairs than ranks, the odd middle block) go greedily, heaviest first, to the least loaded."""
    num_pairs = num_blocks // 2
    pairs_per_rank = num_pairs // num_ranks
    owned: list[list[int]] = []
    for rank in range(num_ranks):
        run = range(rank * pairs_per_rank, (rank + 1) * pairs_per_rank)
        owned.append([block for k in run for block in (k, num_blocks - 1 - k)])
    dealt = num_ranks * pairs_per_rank
    leftover = sorted(range(dealt, num_blocks - dealt), key=block_cost, reverse=True)
    loads = [sum(block_cost(b) for b in blocks) for blocks in owned]
    for block in leftover:
        rank = min(range(num_ranks), key=lambda r: (loads[r], r))
        owned[rank].append(block)
        loads[rank] += block_cost(block)
    return owned


def contiguous_schedule(num_blocks: int, num_ranks: int) -> list[list[int]]:
    base, extra = divmod(num_blocks, num_ranks)
    starts = [r * base + min(r, extra) for r in range(num_ranks + 1)]
    return [list(range(starts[r], starts[r + 1])) for r in range(num_ranks)]


@named
@dataclasses.dataclass(frozen=True)
class BlockSchedule:
    """A deal of the `NB` noisy blocks to `P` ranks: `deal(NB, P)[r]` are rank r's blocks, in row order."""

    name: str
    summary: str
    deal: object  # (num_blocks, num_ranks) -> list of block lists


DUAL_END = BlockSchedule("dual_end", "pairs of blocks from both ends of the sequence: equal work per rank",
                         dual_end_schedule)
CONTIGUOUS_BLOCKS = BlockSchedule("contiguous", "consecutive runs of blocks (an ablation: unequal work)",
                                  contiguous_schedule)
SCHEDULES = Registry("--csbp-block-schedule", DUAL_END, CONTIGUOUS_BLOCKS)


@named
@dataclasses.dataclass(frozen=True)
class CleanLayout:
    """How a ring of `C` ranks shards the `L` clean positions: `chunks_per_member` equal chunks each."""

    name: str
    summary: str
    chunks_per_member: int

    def chunks(self, clean_shards: int) -> int:
        """Equal chunks the clean sequence is cut into (it must divide `L`)."""
        return self.chunks_per_member * clean_shards

    def spans(self, seq_length: int, clean_shards: int, ring_rank: int) -> list[tuple[int, int]]:
        """The `(start, stop)` position spans ring member `ring_rank` holds, in row order."""
        C, r = clean_shards, ring_rank
        chunk = seq_length // self.chunks(C)
        members = (r,) if self.chunks_per_member == 1 else (r, 2 * C - 1 - r)  # zigzag: chunk r and its mirror
        return [(m * chunk, (m + 1) * chunk) for m in members]


ZIGZAG = CleanLayout("zigzag", "chunk r and its mirror 2C-1-r per member: equal causal work per rank", 2)
CONTIGUOUS_CLEAN = CleanLayout("contiguous", "one contiguous chunk per member (an ablation)", 1)
CLEAN_LAYOUTS = Registry("--csbp-clean-layout", ZIGZAG, CONTIGUOUS_CLEAN)
