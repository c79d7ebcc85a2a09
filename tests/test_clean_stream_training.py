"""Training with a token-causal clean stream and an autoregressive co-loss (Nemotron-Labs-Diffusion's recipe:
`--bdlm-clean-attention token-causal --bdlm-ar-loss-weight 1 --bdlm-diffusion-loss-weight 0.3`).

* The AR part is the clean stream's next-token loss, so it equals a plain causal language model's loss on `x0`
  with the same weights (megatron-core's own GPTModel and causal attention: a reference that shares no code
  with the BDLM rows or the CSBP op), on one rank and across documents.
* One Megatron training step under CSBP2, CP2, BP2 (both transports), P=4 C=2 (clean rows on two rings, each
  target counted once), TP2xCSBP2, PP2xCSBP2 and DP2 equals one rank: the loss, both parts and every gradient
  and updated parameter, <= 1e-5 relative. Control: counting the clean targets on every ring misses.
* The training script with the recipe prints both parts on one rank and CSBP2 alike, and resumes bit-exact.
"""

import pytest
import torch

from megatron_step import BLOCK, MASK, SEQ, VOCAB, Topology, micro_batches, run_steps, train_step, worst_error
from spawn import on_cpu_backend, run_ranks

pytest_plugins = ["pretrain_runs"]  # the corpus fixture

MICRO_BATCH, NUM_MICRO = 2, 4
TOLERANCE = 1e-5
WEIGHTS = dict(diffusion_loss_weight=0.3, ar_loss_weight=1.0)  # Megatron-Bridge's Nemotron-Labs-Diffusion recipe

REFERENCE = Topology("reference", mode="reference")
WORLD_2 = [Topology("csbp P=C=2", block_parallel=2, clean_shards=2),
           Topology("csbp P=C=2 streaming", block_parallel=2, clean_shards=2, transport="streaming"),
           Topology("cp baseline 2", mode="cp", block_parallel=2, clean_shards=2),
           Topology("bp baseline 2", mode="bp", block_parallel=2, clean_shards=1),
           Topology("bp baseline 2 streaming", mode="bp", block_parallel=2, clean_shards=1, transport="streaming")]
WORLD_4 = [Topology("csbp P=4 C=2", block_parallel=4, clean_shards=2),
           Topology("control: every ring counts its clean targets", block_parallel=4, clean_shards=2,
                    transport="every-ring"),
           Topology("tp2 x csbp2 + sp", tp=2, block_parallel=2, clean_shards=2, sequence_parallel=True),
           Topology("pp2 x csbp2 (1f1b)", pp=2, block_parallel=2, clean_shards=2),
           Topology("dp2 x csbp2", block_parallel=2, clean_shards=2)]


