"""Answer-only loss masks (chat SFT data) under tensor, sequence, pipeline and context-sharded block parallelism.

One Megatron training step of a packed chat batch (prompt tokens unsupervised, answers supervised, each
conversation ending with EOD and padded to a block multiple, as `prepare_data --chat --pad-to-multiple B` writes
them; `--reset-position-ids --reset-attention-mask --eod-mask-loss`) gives at TP2 x CSBP2, TP2 x CSBP2 with
sequence parallelism and PP2 x CSBP2 the loss, every gradient and every parameter after the optimizer step of the
same batch on one rank (<= 1e-5 relative, fp32). Only TP rank 0 reads the batches (the other TP ranks' iterators
hold nothing), so the mask reaches them by the forward step's broadcast alone. Negative controls: the mask dropped on
the non-zero TP ranks misses, and on one rank the mask changes the step (it is not all ones in effect).

End to end, scripts/pretrain_bdlm.py trains a tiny chat dataset at TP2 (2 ranks) with the 1-rank run's losses, in
our loop and (with Megatron-LM) in Megatron-LM's; the same tokens without their mask log other losses.
"""

import dataclasses
import json
import shutil

import pytest
import torch

from conftest import megatron_lm_path
from megatron_step import MASK, Topology, run_steps, train_step, worst_error
from pretrain_runs import run, significant
from spawn import run_ranks

SEQ, BLOCK, EOD = 32, 4, 62
TOLERANCE = 1e-5
MICRO_BATCH = 2
# Each sample packs conversations of (prompt, answer) lengths; with its EOD each is padded to a block multiple.
CONVERSATIONS = [[(3, 4), (5, 6), (2, 3)], [(6, 9), (4, 5)], [(2, 2), (3, 4), (4, 7)], [(5, 10), (2, 6)]]


