"""One Megatron training step under every composition equals a single-process reference.

Each composition (CSBP, P=4 C=2, TP2, TP2+SP, PP2 1F1B, DP2, the CP and BP baselines) runs one step of a
small GQA/RoPE GPTModel (tied embeddings) through megatron-core's DDP, `finalize_model_grads`, `get_forward_backward_func`
and `get_megatron_optimizer` with the BDLM forward step, starting from the reference's weights (loaded
by global layer number). Loss, every parameter's gradient (gathered over TP) and every parameter after
the optimizer step must match the reference to 1e-5 relative. The reference is a one-rank model whose
core attention is a dense softmax under a BD3-LM mask written here, independently of the CSBP op.
Negative control: keeping Megatron's own RoPE (zigzag CP slicing) must break the match.
"""

import functools
from dataclasses import dataclass

import pytest
import torch

from spawn import on_cpu_backend, run_ranks

SEQ, BLOCK, VOCAB, MASK = 32, 4, 64, 63
MICRO_BATCH, NUM_MICRO = 2, 6  # global batch: 12 samples
TOLERANCE = 1e-5


@dataclass(frozen=True)
class Topology:
    name: str
    mode: str = "csbp"  # "reference" or a --bdlm-parallel-mode: "csbp", "cp", "cp-traffic", "bp"
    tp: int = 1
    pp: int = 1
    block_parallel: int = 1
    clean_shards: int = 1
    sequence_parallel: bool = False
    transport: str = "collective"
    seq: int = SEQ
    block: int = BLOCK
    megatron_rope: bool = False  # negative control


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


def _config(topology):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
        tensor_model_parallel_size=topology.tp, pipeline_model_parallel_size=topology.pp,
        context_parallel_size=topology.block_parallel, sequence_parallel=topology.sequence_parallel,
        normalization="RMSNorm", use_cpu_initialization=True, calculate_per_token_loss=True,
        hidden_dropout=0.0, attention_dropout=0.0, pipeline_dtype=torch.float32,
        # as megatron_config.transformer_config_kwargs sets them
        variable_seq_lengths=topology.pp > 1, moe_token_dispatcher_type="alltoall" if topology.pp > 1 else "allgather")


def _build_model(topology, config):
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_csbp.mcore import parallel_state
    from megatron_csbp.core.layout import CSBPLayout, layout_for
    from megatron_csbp.mcore.model import BDLMGPTModel, model_provider
    from megatron_csbp.mcore.spec import get_csbp_layer_spec

    stages = dict(pre_process=mpu.is_pipeline_first_stage(), post_process=mpu.is_pipeline_last_stage())
    common = dict(vocab_size=VOCAB, mask_token_id=MASK, share_embeddings_and_output_weights=True)
    if topology.mode == "reference":
        layout = CSBPLayout(topology.seq, topology.block, 1, 1, 0, schedule="contiguous", clean_layout="contiguous")
        spec = get_csbp_layer_spec()
        spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
            module=dense_bdlm_attention_class(), params={"layout": layout})
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


def _global_name(model, name):
    """Parameter name with the pipeline stage's local layer index replaced by the global one; the last
    stage's copy of the tied embedding is the embedding."""
    if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
        return "embedding.word_embeddings.weight"
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(model.decoder.layers[int(parts[2])].layer_number - 1)
    return ".".join(parts)


def _full(param, tensor):
    """`tensor` (a TP shard of `param`'s shape) gathered over TP."""
    from megatron.core import parallel_state as mpu

    if not getattr(param, "tensor_model_parallel", False) or mpu.get_tensor_model_parallel_world_size() == 1:
        return tensor.detach().clone()
    shards = [torch.empty_like(tensor) for _ in range(mpu.get_tensor_model_parallel_world_size())]
    torch.distributed.all_gather(shards, tensor.detach().contiguous(), group=mpu.get_tensor_model_parallel_group())
    return torch.cat(shards, dim=param.partition_dim)


def _load(model, weights):
    from megatron.core import parallel_state as mpu

    tp_size, tp_rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    for name, param in model.named_parameters():
        full = weights[_global_name(model, name)]
        if getattr(param, "tensor_model_parallel", False) and tp_size > 1:
            full = full.chunk(tp_size, dim=param.partition_dim)[tp_rank]
        param.data.copy_(full)


def _batches(seq, dp_rank, dp_size):
    generator = torch.Generator().manual_seed(2024)
    tokens = torch.randint(0, MASK, (MICRO_BATCH * NUM_MICRO, seq), generator=generator)
    sample_index = torch.arange(MICRO_BATCH * NUM_MICRO) + 100
    per_rank = NUM_MICRO // dp_size
    return [{"tokens": tokens[m * MICRO_BATCH:(m + 1) * MICRO_BATCH],
             "sample_index": sample_index[m * MICRO_BATCH:(m + 1) * MICRO_BATCH]}
            for m in range(dp_rank * per_rank, (dp_rank + 1) * per_rank)]


