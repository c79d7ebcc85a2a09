"""Packed documents train exactly as the same documents one per sequence (padded): one Megatron training step
of a packed batch under `--reset-position-ids --reset-attention-mask --eod-mask-loss` gives the loss, every
gradient and every parameter after the optimizer step of the unpacked batch on one rank (<= 1e-5 relative,
fp32), on one rank and under CSBP2 (both transports), the CP and BP baselines, CSBP P=4 C=2, TP2 x CSBP2 and
PP2 x CSBP2. Documents end with EOD and are padded to block multiples (the README's choice), so each keeps
its blocks; each document's noise is given the same in both placements (a noise table by sample). Negative
control: the packed batch without `--reset-attention-mask` (documents see each other) must not match.
"""

import dataclasses

import torch

from megatron_step import MASK, VOCAB, Topology, run_steps, train_step, worst_error
from spawn import run_ranks

SEQ, BLOCK, EOD = 32, 4, 62
TOLERANCE = 1e-5
PACKED = [[8, 12, 12], [16, 8, 8]]  # document lengths (EOD included) of the two packed samples
PACKED_INDEX, SEPARATE_INDEX = 100, 200


def _documents():
    """The 6 documents (token lists ending with EOD), in packing order."""
    generator = torch.Generator().manual_seed(5)
    return [torch.cat([torch.randint(0, EOD, (n - 1,), generator=generator), torch.tensor([EOD])])
            for sample in PACKED for n in sample]


