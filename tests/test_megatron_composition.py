"""One Megatron training step under every composition equals a single-process reference.

Each composition (CSBP, P=4 C=2, TP2, TP2+SP, PP2 1F1B, DP2, the CP and BP baselines) runs one step of a
small GQA/RoPE GPTModel (tied embeddings) through megatron-core's DDP, `finalize_model_grads`, `get_forward_backward_func`
and `get_megatron_optimizer` with the BDLM forward step, starting from the reference's weights (loaded
by global layer number). Loss, every parameter's gradient (gathered over TP) and every parameter after
the optimizer step must match the reference to 1e-5 relative. The reference is a one-rank model whose
core attention is a dense softmax under a BD3-LM mask written here, independently of the CSBP op.
Negative control: keeping Megatron's own RoPE (zigzag CP slicing) must break the match.
"""

import pytest
import torch

from megatron_step import BLOCK, MASK, SEQ, VOCAB, Topology, micro_batches, run_steps, train_step, worst_error
from spawn import run_ranks

MICRO_BATCH, NUM_MICRO = 2, 6  # global batch: 12 samples
TOLERANCE = 1e-5


REFERENCE = Topology("reference", mode="reference")
# 30 tokens in blocks of 3 under BP2: 45 rows per rank, padded to 46 for sequence parallelism over TP2.
ODD_ROWS = dict(seq=30, block=3)
REFERENCE_ODD_ROWS = Topology("reference, odd rows", mode="reference", **ODD_ROWS)
WORLD_2 = [
    Topology("csbp P=C=2", block_parallel=2, clean_shards=2),
    Topology("csbp P=C=2 streaming", block_parallel=2, clean_shards=2, transport="streaming"),
    Topology("cp baseline 2", mode="cp", block_parallel=2, clean_shards=2),
    Topology("cp baseline 2 streaming", mode="cp", block_parallel=2, clean_shards=2, transport="streaming"),
    Topology("cp-traffic 2", mode="cp-traffic", block_parallel=2, clean_shards=2),
    Topology("bp baseline 2", mode="bp", block_parallel=2, clean_shards=1),
    Topology("control: Megatron RoPE", block_parallel=2, clean_shards=2, megatron_rope=True),
]
WORLD_4 = [
    Topology("csbp P=4 C=2", block_parallel=4, clean_shards=2),
    Topology("tp2 x csbp2", tp=2, block_parallel=2, clean_shards=2),
    Topology("tp2 x csbp2 + sp", tp=2, block_parallel=2, clean_shards=2, sequence_parallel=True),
    Topology("pp2 x csbp2 (1f1b)", pp=2, block_parallel=2, clean_shards=2),
    Topology("dp2 x csbp2", block_parallel=2, clean_shards=2),
    Topology("tp2 x cp2 + sp", mode="cp", tp=2, block_parallel=2, clean_shards=2, sequence_parallel=True),
    Topology("tp2 x bp2 + sp, padded rows", mode="bp", tp=2, block_parallel=2, clean_shards=1,
             sequence_parallel=True, **ODD_ROWS),
]


def dense_bdlm_attention_class():
    """A core attention computing BD3-LM attention densely from the layout's row positions."""
    from megatron.core.transformer.module import MegatronModule

    class DenseBDLMAttention(MegatronModule):
        def __init__(self, config, layer_number, *args, layout=None, **kwargs):
            super().__init__(config=config)
            self.layout = layout

        def forward(self, query, key, value, attention_mask, **kwargs):
            block = self.layout.row_positions // self.layout.block_size
            clean = self.layout.row_is_clean
            qb, kb, qc, kc = block[:, None], block[None, :], clean[:, None], clean[None, :]
            allowed = (~qc & ~kc & (kb == qb)) | (~qc & kc & (kb < qb)) | (qc & kc & (kb <= qb))
            group = query.shape[2] // key.shape[2]
            key, value = key.repeat_interleave(group, 2), value.repeat_interleave(group, 2)
            scores = torch.einsum("sbhd,tbhd->bhst", query, key) / query.shape[-1] ** 0.5
            probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
            out = torch.einsum("bhst,tbhd->sbhd", probs, value)
            return out.reshape(out.shape[0], out.shape[1], -1)

    return DenseBDLMAttention


