"""The block-parallel dimension of CSBP, living in Megatron's context-parallel (CP) slot.

Block parallelism shards the sequence and replicates the weights, exactly like CP, so giving it the
CP slot keeps Megatron's DP x CP gradient reduction, token counting, pipeline shapes and checkpoint
replicas correct with no change to Megatron. This module adds only what CSBP needs beyond a CP
group: the rings of `C` consecutive block ranks (one clean-sequence copy each) and the
clean-replica groups (same ring position, different rings).
"""

import datetime

import torch.distributed as dist
from megatron.core import parallel_state as mpu

from megatron_csbp.core import modes, process_groups, rules

_groups = {}


def initialize_run(settings, distributed_timeout_minutes=30, **megatron_kwargs):
    """Megatron's parallel state and the CSBP sub-groups of the run `settings` (a `core.run_config.RunConfig`):
    its TP, PP, P (in the CP slot), C, EP and ETP."""
    initialize_model_parallel(settings.tensor_parallel_size, settings.pipeline_parallel_size,
                              settings.block_parallel_size, settings.clean_shards, distributed_timeout_minutes,
                              expert_model_parallel_size=settings.expert_parallel_size,
                              expert_tensor_parallel_size=settings.expert_tensor_parallel_size, **megatron_kwargs)


def initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                              context_block_parallel_size=1, clean_shards=None, distributed_timeout_minutes=30,
                              **megatron_kwargs):
    """Megatron's `initialize_model_parallel` with CP size `P`, then the CSBP sub-groups.

    `clean_shards` (`C`, default `P`) must divide `P` (checked before any group is made). Every world rank must
    call this. Every group, Megatron's and ours, gets `distributed_timeout_minutes` (a float is fine; Megatron's
    own default is 30).
    """
    block_parallel_size = context_block_parallel_size
    clean_shards = block_parallel_size if clean_shards is None else clean_shards
    if "context_parallel_size" in megatron_kwargs:
        raise ValueError("pass context_block_parallel_size=P, not context_parallel_size: the "
                         "block-parallel dimension occupies Megatron's CP slot")
    _check_clean_shards(block_parallel_size, clean_shards)
    mpu.initialize_model_parallel(tensor_model_parallel_size=tensor_model_parallel_size,
                                  pipeline_model_parallel_size=pipeline_model_parallel_size,
                                  context_parallel_size=block_parallel_size,
                                  distributed_timeout_minutes=distributed_timeout_minutes, **megatron_kwargs)
    initialize_block_parallel_groups(clean_shards, distributed_timeout_minutes)


def initialize_block_parallel_groups(clean_shards, distributed_timeout_minutes=30):
    """Builds the ring and clean-replica groups out of Megatron's existing CP groups.

    For callers (e.g. Megatron-LM's `pretrain`) that already initialised Megatron with
    `context_parallel_size=P`. Collective over the world: all ranks create the same groups in the
    same order.
    """
    _check_clean_shards(mpu.get_context_parallel_world_size(), clean_shards)
    every_rank_lists = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank_lists, list(mpu.get_context_parallel_global_ranks()))
    block_parallel_ranks_lists = sorted({tuple(ranks) for ranks in every_rank_lists})
    groups = process_groups.new_block_parallel_groups([list(r) for r in block_parallel_ranks_lists],
                                                      clean_shards, mpu.get_context_parallel_group(),
                                                      timeout=datetime.timedelta(minutes=distributed_timeout_minutes))
    _groups.update(groups=groups, clean_shards=clean_shards)


def _check_clean_shards(block_parallel_size, clean_shards):
    """C rings of P: the rule every layout obeys (`rules.clean_shards_problem`), for callers without a RunConfig."""
    rules.refuse(rules.clean_shards_problem(modes.CSBP, block_parallel_size, clean_shards))


def _get(name):
    if name not in _groups:
        raise RuntimeError("block-parallel groups are not initialised: call "
                           "megatron_csbp.mcore.parallel_state.initialize_model_parallel(...) first")
    return _groups[name]


def is_initialized() -> bool:
    return "groups" in _groups


def get_block_parallel_groups() -> process_groups.BlockParallelGroups:
    """What the CSBP op takes as `group`: the block-parallel, ring and clean-replica groups."""
    return _get("groups")


def get_block_parallel_group():
    return mpu.get_context_parallel_group()


def get_block_parallel_rank() -> int:
    return mpu.get_context_parallel_rank()


def get_block_parallel_world_size() -> int:
    return mpu.get_context_parallel_world_size()


def get_clean_shards() -> int:
    return _get("clean_shards")


def get_ring_group():
    return _get("groups").ring


def get_clean_replica_group():
    return _get("groups").clean_replica


def destroy_model_parallel() -> None:
    _groups.clear()
    mpu.destroy_model_parallel()
