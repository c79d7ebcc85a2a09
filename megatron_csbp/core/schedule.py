"""CSBP's schedules: which noisy blocks each block-parallel rank owns (docs/algorithm.md §4).

Standard library only: the layouts (`core.layout`) and the modes' analytic kernel counts
(`core.modes.ParallelMode.kernel_calls`, which the planner runs without torch) deal the blocks the same way.
"""


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
