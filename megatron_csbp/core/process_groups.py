"""The process groups CSBP needs beside the block-parallel group itself.

With `P = k·C` the clean sequence is sharded over rings of `C` consecutive block-parallel ranks; clean
K/V only ever travel inside a ring. Ranks at the same ring position in different rings are clean
replicas. `torch.distributed.new_group` is collective over the whole world, so these groups are made
once, up front, by every rank (`new_block_parallel_groups`), never lazily inside a layer.
"""

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class BlockParallelGroups:
    """This rank's block-parallel group (P ranks), its ring (C ranks) and its clean-replica group (P/C)."""

    block_parallel: dist.ProcessGroup | None
    ring: dist.ProcessGroup | None
    clean_replica: dist.ProcessGroup | None


def new_block_parallel_groups(block_parallel_ranks: list[list[int]], clean_shards: int,
                              block_parallel_group: dist.ProcessGroup | None = None,
                              timeout=None) -> BlockParallelGroups:
    """Builds the ring and clean-replica groups of every block-parallel group; every rank must call it.

    `block_parallel_ranks` lists the global ranks of each block-parallel group, in layout order.
    Pass `block_parallel_group` when it already exists (Megatron's CP group) to avoid making it again.
    `timeout` (a `timedelta`; default torch's) bounds every collective of these groups.
    """
    me = dist.get_rank()
    mine = {"block_parallel": block_parallel_group, "ring": None, "clean_replica": None}
    for ranks in block_parallel_ranks:
        size = len(ranks)
        if size % clean_shards:
            raise ValueError(f"a block-parallel group of {size} ranks cannot hold rings of clean_shards={clean_shards}")
        group = dist.new_group(ranks, timeout=timeout) if block_parallel_group is None else None
        rings = [ranks[i:i + clean_shards] for i in range(0, size, clean_shards)]
        replicas = [ranks[i::clean_shards] for i in range(clean_shards)]
        ring_groups = [dist.new_group(ring, timeout=timeout) if 1 < clean_shards < size else None for ring in rings]
        replica_groups = [dist.new_group(replica, timeout=timeout) if clean_shards < size else None
                          for replica in replicas]
        if me not in ranks:
            continue
        if block_parallel_group is None:
            mine["block_parallel"] = group
        position = ranks.index(me)
        ring = ring_groups[position // clean_shards]
        mine["ring"] = mine["block_parallel"] if clean_shards == size else ring
        mine["clean_replica"] = replica_groups[position % clean_shards]
    return BlockParallelGroups(**mine)


def ring_group_of(group, layout) -> dist.ProcessGroup | None:
    """The group clean K/V travel in for `layout`: the whole group when there is one ring, none for `C = 1`."""
    if layout.clean_shards == 1:
        return None
    if isinstance(group, BlockParallelGroups):
        return group.ring
    if layout.num_rings == 1:
        return group
    raise ValueError(f"block_parallel_size={layout.block_parallel_size} with clean_shards={layout.clean_shards} "
                     "needs ring sub-groups: pass group=new_block_parallel_groups(...) "
                     "(or megatron_csbp.mcore.parallel_state's groups) instead of a plain process group")
