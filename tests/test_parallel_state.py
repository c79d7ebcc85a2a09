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


TIMEOUT_S = 20  # what the groups are given: roomy enough for gloo to create them on a loaded machine


def _process_groups(namespace) -> dict:
    """{name: group} of every process group held in a module's globals (alone, in lists or in dataclasses)."""
    import dataclasses

    import torch.distributed as dist

    found = {}
    for name, value in vars(namespace).items():
        values = value if isinstance(value, (list, tuple)) else [value]
        for i, item in enumerate(values):
            if isinstance(item, dict):
                for key, inner in item.items():
                    found.update(_process_groups(type("held", (), {f"{name}.{key}": inner})))
            elif dataclasses.is_dataclass(item) and not isinstance(item, type):
                found.update({f"{name}.{field}": group for field, group in vars(item).items()
                              if isinstance(group, dist.ProcessGroup)})
            elif isinstance(item, dist.ProcessGroup):
                found[f"{name}[{i}]" if len(values) > 1 else name] = item
    return found


@on_cpu_backend
def _timeouts(rank, world_size):
    """Every group Megatron made and every group we made, created with the timeout given; and what ends a wait:
    rank 1 stays away from a collective on one of each, rank 0 must give up on both within that timeout."""
    import datetime
    import time

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from megatron_csbp.mcore import parallel_state

    parallel_state.initialize_model_parallel(context_block_parallel_size=2, clean_shards=1,
                                             distributed_timeout_minutes=TIMEOUT_S / 60)
    created = {}
    # megatron-core 0.16.1 creates its expert-data-parallel gloo groups (MoE experts' optimizer state) without
    # the timeout (parallel_state.py, `create_group(ranks, backend="gloo", group_desc=...)`): named apart
    untimed = {id(getattr(mpu, name)) for name in ("_EXPERT_DATA_PARALLEL_GROUP_GLOO",
                                                   "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO")}
    for owner, module in (("megatron", mpu), ("ours", parallel_state)):
        for name, group in _process_groups(module).items():
            if group is not dist.group.WORLD:
                key = "megatron-expert-gloo" if id(group) in untimed else owner
                created[f"{key}:{name}"] = group._get_backend(torch.device("cpu")).options._timeout
    world = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout  # negative control
    waited, store = None, dist.distributed_c10d._get_default_store()
    if rank == 0:
        started = time.time()
        pending = [dist.all_reduce(torch.ones(1), group=group, async_op=True)
                   for group in (parallel_state.get_clean_replica_group(), mpu.get_context_parallel_group())]
        waited = []
        for work in pending:
            try:
                work.wait()
                waited.append(None)
            except RuntimeError:
                waited.append(time.time() - started)
        store.set("rank 0 gave up", "yes")
    else:  # alive, connected, silent on both groups: only a timeout can end rank 0's wait
        store.wait(["rank 0 gave up"], datetime.timedelta(seconds=TIMEOUT_S + 120))
    return {"created": created, "world": world, "waited": waited}


def test_every_group_gets_the_distributed_timeout():
    import datetime

    result = run_ranks(_timeouts, 2, timeout=300)[0]
    created = result["created"]
    assert {"ours:_groups.groups.clean_replica", "megatron:_CONTEXT_PARALLEL_GROUP"} <= set(created), sorted(created)
    assert len(created) >= 8, sorted(created)
    wrong = {name: timeout for name, timeout in created.items() if timeout != datetime.timedelta(seconds=TIMEOUT_S)
             and not name.startswith("megatron-expert-gloo:")}
    assert not wrong, wrong  # Megatron's default would be 30 minutes
    assert result["world"] != datetime.timedelta(seconds=TIMEOUT_S)  # the lookup reads each group's own value
    waits = result["waited"]  # both collectives started together: each gives up at the timeout, not later
    assert all(w is not None and TIMEOUT_S - 1 <= w < TIMEOUT_S + 15 for w in waits), waits