def _dense_token_causal_attention():
    """A core attention computing the BDLM mask with token-causal clean rows densely from the layout's rows."""
    from megatron.core.transformer.module import MegatronModule

    class DenseTokenCausal(MegatronModule):
        def __init__(self, config, layer_number, *args, layout=None, **kwargs):
            super().__init__(config=config)
            self.layout = layout

        def forward(self, query, key, value, attention_mask, **kwargs):
            position, clean = self.layout.row_positions, self.layout.row_is_clean
            block = position // self.layout.block_size
            qb, kb, qp, kp = block[:, None], block[None, :], position[:, None], position[None, :]
            qc, kc = clean[:, None], clean[None, :]
            allowed = (~qc & ~kc & (kb == qb)) | (~qc & kc & (kb < qb)) | (qc & kc & (kp <= qp))
            group = query.shape[2] // key.shape[2]
            key, value = key.repeat_interleave(group, 2), value.repeat_interleave(group, 2)
            scores = torch.einsum("sbhd,tbhd->bhst", query, key) / query.shape[-1] ** 0.5
            out = torch.einsum("bhst,tbhd->sbhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), value)
            return out.reshape(out.shape[0], out.shape[1], -1)

    return DenseTokenCausal


def build_token_causal_model(topology, config, **model_arguments):
    """The model of a token-causal clean stream on `topology`: a reference topology's attention is the dense one
    above; `model_arguments` go to the model beside the common ones."""
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_csbp.core.layout import CSBPLayout, layout_for
    from megatron_csbp.mcore import parallel_state
    from megatron_csbp.mcore.model import BDLMGPTModel, model_provider
    from megatron_csbp.mcore.spec import get_csbp_layer_spec

    stages = dict(pre_process=mpu.is_pipeline_first_stage(), post_process=mpu.is_pipeline_last_stage())
    common = dict(vocab_size=VOCAB, mask_token_id=MASK, share_embeddings_and_output_weights=True, clean_logits=True,
                  logits_tile_rows=topology.logits_tile_rows, **model_arguments)
    if topology.mode == "reference":
        layout = CSBPLayout(topology.seq, topology.block, 1, 1, 0, clean_attention="token-causal")
        spec = get_csbp_layer_spec()
        spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
            module=_dense_token_causal_attention(), params={"layout": layout})
        model = BDLMGPTModel(config=config, transformer_layer_spec=spec, max_sequence_length=topology.seq,
                             position_embedding_type="rope", layout=layout, **stages, **common)
        return model, layout
    layout = layout_for(topology.mode, topology.seq, topology.block, topology.block_parallel, topology.clean_shards,
                        rank=mpu.get_context_parallel_rank(), clean_attention="token-causal")
    transport = "collective" if topology.transport == "every-ring" else topology.transport
    model = model_provider(config=config, layout=layout, group=parallel_state.get_block_parallel_groups(),
                           transport=transport, **stages, **common)
    return model, layout


def _batches(dp_rank, dp_size):
    return micro_batches(dp_rank, dp_size, micro_batch=MICRO_BATCH, num_micro=NUM_MICRO, seed=2024)


def _every_ring_objective():
    """Control: the clean targets counted on every ring, not the first only."""
    from megatron_csbp.bdlm.objective import BDLMObjective

    class EveryRing(BDLMObjective):
        @staticmethod
        def _next_tokens(tokens, supervised, documents, layout):
            import dataclasses

            return BDLMObjective._next_tokens(tokens, supervised, documents,
                                              dataclasses.replace(layout, rank=layout.ring_rank))

    return EveryRing


def _train_step(topology, weights):
    from megatron_csbp.bdlm.forward_step import BDLMForwardStep
    from megatron_csbp.bdlm.objective import BDLMObjective

    kind = _every_ring_objective() if topology.transport == "every-ring" else BDLMObjective
    objective = kind(block_size=topology.block, mask_token_id=MASK, seed=99, **WEIGHTS)
    return train_step(topology, weights, build_token_causal_model, lambda layout: BDLMForwardStep(objective, layout),
                      _batches, MICRO_BATCH)


@pytest.fixture(scope="module")
def reference():
    return run_ranks(run_steps, 1, _train_step, [REFERENCE], None, timeout=300)[0][0]


def _check_world(world_size, topologies, reference, timeout):
    results = run_ranks(run_steps, world_size, _train_step, topologies, reference["initial"], timeout=timeout)
    assert set(reference["losses"]) == {"lm loss", "diffusion loss", "ar loss"}, reference["losses"]
    for index, topology in enumerate(topologies):
        per_rank = [results[rank][index] for rank in range(world_size)]
        parts = [r["losses"] for r in per_rank if r["losses"]]
        part_error = max(abs(losses[name] - value) / abs(value)
                         for losses in parts for name, value in reference["losses"].items())
        error = max(worst_error(per_rank, reference), part_error)
        print(f"{topology.name}: worst relative error {error:.2e} (loss parts {part_error:.2e})")
        if topology.name.startswith("control"):
            assert part_error > 1e-3, f"{topology.name} should not match the reference ({part_error:.2e})"
        else:
            assert error <= TOLERANCE, f"{topology.name}: relative error {error:.2e}"