def _build_model(topology, config):
    """The BDLM of `topology`: the model provider's, or (reference) the same layer specs with dense BD3-LM
    attention on one rank."""
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_csbp.mcore import parallel_state
    from megatron_csbp.core.layout import CSBPLayout, layout_for
    from megatron_csbp.mcore.gemma4_moe import get_gemma4_block_spec
    from megatron_csbp.mcore.model import BDLMGPTModel, model_provider
    from megatron_csbp.mcore.spec import get_csbp_block_spec, get_csbp_layer_spec

    stages = dict(pre_process=mpu.is_pipeline_first_stage(), post_process=mpu.is_pipeline_last_stage())
    common = dict(vocab_size=VOCAB, mask_token_id=MASK, share_embeddings_and_output_weights=True,
                  logits_tile_rows=topology.logits_tile_rows)
    if topology.mode == "reference":
        layout = CSBPLayout(topology.seq, topology.block, 1, 1, 0, schedule="contiguous", clean_layout="contiguous")
        dense = ModuleSpec(module=dense_bdlm_attention_class(), params={"layout": layout})
        # a mixture of experts: a spec per layer, MoE layers where config.moe_layer_freq puts them
        block_spec = get_gemma4_block_spec if getattr(config, "gemma4_moe", False) else get_csbp_block_spec
        spec = block_spec(config) if config.num_moe_experts else get_csbp_layer_spec()
        for layer_spec in getattr(spec, "layer_specs", [spec]):
            layer_spec.submodules.self_attention.submodules.core_attention = dense
        model = BDLMGPTModel(config=config, transformer_layer_spec=spec, max_sequence_length=topology.seq,
                             position_embedding_type="rope", layout=layout, **stages, **common)
    else:
        layout = layout_for(topology.mode, topology.seq, topology.block, topology.block_parallel,
                            topology.clean_shards, rank=mpu.get_context_parallel_rank())
        model = model_provider(config=config, layout=layout, group=parallel_state.get_block_parallel_groups(),
                               transport=topology.transport, **stages, **common)
    if topology.megatron_rope:
        model.rotary_pos_emb = model.rotary_pos_emb.rotary
    return model, layout


def _batches(seq, dp_rank, dp_size):
    return micro_batches(dp_rank, dp_size, micro_batch=MICRO_BATCH, num_micro=NUM_MICRO, seq=seq, seed=2024)


def _train_step(topology, weights):
    """One Megatron training step (`megatron_step.train_step`) and the noise this rank drew in it."""
    from megatron_csbp.bdlm.forward_step import BDLMForwardStep

    objective = _noise_recording_objective()(block_size=topology.block, mask_token_id=MASK, seed=99)
    _NOISE_SEEN.clear()
    result = train_step(topology, weights, _build_model, lambda layout: BDLMForwardStep(objective, layout),
                        lambda dp_rank, dp_size: _batches(topology.seq, dp_rank, dp_size), MICRO_BATCH)
    return dict(result, noise=dict(_NOISE_SEEN))


_NOISE_SEEN = {}  # sample index -> (noise times, masked positions) this rank drew in the step


def _noise_recording_objective():
    from megatron_csbp.bdlm.objective import BDLMObjective

    class NoiseRecordingObjective(BDLMObjective):
        def noise(self, sample_index, seq_length):
            drawn = super().noise(sample_index, seq_length)
            for row, index in enumerate(sample_index.tolist()):
                _NOISE_SEEN[index] = (drawn.t[row].clone(), drawn.masked[row].clone())
            return drawn

    return NoiseRecordingObjective


def _assert_same_noise_everywhere(per_rank, topology):
    """Every rank that drew noise for a sample (TP ranks, block ranks, first and last pipeline stage)
    drew the same noise."""
    first_seen = {}
    for rank, result in enumerate(per_rank):
        for index, (t, masked) in result["noise"].items():
            if index in first_seen:
                seen_t, seen_masked = first_seen[index]
                assert (t == seen_t).all() and (masked == seen_masked).all(), \
                    f"{topology.name}: rank {rank} drew other noise for sample {index}"
            else:
                first_seen[index] = (t, masked)
    assert first_seen, f"{topology.name}: no rank drew noise"


@pytest.fixture(scope="module")
def references():
    """Reference results by (seq, block); both references start from the same weights."""
    results = run_ranks(run_steps, 1, _train_step, [REFERENCE, REFERENCE_ODD_ROWS], None, timeout=300)[0]
    return {(REFERENCE.seq, REFERENCE.block): results[0], (REFERENCE_ODD_ROWS.seq, REFERENCE_ODD_ROWS.block): results[1]}


def _check_world(world_size, topologies, references, timeout):
    """One spawn runs every topology of this world size; each must match the reference (controls must not)."""
    results = run_ranks(run_steps, world_size, _train_step, topologies, references[SEQ, BLOCK]["initial"],
                        timeout=timeout)
    for index, topology in enumerate(topologies):
        per_rank = [results[rank][index] for rank in range(world_size)]
        _assert_same_noise_everywhere(per_rank, topology)
        error = worst_error(per_rank, references[topology.seq, topology.block])
        print(f"{topology.name}: worst relative error {error:.2e}")
        if topology.megatron_rope:
            assert error > 1e-3, f"{topology.name} should not match the reference (error {error:.2e})"
        else:
            assert error <= TOLERANCE, f"{topology.name}: relative error {error:.2e}"


def test_world_2_compositions_and_negative_control(references):
    _check_world(2, WORLD_2, references, timeout=600)


def test_world_4_compositions(references):
    _check_world(4, WORLD_4, references, timeout=900)