def _samples():
    """(tokens [4, SEQ], loss_mask [4, SEQ]): prompts in ids 0..29, answers in 30..61, EOD padding, mask on answers."""
    generator = torch.Generator().manual_seed(11)
    tokens, masks = [], []
    for sample in CONVERSATIONS:
        ids, supervised = [], []
        for prompt, answer in sample:
            ids += torch.randint(0, 30, (prompt,), generator=generator).tolist()
            ids += torch.randint(30, EOD, (answer,), generator=generator).tolist()
            supervised += [0] * prompt + [1] * answer
            padded = -(-(len(supervised) + 1) // BLOCK) * BLOCK
            ids += [EOD] * (padded - len(ids))
            supervised += [0] * (padded - len(supervised))
        ids += [EOD] * (SEQ - len(ids))
        supervised += [0] * (SEQ - len(supervised))
        tokens.append(ids)
        masks.append(supervised)
    return torch.tensor(tokens), torch.tensor(masks, dtype=torch.bool)


@dataclasses.dataclass(frozen=True)
class Run:
    topology: Topology
    masked: bool = True  # False: the batches carry no loss mask
    dropped_off_rank_0: bool = False  # negative control: the non-zero TP ranks lose the mask after the broadcast


def _batches(run, dp_rank, dp_size):
    """The micro-batches of this rank: at TP rank 0 the samples (with their mask), elsewhere nothing to read."""
    from megatron.core import parallel_state as mpu

    tokens, masks = _samples()
    batches = []
    for start in range(0, tokens.shape[0], MICRO_BATCH):
        batch = {"tokens": tokens[start:start + MICRO_BATCH], "sample_index": torch.arange(start, start + MICRO_BATCH)}
        if run.masked:
            batch["loss_mask"] = masks[start:start + MICRO_BATCH]
        batches.append(batch)
    per_rank = len(batches) // dp_size
    batches = batches[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    return batches if mpu.get_tensor_model_parallel_rank() == 0 else [None] * len(batches)


def _train_step(run, weights):
    from megatron.core import parallel_state as mpu

    from megatron_csbp.bdlm import forward_step
    from megatron_csbp.bdlm.objective import BDLMObjective
    from megatron_csbp.core.layout import layout_for
    from megatron_csbp.mcore import parallel_state
    from megatron_csbp.mcore.model import model_provider

    def build_model(topology, config):
        layout = layout_for("csbp" if topology.mode == "reference" else topology.mode, SEQ, BLOCK,
                            topology.block_parallel, topology.clean_shards, rank=mpu.get_context_parallel_rank())
        model = model_provider(config=config, layout=layout, group=parallel_state.get_block_parallel_groups(),
                               transport=topology.transport, pre_process=mpu.is_pipeline_first_stage(),
                               post_process=mpu.is_pipeline_last_stage(), vocab_size=64, mask_token_id=MASK,
                               share_embeddings_and_output_weights=True, per_sample_positions=True)
        return model, layout

    broadcast = forward_step.batch_on_this_rank

    def dropped_off_rank_0(data_iterator):
        batch = broadcast(data_iterator)
        if mpu.get_tensor_model_parallel_rank() != 0:
            batch.pop("loss_mask")
        return batch

    packing = forward_step.Packing(EOD, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    objective = BDLMObjective(block_size=BLOCK, mask_token_id=MASK, seed=99)
    if run.dropped_off_rank_0:
        forward_step.batch_on_this_rank = dropped_off_rank_0
    try:
        return train_step(run.topology, weights, build_model,
                          lambda layout: forward_step.BDLMForwardStep(objective, layout, packing=packing),
                          lambda dp_rank, dp_size: _batches(run, dp_rank, dp_size), MICRO_BATCH)
    finally:
        forward_step.batch_on_this_rank = broadcast


ONE = Topology("one rank", mode="reference")
TP2_CSBP2 = Topology("tp2 x csbp2", tp=2, block_parallel=2, clean_shards=2)
WORLD_4 = [TP2_CSBP2, Topology("tp2 x csbp2 + sp", tp=2, block_parallel=2, clean_shards=2, sequence_parallel=True),
           Topology("pp2 x csbp2 (1f1b)", pp=2, block_parallel=2, clean_shards=2)]


def test_the_chat_batch_supervises_answers_only():
    tokens, masks = _samples()
    assert bool((tokens[masks] >= 30).all()) and bool((tokens[masks] < EOD).all())
    assert bool((tokens[~masks] < 30).any()) and bool((tokens[~masks] == EOD).any())
    assert 0 < int(masks.sum()) < masks.numel() // 2


def test_a_masked_chat_step_under_tp_sp_pp_and_csbp_equals_one_rank():
    reference, unmasked = run_ranks(run_steps, 1, _train_step, [Run(ONE), Run(ONE, masked=False)], None,
                                    timeout=300)[0]
    mask_matters = worst_error([unmasked], reference)
    print(f"one rank: loss {reference['loss']:.6f} with the mask, {unmasked['loss']:.6f} without "
          f"(worst relative difference {mask_matters:.2e})")
    assert mask_matters > 1e-2
    runs = [Run(topology) for topology in WORLD_4] + [Run(TP2_CSBP2, dropped_off_rank_0=True)]
    results = run_ranks(run_steps, 4, _train_step, runs, reference["initial"], timeout=900)
    for index, run_ in enumerate(runs):
        error = worst_error([results[rank][index] for rank in range(4)], reference)
        label = run_.topology.name + (", mask dropped off TP rank 0 (control)" if run_.dropped_off_rank_0 else "")
        print(f"masked chat step, {label}: worst relative error {error:.2e}")
        if run_.dropped_off_rank_0:
            assert error > 1e-3, f"{label}: {error:.2e}"
        else:
            assert error <= TOLERANCE, f"{label}: relative error {error:.2e}"


# --- end to end: scripts/pretrain_bdlm.py on a tiny chat dataset ----------------------------------------------------

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = "zebra apple river stone cloud maple ember quiet lantern orbit velvet meadow".split()


@pytest.fixture(scope="module")
def chat_prefixes(tmp_path_factory):
    """A chat dataset (`prepare_data --chat --pad-to-multiple 8`) and the same tokens without their mask."""
    from megatron_csbp.tools import prepare_data
    from megatron_csbp.tools.tiny_hf_model import make_tokenizer

    root = tmp_path_factory.mktemp("sft_parallel")
    tokenizer = make_tokenizer(300)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(root / "tok")
    generator = torch.Generator().manual_seed(0)
    lines = []
    for i in range(48):
        answer = " ".join(WORDS[j] for j in torch.randint(0, len(WORDS), (3 + i % 5,), generator=generator).tolist())
        lines.append(json.dumps({"messages": [{"role": "user", "content": f"QUESTION {i}?"},
                                              {"role": "assistant", "content": answer}]}))
    (root / "chat.jsonl").write_text("\n".join(lines) + "\n")
    chat = str(root / "chat")
    assert prepare_data.main(["--input", str(root / "chat.jsonl"), "--output-prefix", chat, "--chat",
                              "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(root / "tok"),
                              "--pad-to-multiple", "8"]) == 0
    plain = str(root / "plain")
    for suffix in (".bin", ".idx"):
        shutil.copy(chat + suffix, plain + suffix)
    return root / "tok", chat, plain


def _chat_run(nproc, tok, prefix, loop, env=None):
    """`nproc` ranks of tensor parallelism; the vocabulary padded to 384 rows either way (128 x TP by default)."""
    return run(nproc, {"data_path": prefix, "tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": tok,
                       "train_iters": 4, "eval_interval": 4, "eval_iters": 1, "training_loop": loop,
                       "tensor_model_parallel_size": nproc, "make_vocab_size_divisible_by": 128 // nproc,
                       "reset_position_ids": True, "reset_attention_mask": True, "eod_mask_loss": True},
               env=env, timeout=600)


def _losses(done):
    return {i: significant(v) for i, v in done.losses.items()}


@pytest.mark.parametrize("loop", ["megatron-core", "megatron-lm"])
def test_a_chat_fine_tune_at_tp2_trains_with_the_one_rank_losses(chat_prefixes, loop):
    """Our loop (and Megatron-LM's, with the plugin's providers) read the mask beside each sample and train at TP2
    with the losses of one rank; the same tokens without their mask give other losses (the mask is read)."""
    env = {}
    if loop == "megatron-lm":
        path = megatron_lm_path()
        if path is None:
            pytest.skip("Megatron-LM is absent: set MEGATRON_LM_PATH to a Megatron-LM checkout of tag core_v0.16.1")
        env["MEGATRON_LM_PATH"] = path
    tok, chat, plain = chat_prefixes
    one, tp2 = _chat_run(1, tok, chat, loop, env), _chat_run(2, tok, chat, loop, env)
    print(f"{loop}: one rank {_losses(one)}, TP2 {_losses(tp2)}")
    assert sorted(one.losses) == [1, 2, 3, 4] and all(loss == loss and loss > 0 for loss in one.losses.values())
    assert _losses(tp2) == _losses(one), tp2.output[-3000:]
    if loop == "megatron-core":
        unmasked = _chat_run(1, tok, plain, loop)
        assert all(_losses(unmasked)[i] != _losses(one)[i] for i in one.losses), (_losses(unmasked), _losses(one))