def test_world_2_token_causal_ar_step_equals_one_rank(reference):
    _check_world(2, WORLD_2, reference, timeout=600)


def test_world_4_token_causal_ar_step_equals_one_rank(reference):
    _check_world(4, WORLD_4, reference, timeout=900)


@on_cpu_backend
def _ar_against_a_causal_lm(rank, world_size):
    """The AR part of a token-causal BDLM's loss, and a plain causal LM's next-token loss on `x0` with the same
    weights (megatron-core's GPTModel with its own causal attention; MASK's logit excluded as ours excludes it),
    for one sample and a packed one (targets stop at each document's end)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_csbp.bdlm.forward_step import Packing
    from megatron_csbp.bdlm.objective import BDLMObjective, loss_func
    from megatron_csbp.core.layout import CSBPLayout
    from megatron_csbp.mcore import parallel_state
    from megatron_csbp.mcore.model import model_provider
    from megatron_step import _config

    parallel_state.initialize_model_parallel(1, 1, context_block_parallel_size=1, clean_shards=1)
    try:
        torch.manual_seed(0)
        model_parallel_cuda_manual_seed(0)
        config = _config(REFERENCE)
        layout = CSBPLayout(SEQ, BLOCK, 1, 1, clean_attention="token-causal")
        bdlm = model_provider(config=config, layout=layout, vocab_size=VOCAB, mask_token_id=MASK,
                              share_embeddings_and_output_weights=True, clean_logits=True)
        plain = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                         vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope",
                         share_embeddings_and_output_weights=True)
        generator = torch.Generator().manual_seed(5)
        for param in bdlm.parameters():
            param.data.add_(0.05 * torch.randn(param.shape, generator=generator))
        missing = plain.load_state_dict(bdlm.state_dict(), strict=False)
        assert not missing.missing_keys, missing.missing_keys
        tokens = torch.randint(0, MASK - 1, (2, SEQ), generator=generator)
        eod = MASK - 1
        tokens[1, 9] = tokens[1, 20] = eod  # the second sample packs three documents
        objective = BDLMObjective(block_size=BLOCK, mask_token_id=MASK, seed=3, **WEIGHTS)
        results = []
        for packing in (Packing(), Packing(eod, reset_position_ids=False, reset_attention_mask=True)):
            batch = {"tokens": tokens, "sample_index": torch.tensor([0, 1])}
            rows = packing.rows(objective, batch, layout)
            ce = bdlm(rows.input_ids, rows.position_ids, attention_mask=rows.document_ids, labels=rows.labels)
            ours = loss_func(rows.loss_weights, rows.num_tokens, ce, rows.parts)[2]["ar loss"]
            positions = torch.arange(SEQ).unsqueeze(0).expand(2, -1)
            if packing.reset_attention_mask:  # the plain LM, one document at a time
                logits = torch.cat([_document_logits(plain, tokens[s:s + 1], packing) for s in range(2)])
            else:
                logits = plain(tokens, positions, attention_mask=None).float()
            logits[..., MASK] = float("-inf")
            targets = tokens[:, 1:]
            counted = torch.ones_like(targets, dtype=torch.bool)
            if packing.reset_attention_mask:  # no target across a document's end
                from megatron_csbp.core.documents import document_ids
                documents = document_ids(tokens, eod)
                counted = documents[:, 1:] == documents[:, :-1]
            ce_plain = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), targets, reduction="none")
            results.append(((ours[0] / ours[1]).item(), (ce_plain[counted].sum() / counted.sum()).item(),
                            int(ours[1]), int(counted.sum())))
        return results
    finally:
        parallel_state.destroy_model_parallel()


def _document_logits(plain, tokens, packing):
    """The plain LM's logits of a packed sample, each document run alone (its own causal attention)."""
    from megatron_csbp.core.documents import Documents

    documents = Documents.from_eod(tokens[0], packing.eod)
    pieces = []
    for start, length in zip(documents.starts, documents.lengths()):
        piece = tokens[:, start:start + length]
        pieces.append(plain(piece, torch.arange(start, start + length).unsqueeze(0), attention_mask=None).float())
    return torch.cat(pieces, dim=1)


