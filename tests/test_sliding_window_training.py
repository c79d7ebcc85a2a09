"""Training a model with sliding-window layers, one global layer in three (`window_size (LEFT, 0)`,
`window_attn_skip_freq 3`, megatron-core's reading): one Megatron training step under CSBP2 (both transports),
the field's CP2, cp-traffic2, BP2, P=4 C=2, TP2xCSBP2+SP, PP2xCSBP2 (1F1B) and DP2xCSBP2 equals one rank whose core
attention is a dense windowed mask written from the definition: the loss, every gradient and every updated
parameter, <= 1e-5 relative. Control: the same layout with every layer global misses.
"""

import pytest
import torch

from megatron_step import BLOCK, MASK, SEQ, VOCAB, Topology, _config, micro_batches, run_steps, train_step, worst_error
from spawn import run_ranks

MICRO_BATCH, NUM_MICRO = 2, 4
TOLERANCE = 1e-5
LEFT, SKIP = 6, 3  # a window over a block and a half, short of a C=2 chunk (SEQ/4 = 8); layer 3 of 4 global

REFERENCE = Topology("reference", mode="reference")
WORLD_2 = [Topology("csbp P=C=2", block_parallel=2, clean_shards=2),
           Topology("csbp P=C=2 streaming", block_parallel=2, clean_shards=2, transport="streaming"),
           Topology("cp baseline 2", mode="cp", block_parallel=2, clean_shards=2),
           Topology("cp-traffic 2", mode="cp-traffic", block_parallel=2, clean_shards=2),
           Topology("bp baseline 2", mode="bp", block_parallel=2, clean_shards=1),
           Topology("control: every layer global", block_parallel=2, clean_shards=2, transport="global")]
WORLD_4 = [Topology("csbp P=4 C=2", block_parallel=4, clean_shards=2),
           Topology("csbp P=4 C=2 streaming", block_parallel=4, clean_shards=2, transport="streaming"),
           Topology("tp2 x csbp2 + sp", tp=2, block_parallel=2, clean_shards=2, sequence_parallel=True),
           Topology("pp2 x csbp2 (1f1b)", pp=2, block_parallel=2, clean_shards=2),
           Topology("dp2 x csbp2", block_parallel=2, clean_shards=2)]


def _windowed_config(topology):
    if topology.transport == "global":
        return _config(topology)
    return _config(topology, window_size=(LEFT, 0), window_attn_skip_freq=SKIP)


def _dense_windowed_attention():
    """A core attention computing the BDLM mask of its layer densely from the layout's rows: in a sliding layer a
    noisy row of block `b` sees the clean keys `bB - LEFT .. bB - 1`, a (block-causal) clean row of block `b` the
    clean keys `bB - LEFT .. (b+1)B - 1`; in a global layer (every `SKIP`-th, counting from 1) the clean blocks
    before (noisy) or up to (clean) its own."""
    from megatron.core.transformer.module import MegatronModule

    class DenseWindowed(MegatronModule):
        def __init__(self, config, layer_number, *args, layout=None, **kwargs):
            super().__init__(config=config)
            self.layout, self.sliding = layout, layer_number % SKIP != 0

        def forward(self, query, key, value, attention_mask, **kwargs):
            position, clean = self.layout.row_positions, self.layout.row_is_clean
            block = position // self.layout.block_size
            qb, kb, kp = block[:, None], block[None, :], position[None, :]
            qc, kc = clean[:, None], clean[None, :]
            allowed = (~qc & ~kc & (kb == qb)) | (~qc & kc & (kb < qb)) | (qc & kc & (kb <= qb))
            if self.sliding:
                allowed &= ~kc | (kp >= qb * self.layout.block_size - LEFT)
            group = query.shape[2] // key.shape[2]
            key, value = key.repeat_interleave(group, 2), value.repeat_interleave(group, 2)
            scores = torch.einsum("sbhd,tbhd->bhst", query, key) / query.shape[-1] ** 0.5
            out = torch.einsum("bhst,tbhd->sbhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), value)
            return out.reshape(out.shape[0], out.shape[1], -1)

    return DenseWindowed


def _build_model(topology, config):
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_csbp.core.layout import CSBPLayout, layout_for
    from megatron_csbp.mcore import parallel_state
    from megatron_csbp.mcore.model import BDLMGPTModel, model_provider
    from megatron_csbp.mcore.spec import get_csbp_layer_spec

    stages = dict(pre_process=mpu.is_pipeline_first_stage(), post_process=mpu.is_pipeline_last_stage())
    common = dict(vocab_size=VOCAB, mask_token_id=MASK, share_embeddings_and_output_weights=True)
    if topology.mode == "reference":
        layout = CSBPLayout(topology.seq, topology.block, 1, 1, 0)
        spec = get_csbp_layer_spec()
        spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
            module=_dense_windowed_attention(), params={"layout": layout})
        model = BDLMGPTModel(config=config, transformer_layer_spec=spec, max_sequence_length=topology.seq,
                             position_embedding_type="rope", layout=layout, **stages, **common)
        return model, layout
    layout = layout_for(topology.mode, topology.seq, topology.block, topology.block_parallel, topology.clean_shards,
                        rank=mpu.get_context_parallel_rank())
    transport = "collective" if topology.transport == "global" else topology.transport
    model = model_provider(config=config, layout=layout, group=parallel_state.get_block_parallel_groups(),
                           transport=transport, **stages, **common)
    return model, layout


def _batches(dp_rank, dp_size):
    return micro_batches(dp_rank, dp_size, micro_batch=MICRO_BATCH, num_micro=NUM_MICRO, seed=2025)


def _train_step(topology, weights):
    from megatron_csbp.bdlm.forward_step import BDLMForwardStep
    from megatron_csbp.bdlm.objective import BDLMObjective

    objective = BDLMObjective(block_size=topology.block, mask_token_id=MASK, seed=99)
    return train_step(topology, weights, _build_model, lambda layout: BDLMForwardStep(objective, layout),
                      _batches, MICRO_BATCH, make_config=_windowed_config)


@pytest.fixture(scope="module")
def reference():
    assert SEQ // 4 > LEFT > BLOCK and SEQ % BLOCK == 0
    return run_ranks(run_steps, 1, _train_step, [REFERENCE], None, timeout=300)[0][0]


def _check_world(world_size, topologies, reference, timeout):
    results = run_ranks(run_steps, world_size, _train_step, topologies, reference["initial"], timeout=timeout)
    for index, topology in enumerate(topologies):
        error = worst_error([results[rank][index] for rank in range(world_size)], reference)
        print(f"{topology.name}: worst relative error {error:.2e}")
        if topology.name.startswith("control"):
            assert error > 1e-3, f"{topology.name} should not match the reference ({error:.2e})"
        else:
            assert error <= TOLERANCE, f"{topology.name}: relative error {error:.2e}"


def test_world_2_sliding_window_step_equals_one_rank(reference):
    _check_world(2, WORLD_2, reference, timeout=600)


def test_world_4_sliding_window_step_equals_one_rank(reference):
    _check_world(4, WORLD_4, reference, timeout=900)