def _train_step(topology, weights):
    """One Megatron training step; returns loss, gathered grads and parameters after the step."""
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_csbp.mcore import parallel_state
    from megatron_csbp.bdlm.forward_step import BDLMForwardStep
    from megatron_csbp.mcore.model import pipeline_seq_length

    parallel_state.initialize_model_parallel(topology.tp, topology.pp, context_block_parallel_size=topology.block_parallel,
                                             clean_shards=topology.clean_shards)
    try:
        torch.manual_seed(1234)
        model_parallel_cuda_manual_seed(1234)
        config = _config(topology)
        model, layout = _build_model(topology, config)
        if weights is None:  # the reference: perturb Megatron's init so norms and biases are not trivial
            generator = torch.Generator().manual_seed(7)
            for _, param in sorted(model.named_parameters()):
                param.data.add_(0.05 * torch.randn(param.shape, generator=generator))
            initial = {name: param.detach().clone() for name, param in model.named_parameters()}
        else:
            _load(model, weights)
            initial = None
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = ddp.no_sync
        # adam_eps well above rounding noise: grads that are zero in exact arithmetic (the key bias's)
        # come out ~1e-10, and Adam with eps=1e-8 would turn that noise into lr-sized updates.
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.01, adam_eps=1e-4, clip_grad=1.0,
                            params_dtype=torch.float32), [ddp])
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        batches = _batches(topology.seq, mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size())
        objective = _noise_recording_objective()(block_size=topology.block, mask_token_id=MASK, seed=99)
        _NOISE_SEEN.clear()
        reports = get_forward_backward_func()(
            forward_step_func=BDLMForwardStep(objective, layout), data_iterator=iter(batches), model=[ddp],
            # Under pipeline parallelism the clean length L stands here, as Megatron-LM's pretrain() passes
            # it: the shapes travel with the messages (variable_seq_lengths), so it must not matter.
            num_microbatches=len(batches),
            seq_length=SEQ if topology.pp > 1 else pipeline_seq_length(layout, config),
            micro_batch_size=MICRO_BATCH, forward_only=False)
        loss = None
        if mpu.is_pipeline_last_stage():
            total = torch.stack([r["lm loss"] for r in reports]).sum(0)
            torch.distributed.all_reduce(total, group=mpu.get_data_parallel_group(with_context_parallel=True))
            loss = (total[0] / total[1]).item()
        grads = {_global_name(model, n): _full(p, p.main_grad) for n, p in model.named_parameters()}
        success, grad_norm, _ = optimizer.step()
        assert success
        after = {_global_name(model, n): _full(p, p) for n, p in model.named_parameters()}
        return dict(loss=loss, grads=grads, after=after, initial=initial, grad_norm=grad_norm,
                    noise=dict(_NOISE_SEEN))
    finally:
        parallel_state.destroy_model_parallel()


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


@on_cpu_backend
def _run(rank, world_size, topologies, weights):

    if weights is not None:
        weights = {name: torch.from_numpy(array) for name, array in weights.items()}
    results = []
    for topology in topologies:
        result = _train_step(topology, weights)
        weights = weights if weights is not None else result["initial"]  # later references start from it
        results.append(_as_numpy(result))
    return results


def _as_numpy(result):
    """Tensors leave a rank as numpy arrays: torch tensors would travel as shared memory the exiting
    rank takes with it."""
    if isinstance(result, dict):
        return {key: _as_numpy(value) for key, value in result.items()}
    return result.numpy() if isinstance(result, torch.Tensor) else result


def _relative(a, b):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).norm() / b.norm()).item()


def _worst_error(per_rank, references, topology):
    """Largest relative error of loss, grads and updated params over all ranks; checks every param is seen."""
    reference = references[topology.seq, topology.block]
    losses = [r["loss"] for r in per_rank if r["loss"] is not None]
    assert losses, "no rank reported a loss"
    worst = max(abs(loss - reference["loss"]) / abs(reference["loss"]) for loss in losses)
    for field in ("grads", "after"):
        seen = set()
        for result in per_rank:
            for name, tensor in result[field].items():
                worst = max(worst, _relative(tensor, reference[field][name]))
                seen.add(name)
        assert seen == set(reference[field]), f"{field}: missing {set(reference[field]) - seen}"
    return worst


@pytest.fixture(scope="module")
def references():
    """Reference results by (seq, block); both references start from the same weights."""
    results = run_ranks(_run, 1, [REFERENCE, REFERENCE_ODD_ROWS], None, timeout=300)[0]
    return {(REFERENCE.seq, REFERENCE.block): results[0], (REFERENCE_ODD_ROWS.seq, REFERENCE_ODD_ROWS.block): results[1]}


def _check_world(world_size, topologies, references, timeout):
    """One spawn runs every topology of this world size; each must match the reference (controls must not)."""
    results = run_ranks(_run, world_size, topologies, references[SEQ, BLOCK]["initial"], timeout=timeout)
    for index, topology in enumerate(topologies):
        per_rank = [results[rank][index] for rank in range(world_size)]
        _assert_same_noise_everywhere(per_rank, topology)
        error = _worst_error(per_rank, references, topology)
        print(f"{topology.name}: worst relative error {error:.2e}")
        if topology.megatron_rope:
            assert error > 1e-3, f"{topology.name} should not match the reference (error {error:.2e})"
        else:
            assert error <= TOLERANCE, f"{topology.name}: relative error {error:.2e}"


def test_world_2_compositions_and_negative_control(references):
    _check_world(2, WORLD_2, references, timeout=600)


def test_world_4_compositions(references):
    _check_world(4, WORLD_4, references, timeout=900)
