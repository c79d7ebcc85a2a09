"""The block-parallel dimension sits in Megatron's CP slot; rings and clean-replica groups are carved from it."""

import pytest

from spawn import on_cpu_backend, run_ranks


@on_cpu_backend
def _groups_on_four_ranks(rank, world_size):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from megatron_csbp.mcore import parallel_state

    ranks_of = dist.get_process_group_ranks
    seen = {}

    parallel_state.initialize_model_parallel(context_block_parallel_size=4, clean_shards=2)
    assert parallel_state.get_block_parallel_group() is mpu.get_context_parallel_group()
    assert parallel_state.get_block_parallel_groups().block_parallel is mpu.get_context_parallel_group()
    assert parallel_state.get_block_parallel_world_size() == 4 and parallel_state.get_clean_shards() == 2
    assert parallel_state.get_block_parallel_rank() == rank
    seen["ring"] = ranks_of(parallel_state.get_ring_group())
    seen["replica"] = ranks_of(parallel_state.get_clean_replica_group())
    total = torch.tensor([float(rank)])
    dist.all_reduce(total, group=parallel_state.get_ring_group())
    seen["ring_sum"] = total.item()
    # Megatron reduces replicated-weight grads over dp x cp: all four block ranks, not one ring.
    seen["grad_reduction"] = ranks_of(mpu.get_data_parallel_group(with_context_parallel=True))
    parallel_state.destroy_model_parallel()
    assert not parallel_state.is_initialized()

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, context_block_parallel_size=2)
    seen["tp2_block"] = ranks_of(parallel_state.get_block_parallel_group())
    seen["tp2_ring"] = ranks_of(parallel_state.get_ring_group())
    seen["tp2_tp"] = ranks_of(mpu.get_tensor_model_parallel_group())
    parallel_state.destroy_model_parallel()

    for bad, message in [(dict(context_block_parallel_size=4, clean_shards=3),
                          "--context-block-parallel 4 is not a multiple of --context-block-parallel-clean-shards 3"),
                         (dict(context_parallel_size=4), "context_block_parallel_size")]:
        with pytest.raises(ValueError, match=message):
            parallel_state.initialize_model_parallel(**bad)
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        parallel_state.get_ring_group()
    return seen


def test_block_parallel_groups_on_four_ranks():
    results = run_ranks(_groups_on_four_ranks, 4, timeout=300)
    for rank, seen in enumerate(results):
        ring = [0, 1] if rank < 2 else [2, 3]
        assert seen["ring"] == ring
        assert seen["ring_sum"] == sum(ring)
        assert seen["replica"] == [rank % 2, rank % 2 + 2]
        assert seen["grad_reduction"] == [0, 1, 2, 3]
        # order tp-cp-ep-dp-pp: TP neighbours are consecutive ranks, block ranks stride over them
        assert seen["tp2_tp"] == ([0, 1] if rank < 2 else [2, 3])
        assert seen["tp2_block"] == [rank % 2, rank % 2 + 2]
        assert seen["tp2_ring"] == seen["tp2_block"]


@on_cpu_backend
def _timeouts(rank, world_size):
    """Rank 1 stays away from two collectives: on a group Megatron made (CP) and on one we made (clean
    replicas, C = 1). Rank 0 must give up on each within the timeout given to initialize_model_parallel."""
    import time

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from megatron_csbp.mcore import parallel_state

    parallel_state.initialize_model_parallel(context_block_parallel_size=2, clean_shards=1,
                                             distributed_timeout_minutes=3 / 60)
    waited = {}
    if rank == 0:
        for name, group in (("ours", parallel_state.get_clean_replica_group()),
                            ("megatron", mpu.get_context_parallel_group())):
            started = time.time()
            try:
                dist.all_reduce(torch.ones(1), group=group)
                waited[name] = None
            except RuntimeError:
                waited[name] = time.time() - started
    else:
        time.sleep(20)  # alive, connected, silent: only a timeout can end rank 0's wait
    return waited


def test_every_group_gets_the_distributed_timeout():
    waited = run_ranks(_timeouts, 2, timeout=120)[0]
    for name in ("ours", "megatron"):  # 3 s asked; Megatron's default would be 30 minutes
        assert waited[name] is not None and 2 <= waited[name] < 10, waited