def _noise_table():
    """Noise by sample index: the packed samples draw theirs; document k alone (sample SEPARATE_INDEX + k)
    gets the times and MASK positions its blocks have in the pack (its padding: anything, never seen)."""
    from megatron_csbp.bdlm.objective import BDLMObjective, Noise

    drawn = BDLMObjective(block_size=BLOCK, mask_token_id=MASK, seed=99).noise(
        torch.arange(len(PACKED)) + PACKED_INDEX, SEQ)
    table = {PACKED_INDEX + i: (drawn.t[i], drawn.masked[i]) for i in range(len(PACKED))}
    k = 0
    for i, sample in enumerate(PACKED):
        start = 0
        for n in sample:
            t = torch.full((SEQ // BLOCK,), 0.5, dtype=torch.float64)
            masked = torch.zeros(SEQ, dtype=torch.bool)
            t[:n // BLOCK] = drawn.t[i, start // BLOCK:(start + n) // BLOCK]
            masked[:n] = drawn.masked[i, start:start + n]
            table[SEPARATE_INDEX + k] = (t, masked)
            start, k = start + n, k + 1
    return table


def _objective(name="bd3lm"):
    from megatron_csbp.bdlm.objective import BDLMObjective, Noise

    table = _noise_table()

    class TabledNoise(BDLMObjective):
        def noise(self, sample_index, seq_length):
            rows = [table[i] for i in torch.as_tensor(sample_index).reshape(-1).tolist()]
            return Noise(torch.stack([t for t, _ in rows]), torch.stack([m for _, m in rows]))

    return TabledNoise(block_size=BLOCK, mask_token_id=MASK, seed=99, objective=name)


def _batches(packed, dp_rank, dp_size):
    documents = _documents()
    if packed:
        tokens = torch.stack([torch.cat(documents[i * 3:(i + 1) * 3]) for i in range(len(PACKED))])
        index, micro = torch.arange(len(PACKED)) + PACKED_INDEX, 2
    else:  # one document per sequence, padded with EOD (never supervised, never seen by the document)
        tokens = torch.stack([torch.cat([d, torch.full((SEQ - d.numel(),), EOD)]) for d in documents])
        index, micro = torch.arange(len(documents)) + SEPARATE_INDEX, 2
    batches = [{"tokens": tokens[m:m + micro], "sample_index": index[m:m + micro]}
               for m in range(0, tokens.shape[0], micro)]
    per_rank = len(batches) // dp_size
    return batches[dp_rank * per_rank:(dp_rank + 1) * per_rank]


@dataclasses.dataclass(frozen=True)
class Run:
    topology: Topology
    packed: bool
    separate_documents: bool = True  # False: negative control (documents attend to each other)
    objective: str = "bd3lm"


def _train_step(run, weights):
    """One Megatron training step (`megatron_step.train_step`) of the packed or the unpacked batch; the one-rank
    reference ("reference" topology) runs the op on one rank, as packing is the op's business."""
    from megatron.core import parallel_state as mpu

    from megatron_csbp.bdlm.forward_step import BDLMForwardStep, Packing
    from megatron_csbp.core.layout import layout_for
    from megatron_csbp.mcore import parallel_state
    from megatron_csbp.mcore.model import model_provider

    def build_model(topology, config):
        layout = layout_for("csbp" if topology.mode == "reference" else topology.mode, SEQ, BLOCK,
                            topology.block_parallel, topology.clean_shards, rank=mpu.get_context_parallel_rank())
        model = model_provider(config=config, layout=layout, group=parallel_state.get_block_parallel_groups(),
                               transport=topology.transport, pre_process=mpu.is_pipeline_first_stage(),
                               post_process=mpu.is_pipeline_last_stage(), vocab_size=VOCAB, mask_token_id=MASK,
                               share_embeddings_and_output_weights=True, per_sample_positions=run.packed)
        return model, layout

    packing = Packing(EOD, reset_position_ids=run.packed, reset_attention_mask=run.packed and run.separate_documents,
                      eod_mask_loss=True)
    objective = _objective(run.objective)
    return train_step(run.topology, weights, build_model,
                      lambda layout: BDLMForwardStep(objective, layout, packing=packing),
                      lambda dp_rank, dp_size: _batches(run.packed, dp_rank, dp_size),
                      2 * (2 if run.objective == "fast-dllm-v2" else 1))


ONE = Topology("one rank", mode="reference")
WORLD_2 = [Topology("csbp P=C=2", block_parallel=2, clean_shards=2),
           Topology("csbp P=C=2 streaming", block_parallel=2, clean_shards=2, transport="streaming"),
           Topology("cp baseline 2", mode="cp", block_parallel=2, clean_shards=2),
           Topology("bp baseline 2", mode="bp", block_parallel=2, clean_shards=1)]
WORLD_4 = [Topology("csbp P=4 C=2", block_parallel=4, clean_shards=2),
           Topology("csbp P=4 C=2 streaming", block_parallel=4, clean_shards=2, transport="streaming"),
           Topology("tp2 x csbp2", tp=2, block_parallel=2, clean_shards=2),
           Topology("pp2 x csbp2 (1f1b)", pp=2, block_parallel=2, clean_shards=2)]


def _reference():
    """The unpacked batch on one rank, then the packed batch and the control on one rank, from the same weights."""
    separate, packed, control = run_ranks(run_steps, 1, _train_step,
                                          [Run(ONE, False), Run(ONE, True), Run(ONE, True, False)], None,
                                          timeout=300)[0]
    return separate, packed, control


def test_packed_equals_separate_on_one_rank_and_control_differs():
    separate, packed, control = _reference()
    error, control_error = worst_error([packed], separate), worst_error([control], separate)
    print(f"packed, one rank: loss {packed['loss']:.6f} vs {separate['loss']:.6f}, worst relative error {error:.2e}; "
          f"control {control_error:.2e}")
    assert error <= TOLERANCE
    assert control_error > 1e-3


def test_packed_equals_separate_under_fast_dllm_v2_on_one_rank():
    """Shifted targets: a document's last row predicts nothing across the boundary, as alone its EOD padding."""
    separate, packed = run_ranks(run_steps, 1, _train_step, [Run(ONE, False, objective="fast-dllm-v2"),
                                                             Run(ONE, True, objective="fast-dllm-v2")], None,
                                 timeout=300)[0]
    error = worst_error([packed], separate)
    print(f"packed, fast-dllm-v2, one rank: worst relative error {error:.2e}")
    assert error <= TOLERANCE


def _check(world_size, topologies):
    separate, _, _ = _reference()
    results = run_ranks(run_steps, world_size, _train_step, [Run(t, True) for t in topologies], separate["initial"],
                        timeout=900)
    for index, topology in enumerate(topologies):
        error = worst_error([results[rank][index] for rank in range(world_size)], separate)
        print(f"packed, {topology.name}: worst relative error {error:.2e}")
        assert error <= TOLERANCE, f"{topology.name}: relative error {error:.2e}"


def test_packed_equals_separate_world_2():
    _check(2, WORLD_2)


def test_packed_equals_separate_world_4():
    _check(4, WORLD_4)