def test_the_ar_part_is_a_causal_lms_next_token_loss():
    (single, packed) = run_ranks(_ar_against_a_causal_lm, 1, timeout=300)[0]
    for ours, plain, count, expected_count in (single, packed):
        print(f"ar loss {ours:.6f}, causal LM {plain:.6f}, targets {count} / {expected_count}")
        assert count == expected_count and abs(ours - plain) / plain <= TOLERANCE, (ours, plain, count)
    assert single[2] == 2 * (SEQ - 1) and packed[2] == 2 * (SEQ - 1) - 2  # the packed sample: two ends less


AR_RECIPE = dict(bdlm_clean_attention="token-causal", bdlm_ar_loss_weight=1.0, bdlm_diffusion_loss_weight=0.3)
LOSS_LINE = r"iteration\s+(\d+)/.*?lm loss:\s*(\S+) \| ar loss:\s*(\S+) \| diffusion loss:\s*(\S+) \|.*?grad norm:\s*(\S+) \|"


def _printed(run) -> dict:
    """{iteration: (lm loss, ar loss, diffusion loss, grad norm)} as the training line prints them."""
    import re

    return {int(m.group(1)): m.groups()[1:] for m in re.finditer(LOSS_LINE, run.output)}


def _close(printed: dict, reference: dict) -> bool:
    """Every printed number within 1e-5 relative of the reference's (ranks sum their parts in another order)."""
    return printed.keys() == reference.keys() and all(
        abs(float(a) - float(b)) <= TOLERANCE * abs(float(b)) for i in printed for a, b in zip(printed[i], reference[i]))


def test_the_training_script_prints_both_parts_alike_on_every_layout_and_resumes_bit_exact(corpus, tmp_path):
    """The recipe from the command line (our loop): every printed lm loss, ar loss, diffusion loss and grad norm of
    CSBP2 equals one rank's (<= 1e-5: the ranks' partial sums add in another order); CSBP2 saved at iteration 2
    and resumed prints iterations 3-4 digit for digit as the uninterrupted CSBP2 run, and one rank resuming that
    checkpoint prints one rank's. Control: another AR weight leaves the parts of the first step and moves lm loss."""
    from pretrain_runs import copy_checkpoint, run

    settings = dict(data_path=corpus, train_iters=4, eval_iters=0, lr_warmup_iters=1, save_interval=2, **AR_RECIPE)
    csbp2 = {**settings, "context_block_parallel": 2}
    one = _printed(run(1, settings))
    assert sorted(one) == [1, 2, 3, 4] and all(float(ar) > 0 for _, ar, _, _ in one.values()), one
    whole = _printed(run(2, {**csbp2, "save": tmp_path / "csbp"}))
    assert _close(whole, one), (whole, one)
    resumed = _printed(run(2, {**csbp2, "load": copy_checkpoint(tmp_path / "csbp", 2, tmp_path / "csbp@2")}))
    assert resumed == {i: whole[i] for i in (3, 4)}, (resumed, whole)
    back = _printed(run(1, {**settings, "load": copy_checkpoint(tmp_path / "csbp", 2, tmp_path / "csbp@2b")}))
    assert _close(back, {i: one[i] for i in (3, 4)}), (back, one)
    other = _printed(run(1, {**settings, "train_iters": 1, "lr_warmup_iters": 0, "bdlm_ar_loss_weight": 0.5}))
    assert other[1][1:3] == one[1][1:3] and other[1][0] != one[1][0], (other, one)
