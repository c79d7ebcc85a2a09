"""Hugging Face import and export (scripts/convert_hf.py, megatron_csbp/tools/hf.py) against `transformers` itself.

Tiny random Llama, Qwen2 (QKV bias, tied embeddings, unused padding rows) and Qwen3 (QK-norm) models are
made locally and imported. The reference is the HF model run by `transformers` on the same `[x_t ; x_0]`
rows with the BDLM attention mask (a custom 4-D float mask) and shared position ids (position p for
both copies); the MASK token's input embedding is the documented initialisation, computed here.
* logits on the noisy rows: converted model == HF model, <= 1e-5 relative, on 1 rank, TP2 and CSBP2
  (the MASK column, which the model sets to -inf, left out); controls with the RoPE halves interleaved
  or Q/K/V concatenated without per-group interleaving fail;
* YaRN (a Llama, a Qwen3) and Ministral 3's Llama 4 query scaling, imported, give transformers' logits too (controls:
  plain RoPE, no query scaling), also on packed documents, where the query scale counts from each document's start;
  their rope parameters read back from an export as the same flags and as the same frequencies and factor;
* import -> export is bit-exact (MASK rows = the documented initialisation), from the import itself and
  from a checkpoint our training loop saved at TP2 x PP2;
* fine-tuning an imported model runs, and its first-iteration loss is the Fast-dLLM v2 loss of the HF
  model at noise 1 (every noisy token MASK), computed here;
* nothing is half-written, stale or mixed: conversions killed (SIGKILL) at points they report leave the
  target as it was, a re-export leaves no stale shard, a second import into one --save is refused, and every
  bad input (damaged weights, a config that disagrees, full or read-only disks, ...) is one line, exit 2;
* config.json says how the exported model decodes (objective, label shift, block size, MASK id).
"""

import errno
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from attention_reference import bdlm_mask
from megatron_csbp.core.positions import YARN_FLAGS
from pretrain_runs import TORCHRUN
from megatron_csbp.tools import convert_hf, tiny_hf_model
from megatron_csbp.tools import hf
from spawn import kill_tree, on_cpu_backend, run_command, run_ranks, start

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ, BLOCK, BATCH = 32, 4, 2
TOLERANCE = 1e-5
# Vocabularies: Llama's tokenizer fills its 383 rows (MASK is a new row 383); Qwen's has 300 ids in 384 rows
# (MASK takes the unused row 300). Padded to a multiple of 64 x TP: 384 at TP1 and TP2, so no padding rows.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# YaRN over an original context of 16 (8: the query scaling's steps fall inside SEQ), so that it moves every
# frequency the test's positions reach: a Llama with transformers' defaults for the attention factor (0.1 ln 4 + 1)
# and truncate false, a Qwen3 with Ministral's mscales (factor 1), and a Ministral 3 with Llama 4's query scaling.
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
             "beta_fast": 8.0, "beta_slow": 2.0, "truncate": False}
MINISTRAL_ROPE = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 8,
                  "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                  "llama_4_scaling_beta": 0.5}
MODELS = {"llama": dict(family="llama", tokenizer_ids=383),
          "llama3": dict(family="llama", tokenizer_ids=383, tied=True, rope_parameters=LLAMA3_ROPE),
          "qwen2": dict(family="qwen2", tokenizer_ids=300, model_rows=384, tied=True),
          "qwen3": dict(family="qwen3", tokenizer_ids=300, model_rows=384),
          "llama_yarn": dict(family="llama", tokenizer_ids=383, rope_parameters=YARN_ROPE),
          "qwen3_yarn": dict(family="qwen3", tokenizer_ids=300, model_rows=384,
                             rope_parameters={**{key: value for key, value in MINISTRAL_ROPE.items()
                                                 if key != "llama_4_scaling_beta"},
                                              "original_max_position_embeddings": 16}),
          "ministral3": dict(family="ministral3", tokenizer_ids=383, rope_parameters=MINISTRAL_ROPE)}
YARN_MODELS = ["llama_yarn", "qwen3_yarn", "ministral3"]
CONTROLS = {"rope interleaved": [name for name in MODELS if name not in YARN_MODELS],  # megatron-core's YaRN has none
            "qkv concatenated": MODELS, "rope unscaled": ["llama3"],
            "yarn off": YARN_MODELS, "query unscaled": ["ministral3"]}
DIVISIBLE_BY = 64


def _make_and_import(rank, world, root):
    """On one spawned rank: the tiny HF models and their imports (`root/<family>/{hf,ckpt}`)."""
    for name, settings in MODELS.items():
        hf_dir = tiny_hf_model.make_model(**settings, output=os.path.join(root, name, "hf"))
        convert_hf.import_checkpoint(hf_dir, os.path.join(root, name, "ckpt"),
                                     make_vocab_size_divisible_by=DIVISIBLE_BY, log=lambda *_: None)


def _run_conversions(rank, world, jobs):
    """On one spawned rank: `convert_hf.import_checkpoint` / `export_checkpoint` calls, one after the other."""
    for function, kwargs in jobs:
        getattr(convert_hf, function)(**kwargs, log=lambda *_: None)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hf"))
    run_ranks(_make_and_import, 1, root, timeout=600)
    return root


def _fragment(root, family):
    return os.path.join(root, family, "ckpt", "model.yaml")


def _inputs(mask_id, num_ids):
    """x0 [b, L] (ids the tokenizer has, not MASK) and x_t (about half the tokens MASK)."""
    generator = torch.Generator().manual_seed(11)
    x0 = torch.randint(0, num_ids, (BATCH, SEQ), generator=generator)
    x0[x0 == mask_id] = 0
    masked = torch.rand(BATCH, SEQ, generator=generator) < 0.5
    return x0, torch.where(masked, mask_id, x0)


def _mask_embedding(embedding, mean_of):
    """The documented MASK initialisation, computed independently: the mean of the original ids' rows."""
    return embedding[:mean_of].double().mean(0).to(embedding.dtype)


def hf_reference(hf_dir, x_t, x0, mask_id, mean_of, documents=None, positions=None):
    """The HF model's logits `[b, L, rows]` on the noisy rows of `[x_t ; x0]` under the BDLM mask (cut to each
    sample's documents `[b, L]` where given), at `positions [b, L]` (default: 0..L-1) in both halves."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    table = model.get_input_embeddings().weight.detach()
    mask_row = _mask_embedding(table, mean_of)
    ids = torch.cat([x_t, x0], dim=1)
    embeds = table[ids.clamp(max=table.shape[0] - 1)]
    embeds[ids == mask_id] = mask_row
    batch = ids.shape[0]
    allowed = bdlm_mask(SEQ, BLOCK).expand(batch, -1, -1)
    if documents is not None:
        both = torch.cat([documents, documents], dim=1)
        allowed = allowed & (both[:, :, None] == both[:, None, :])
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    positions = torch.arange(SEQ).expand(batch, -1) if positions is None else positions
    with torch.no_grad():
        logits = model(inputs_embeds=embeds, attention_mask=additive[:, None],
                       position_ids=torch.cat([positions, positions], dim=1)).logits
    return logits[:, :SEQ]


@on_cpu_backend
def _our_logits(rank, world, root, families, tp, cp, controls):
    """On each rank: our converted model's logits on its noisy rows (gathered over TP), per family."""
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_csbp.training import checkpointing, providers
    from megatron_csbp.mcore import parallel_state
    from megatron_csbp.training.arguments import validate_args
    from megatron_csbp.training.megatron_config import transformer_config_from_args
    from megatron_csbp.training.config import parse_args
    from megatron_csbp.tools.hf import split_qkv, Shape

    results = {}
    for family in families:
        for control in ("none", *(control for control in controls if family in CONTROLS[control])):
            args = validate_args(parse_args(
                ["--config", _fragment(root, family), f"seq-length={SEQ}", f"bdlm-block-size={BLOCK}",
                 f"micro-batch-size={BATCH}", "train-iters=1", "lr=0", "data-path=unused",
                 f"tensor-model-parallel-size={tp}", f"context-block-parallel={cp}"]), world, check_paths=False)
            parallel_state.initialize_model_parallel(tp, 1, context_block_parallel_size=cp, clean_shards=cp)
            try:
                model_parallel_cuda_manual_seed(1234)
                config = transformer_config_from_args(args)
                config.rotary_interleaved = control == "rope interleaved"
                args.use_rope_scaling = args.use_rope_scaling and control != "rope unscaled"
                if control in ("yarn off", "query unscaled"):  # plain RoPE, or YaRN without the query scaling
                    args.llama_4_scaling_beta = None
                if control == "yarn off":
                    args.position_embedding_type, args.yarn_correction_range_round_to_int = "rope", True
                    for name in YARN_FLAGS:
                        setattr(args, name, None)
                run_providers = providers.RunProviders(args)
                model = run_providers.model_provider(config=config)
                checkpointing.load_checkpoint(os.path.join(root, family, "ckpt", "iter_0000000"), model, None, None,
                                              run_providers.vocabulary.recorded(args), load_optimizer=False,
                                              load_rng=False, log=lambda *_: None)
                if control == "qkv concatenated":  # [q ; k ; v] as if the per-group interleaving were missing
                    for layer in model.decoder.layers:
                        qkv = layer.self_attention.linear_qkv.weight
                        qkv.data.copy_(torch.cat(split_qkv(qkv.data, Shape.from_args(args))))
                layout = run_providers.run.layout
                x0, x_t = _inputs(run_providers.vocabulary.mask_token_id, MODELS[family]["tokenizer_ids"])
                input_ids = torch.cat([x_t[:, layout.noisy_positions], x0[:, layout.clean_positions]], dim=1)
                positions = layout.row_positions.expand(BATCH, -1).contiguous()
                model.eval()
                with torch.no_grad():
                    logits = model(input_ids, positions, labels=None)
                shards = [torch.empty_like(logits) for _ in range(tp)]
                torch.distributed.all_gather(shards, logits.contiguous(), group=mpu.get_tensor_model_parallel_group())
                results[family, control] = (layout.noisy_positions, torch.cat(shards, dim=-1))
            finally:
                parallel_state.destroy_model_parallel()
    return results


def _assemble(per_rank, family, control):
    """Every rank's noisy rows back into `[b, L, V]` (ranks of a TP group hold the same gathered logits)."""
    out = None
    for result in per_rank:
        positions, logits = result[family, control]
        if out is None:
            out = torch.full((logits.shape[0], SEQ, logits.shape[2]), float("nan"))
        out[:, positions] = logits
    assert not out.isnan().any()
    return out


def _relative_error(ours, reference, mask_id):
    """Over the HF model's rows but MASK: ours has -inf at MASK and past the real ids (the vocabulary padding)."""
    keep = torch.ones(reference.shape[-1], dtype=torch.bool)
    if mask_id < keep.numel():
        keep[mask_id] = False
    real_ids = max(reference.shape[-1], mask_id + 1)
    assert torch.isinf(ours[..., mask_id]).all() and torch.isinf(ours[..., real_ids:]).all()
    ours = ours[..., : reference.shape[-1]][..., keep].double()
    reference = reference[..., keep].double()
    return ((ours - reference).norm() / reference.norm()).item()


def _mask_id(family):
    return MODELS[family]["tokenizer_ids"]  # a new MASK right after the tokenizer's ids


@pytest.mark.parametrize("tp, cp", [(1, 1), (2, 1), (1, 2)], ids=["1 rank", "tp2", "csbp2"])
def test_logits_equal_huggingface(converted, tp, cp):
    controls = list(CONTROLS) if tp == cp == 1 else []
    per_rank = run_ranks(_our_logits, tp * cp, converted, list(MODELS), tp, cp, controls, timeout=600)
    for family, sizes in MODELS.items():
        mask_id = _mask_id(family)
        x0, x_t = _inputs(mask_id, sizes["tokenizer_ids"])
        reference = hf_reference(os.path.join(converted, family, "hf"), x_t, x0, mask_id,
                                 min(sizes["tokenizer_ids"], sizes.get("model_rows", sizes["tokenizer_ids"])))
        error = _relative_error(_assemble(per_rank, family, "none"), reference, mask_id)
        print(f"{family} tp{tp} csbp{cp}: relative error {error:.2e}")
        assert error <= TOLERANCE, (family, error)
        for control in (control for control in controls if family in CONTROLS[control]):
            wrong = _relative_error(_assemble(per_rank, family, control), reference, mask_id)
            print(f"{family} control '{control}': relative error {wrong:.2e}")
            assert wrong > 100 * TOLERANCE, (family, control, wrong)


PACKED = "ministral3"  # YaRN and the query scaling, whose scale depends on where a position counts from
DOCUMENT_ENDS = ((9,), (20, 26))  # each sample's EOD positions: documents of different lengths per sample


@on_cpu_backend
def _packed_logits(rank, world, root, cp):
    """On each rank: `PACKED`'s import trained on packed documents (--reset-position-ids --reset-attention-mask):
    per sample, the rows the forward step makes, and the model's logits on this rank's noisy rows."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_csbp.core.documents import Documents, balanced_layout, document_ids
    from megatron_csbp.mcore import parallel_state
    from megatron_csbp.training import checkpointing, providers
    from megatron_csbp.training.arguments import validate_args
    from megatron_csbp.training.config import parse_args

    args = validate_args(parse_args(
        ["--config", _fragment(root, PACKED), f"seq-length={SEQ}", f"bdlm-block-size={BLOCK}",
         f"micro-batch-size={BATCH}", "train-iters=1", "lr=0", "data-path=unused", "reset-position-ids=true",
         "reset-attention-mask=true", f"context-block-parallel={cp}"]), world, check_paths=False)
    parallel_state.initialize_model_parallel(1, 1, context_block_parallel_size=cp, clean_shards=cp)
    try:
        model_parallel_cuda_manual_seed(1234)
        run_providers = providers.RunProviders(args)
        model = run_providers.model_provider()
        checkpointing.load_checkpoint(os.path.join(root, PACKED, "ckpt", "iter_0000000"), model, None, None,
                                      run_providers.vocabulary.recorded(args), load_optimizer=False, load_rng=False,
                                      log=lambda *_: None)
        run, eod = run_providers.run, run_providers.vocabulary.tokenizer.eod
        x0, _ = _inputs(run_providers.vocabulary.mask_token_id, MODELS[PACKED]["tokenizer_ids"])
        x0[x0 == eod] = eod + 1
        for sample, ends in enumerate(DOCUMENT_ENDS):
            x0[sample, list(ends)] = eod
        rows = run.forward_step.packing.rows(run.objective, {"tokens": x0, "sample_index": torch.arange(BATCH)},
                                             run.layout)
        model.eval()
        with torch.no_grad():
            logits = model(rows.input_ids, rows.position_ids, attention_mask=rows.document_ids)
        dealt = [balanced_layout(run.layout, Documents.from_ids(ids)) for ids in document_ids(x0, eod)]
        return x0, [(layout.noisy_positions, rows.input_ids[i, :layout.num_noisy_rows], rows.position_ids[i],
                     logits[i]) for i, layout in enumerate(dealt)]
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("cp", [1, 2], ids=["1 rank", "csbp2"])
def test_packed_documents_scale_queries_at_their_own_rope_positions(converted, cp):
    """Under --reset-position-ids a row's RoPE position counts from its document's start, and so does its query
    scale (Llama 4's, as transformers computes it from `position_ids`): the imported Ministral 3's logits on packed
    samples equal transformers' on the same rows with the documents' masks and positions, on 1 rank and CSBP2.
    Negative control: transformers at the sample's positions (the scale counted from the sample's start)."""
    from megatron_csbp.core.documents import document_ids

    per_rank = run_ranks(_packed_logits, cp, converted, cp, timeout=600)
    x0 = per_rank[0][0]
    mask_id = _mask_id(PACKED)
    x_t, ours = torch.full_like(x0, -1), None
    positions = torch.full_like(x0, -1)
    for _, samples in per_rank:
        for sample, (noisy, inputs, rows_positions, logits) in enumerate(samples):
            if ours is None:
                ours = torch.full((BATCH, SEQ, logits.shape[-1]), float("nan"))
            x_t[sample, noisy], ours[sample, noisy] = inputs.cpu(), logits.cpu()
            positions[sample, noisy] = rows_positions[:noisy.numel()].cpu()
    assert (x_t >= 0).all() and not ours.isnan().any()
    documents = document_ids(x0, int(x0[0, DOCUMENT_ENDS[0][0]]))
    starts = torch.stack([torch.tensor([int((row[:p] != row[p]).sum()) for p in range(SEQ)]) for row in documents])
    assert torch.equal(positions, torch.arange(SEQ) - starts)  # the rows' RoPE positions restart per document
    hf_dir, rows = os.path.join(converted, PACKED, "hf"), MODELS[PACKED]["tokenizer_ids"]
    error = _relative_error(ours, hf_reference(hf_dir, x_t, x0, mask_id, rows, documents, positions), mask_id)
    wrong = _relative_error(ours, hf_reference(hf_dir, x_t, x0, mask_id, rows, documents), mask_id)
    print(f"packed {PACKED} csbp{cp}: relative error {error:.2e}; at the sample's positions {wrong:.2e}")
    assert error <= TOLERANCE and wrong > 100 * TOLERANCE, (error, wrong)


def _safetensors(directory):
    from safetensors.torch import load_file

    tensors = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(directory, name)))
    return tensors


def _expected_export(family, original):
    """The original weights with the MASK rows as documented: a new row (or the unused row MASK takes)
    holding the mean of the original ids' rows."""
    sizes = MODELS[family]
    mask_id, mean_of = _mask_id(family), min(sizes["tokenizer_ids"], sizes.get("model_rows", 10 ** 9))
    expected = dict(original)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in expected:
            table = expected[name]
            rows = max(table.shape[0], mask_id + 1)
            grown = torch.cat([table, table.new_zeros(rows - table.shape[0], table.shape[1])])
            grown[mask_id] = _mask_embedding(table, mean_of)
            expected[name] = grown
    return expected


def _convert(*argv):
    done = run_command([sys.executable, os.path.join(REPO, "scripts", "convert_hf.py"), *argv], cwd=REPO,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    return done.returncode, done.stdout


def _assert_bit_exact(exported, expected):
    assert sorted(exported) == sorted(expected)
    for name, tensor in expected.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


def test_import_export_round_trip_is_bit_exact(converted, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    run_ranks(_run_conversions, 1, [("export_checkpoint", dict(load=os.path.join(converted, family, "ckpt"),
                                                                out=str(tmp_path / family))) for family in MODELS],
              timeout=600)
    for family in MODELS:
        out = str(tmp_path / family)
        original = _safetensors(os.path.join(converted, family, "hf"))
        _assert_bit_exact(_safetensors(out), _expected_export(family, original))
        config = AutoConfig.from_pretrained(out, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
        assert (config.mask_token_id, config.bdlm_block_size, config.block_size) == (_mask_id(family), 16, 16)
        assert (config.bdlm_objective, config.bdlm_label_shift) == ("bd3lm", 0) and not hasattr(config, "bd_size")
        assert tokenizer.mask_token == "<|mask|>" and tokenizer.mask_token_id == _mask_id(family)
        assert config.tie_word_embeddings == MODELS[family].get("tied", False)
        exported = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)  # transformers loads it offline
        source = AutoModelForCausalLM.from_pretrained(os.path.join(converted, family, "hf"), local_files_only=True)
        assert type(exported) is type(source), family  # Ministral 3 stays Ministral 3 (its query scaling)
        theirs, ours = source.model.rotary_emb, exported.model.rotary_emb  # transformers' RoPE, as it reads each
        assert torch.equal(ours.inv_freq, theirs.inv_freq) and ours.attention_scaling == theirs.attention_scaling
        assert config.rope_parameters.get("llama_4_scaling_beta") == \
            (MODELS[family].get("rope_parameters") or {}).get("llama_4_scaling_beta"), family
        if family in YARN_MODELS:  # the import of the export: the same flags
            source_flags = hf.model_flags(json.load(open(os.path.join(converted, family, "hf", "config.json"))))
            assert hf.model_flags(json.load(open(os.path.join(out, "config.json")))) == source_flags, family
            print(f"{family}: exported rope_parameters {config.rope_parameters}")


@pytest.mark.parametrize("yarn", [
    dict(factor=4.0, original_max_position_embeddings=16),
    dict(factor=32.0, original_max_position_embeddings=4096, beta_fast=8.0, beta_slow=0.5,
         correction_range_round_to_int=False),
    dict(factor=16.0, original_max_position_embeddings=16384, mscale=1.0, mscale_all_dim=1.0),  # Ministral 3's
    dict(factor=40.0, original_max_position_embeddings=4096, mscale=0.707, mscale_all_dim=0.707),  # DeepSeek's
    dict(factor=8.0, original_max_position_embeddings=8192, mscale=2.0),  # transformers would ignore mscale: factor
    dict(factor=8.0, original_max_position_embeddings=8192, mscale=0.0, mscale_all_dim=1.0),  # both ways
    dict(factor=1.0, original_max_position_embeddings=8192, mscale=3.0, mscale_all_dim=1.0),
], ids=["defaults", "betas, truncate false", "ministral", "deepseek", "mscale alone", "mscale 0", "factor 1"])
@pytest.mark.parametrize("beta", [None, 0.1])
def test_yarn_rope_parameters_read_back_as_written_and_as_transformers_reads_them(yarn, beta):
    """Export's rope parameters of each YaRN (and query scaling) are read back by the import as the same YaRN, and
    transformers gets from them the frequencies and attention factor megatron-core computes from our flags."""
    import transformers
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (YarnRotaryEmbedding,
                                                                                  _yarn_get_concentration_factor)

    from megatron_csbp.core.positions import QueryScaling, RotaryPositions, YaRN
    from megatron_csbp.mcore import cpu_backend

    positions = RotaryPositions(YaRN(**yarn), None if beta is None else QueryScaling(beta, yarn[
        "original_max_position_embeddings"]))
    family = hf.MINISTRAL3 if beta is not None else hf.LLAMA
    config = {"architectures": [family.architecture], "max_position_embeddings": 131072,
              "rope_parameters": {"rope_theta": 10000.0, **hf.rope_parameters(positions)}}
    assert hf.hf_positions(config, family.architecture, family) == positions
    y = positions.yarn
    megatron_factor = _yarn_get_concentration_factor(float(y.factor), float(y.mscale), float(y.mscale_all_dim))
    assert y.attention_factor == megatron_factor
    theirs = getattr(transformers, family.config_class)(hidden_size=64, num_attention_heads=4, head_dim=16,
                                                        max_position_embeddings=131072,
                                                        rope_parameters=dict(config["rope_parameters"]))
    read = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["yarn"]
    inv_freq, attention_factor = read(theirs, "cpu")
    assert attention_factor == megatron_factor
    written = config["rope_parameters"]
    assert ("attention_factor" in written) == (yarn.get("mscale", 1.0) != 1.0 and not (
        yarn.get("mscale") and yarn.get("mscale_all_dim"))), written  # only where transformers would differ
    if "attention_factor" in written:  # negative control: without it transformers derives another factor
        bare = getattr(transformers, family.config_class)(
            hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=131072,
            rope_parameters={key: value for key, value in written.items() if key != "attention_factor"})
        assert read(bare, "cpu")[1] != megatron_factor
    with cpu_backend.active():
        ours = YarnRotaryEmbedding(16, use_cpu_initialization=True, rotary_base=10000, **{
            "scaling_factor": y.factor, "original_max_position_embeddings": y.original_max_position_embeddings,
            "beta_fast": y.beta_fast, "beta_slow": y.beta_slow, "mscale": y.mscale, "mscale_all_dim": y.mscale_all_dim,
            "correction_range_round_to_int": y.correction_range_round_to_int})
        table, _ = ours.get_emb(3)
    assert torch.equal(table[1, 0, 0, :8].cpu(), inv_freq)  # position 1's angles: the frequencies


def training_data(converted, name, mask_id):
    """A small dataset in the ids below `mask_id` (the tokenizer's, never MASK), beside `name`'s import."""
    from megatron_csbp.data.datasets import write_indexed_dataset

    generator = torch.Generator().manual_seed(5)
    documents = [torch.randint(0, mask_id, (int(n),), generator=generator).tolist()
                 for n in torch.randint(20, 120, (60,), generator=generator)]
    prefix = os.path.join(converted, f"{name}_data")
    write_indexed_dataset(documents, prefix, mask_id + 1)
    return prefix


@pytest.fixture(scope="module")
def llama_data(converted):
    return training_data(converted, "llama", _mask_id("llama"))


def finetune_config(converted, name, tmp_path):
    """The recipe: `name`'s import's model flags beside configs/ar_to_bdlm_fast_dllm_v2.yaml, in one file."""
    path = tmp_path / "finetune.yaml"
    with open(os.path.join(REPO, "configs", "ar_to_bdlm_fast_dllm_v2.yaml"), encoding="utf-8") as recipe:
        path.write_text(open(_fragment(converted, name), encoding="utf-8").read() + recipe.read())
    return str(path)


def _pretrain(nproc, config, *overrides):
    launcher = [sys.executable] if nproc == 1 else [TORCHRUN, "--standalone", "--nproc-per-node", str(nproc)]
    done = run_command([*launcher, os.path.join(REPO, "scripts", "pretrain_bdlm.py"), "--config", config,
                        *overrides], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stdout[-6000:]
    return done.stdout


def test_round_trip_from_a_tp2_pp2_training_checkpoint(converted, llama_data, tmp_path):
    """Our loop loads the import at TP2 x PP2 and saves after one step at lr 0 (Adam moves nothing):
    exporting that checkpoint gives the very same HF weights."""
    save = str(tmp_path / "tp2pp2")
    _pretrain(4, finetune_config(converted, "llama", tmp_path), f"data-path={llama_data}", f"seq-length={SEQ}",
              f"bdlm-block-size={BLOCK}", "tensor-model-parallel-size=2", "pipeline-model-parallel-size=2",
              "train-iters=1", "lr=0", "min-lr=0", "lr-warmup-iters=0", "eval-iters=0", f"save={save}",
              "save-interval=1", "micro-batch-size=1", "global-batch-size=2")
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == "1"
    out = str(tmp_path / "exported")
    code, output = _convert("export", "--load", save, "--hf-dir", out)
    assert code == 0, output
    original = _safetensors(os.path.join(converted, "llama", "hf"))
    _assert_bit_exact(_safetensors(out), _expected_export("llama", original))
    config = json.load(open(os.path.join(out, "config.json")))  # the recipe trains Fast-dLLM v2: shifted labels
    assert {key: config[key] for key in ("bdlm_objective", "bdlm_label_shift", "block_size", "bd_size",
                                         "mask_token_id")} == {"bdlm_objective": "fast-dllm-v2", "bdlm_label_shift": 1,
                                                               "block_size": BLOCK, "bd_size": BLOCK,
                                                               "mask_token_id": _mask_id("llama")}


def test_finetune_first_loss_is_the_huggingface_models(converted, llama_data, tmp_path):
    """`--load CKPT --finetune` with the recipe; at noise 1 view one masks every token and view two none, so
    the Fast-dLLM v2 loss is the mean CE of the HF model's noisy row p (all MASK) predicting token p+1."""
    from megatron_csbp.training import providers
    from megatron_csbp.training.arguments import validate_args
    from megatron_csbp.training.config import parse_args

    config = finetune_config(converted, "llama", tmp_path)
    overrides = [f"data-path={llama_data}", f"seq-length={SEQ}", f"bdlm-block-size={BLOCK}", "train-iters=2",
                 "lr-warmup-iters=0",
                 "bdlm-noise-range=1 1", "eval-iters=0", f"save={tmp_path / 'finetuned'}", "save-interval=2",
                 f"data-cache-path={tmp_path / 'cache'}"]
    output = _pretrain(1, config, *overrides)
    first = float(re.search(r"iteration\s+1/\s*2 \|.*?lm loss: ([-+0-9.eE]+)", output).group(1))

    args = validate_args(parse_args(["--config", config, *overrides]), 1)
    run_providers = providers.RunProviders(args)
    train, _, _ = run_providers.train_valid_test_datasets_provider()
    x0 = torch.stack([train[i]["tokens"] for i in range(args.global_batch_size)])
    mask_id = run_providers.vocabulary.mask_token_id
    assert mask_id == _mask_id("llama") and run_providers.vocabulary.padded_vocab_size == mask_id + 1  # no padding
    logits = hf_reference(os.path.join(converted, "llama", "hf"), torch.full_like(x0, mask_id), x0, mask_id,
                          _mask_id("llama"))
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).double(),
                                           x0[:, 1:].reshape(-1), reduction="mean").item()
    print(f"first-iteration loss {first:.6e}, HF model's Fast-dLLM v2 loss {ce:.6e}")
    assert first == pytest.approx(ce, rel=TOLERANCE)
    assert " loaded checkpoint from " in output


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["MixtralForCausalLM"], "num_local_experts": 8}, "mixture-of-experts"),
    ({"sliding_window": 4096}, "sliding-window attention (sliding_window=4096) cannot be expressed for Llama"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "Llama takes no per-layer sliding window"),
    ({"layer_types": ["linear_attention", "full_attention"]}, "linear-attention"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0}},
     "rope scaling type 'longrope'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0}}, "rope_type yarn without its factor"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "attention_factor": 3.0}},
     "(attention factor 3.0) make no YaRN megatron-core computes"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 0.5}},
     "--yarn-rotary-scaling-factor must be a finite number >= 1; got 0.5"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "llama_4_scaling_beta": 0.1}},
     "llama_4_scaling_beta, which transformers' Llama does not apply"),
    ({"architectures": ["Ministral3ForCausalLM"], "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
     "Llama 4's query scaling is converted with YaRN"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": -1}},
     "--yarn-beta-fast must be a finite number > 0; got -1"),
    ({"tie_word_embeddings": True}, "lm_head.weight differs"),
])
def test_import_refuses_what_the_mapping_cannot_express(converted, tmp_path, capsys, change, message):
    hf_dir = str(tmp_path / "model")
    shutil.copytree(os.path.join(converted, "llama", "hf"), hf_dir)
    config = json.load(open(os.path.join(hf_dir, "config.json")))
    config.update(change)
    json.dump(config, open(os.path.join(hf_dir, "config.json"), "w"))
    code = convert_hf.main(["import", "--hf-dir", hf_dir, "--save", str(tmp_path / "ckpt")])
    error = capsys.readouterr().err.strip()
    assert code == 2 and message in error and len(error.splitlines()) == 1, error
    assert error.startswith("convert_hf.py: error: ")
    assert not os.path.exists(tmp_path / "ckpt" / "iter_0000000")


@pytest.mark.parametrize("text, message", [
    ('{"architectures": ["LlamaForCausalLM"],', "is not valid JSON (line 1, column 40: Expecting property name"),
    ('["LlamaForCausalLM"]', "holds a JSON list, not the object of a Hugging Face model config"),
])
def test_a_damaged_config_json_is_one_line_exit_2(tmp_path, capsys, text, message):
    hf_dir = tmp_path / "model"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(text)
    code = convert_hf.main(["import", "--hf-dir", str(hf_dir), "--save", str(tmp_path / "ckpt")])
    error = capsys.readouterr().err.strip()
    assert code == 2 and len(error.splitlines()) == 1, error
    assert error.startswith(f"convert_hf.py: error: --hf-dir {hf_dir}: {hf_dir}/config.json ") and message in error
    assert not os.path.exists(tmp_path / "ckpt")


def test_an_import_the_trainer_refuses_leaves_nothing_behind(converted, tmp_path, capsys):
    """The tiny Llama has 4 heads: TP3 passes the mapping but not the trainer's validation, which runs after the
    tokenizer and model.yaml are written; the refusal must take them away again (a model.yaml pointing at a
    checkpoint that was never written looks like a finished import)."""
    save = tmp_path / "ckpt"
    code = convert_hf.main(["import", "--hf-dir", os.path.join(converted, "llama", "hf"),
                            "--save", str(save), "--tensor-model-parallel-size", "3"])
    error = capsys.readouterr().err.strip()
    assert code == 2 and len(error.splitlines()) == 1 and "--tensor-model-parallel-size" in error, error
    assert not save.exists() and not _leftovers(save)
    save.mkdir()  # an empty --save that existed before stays, empty
    assert convert_hf.main(["import", "--hf-dir", os.path.join(converted, "llama", "hf"),
                            "--save", str(save), "--tensor-model-parallel-size", "3"]) == 2
    assert os.listdir(save) == [] and not _leftovers(save)


def test_mask_token_id_flag_sets_mask_and_vocabulary(tmp_path):
    """`--bdlm-mask-token-id`: a new id further on grows the vocabulary; an existing id does not."""
    from megatron_csbp.core.rules import ConfigError
    from megatron_csbp.data import datasets, tokenizers
    from megatron_csbp.training.checkpointing import CheckpointError, check_compatible
    from megatron_csbp.training.config import parse_args

    args = parse_args([])
    # The default: right after the tokenizer's.
    assert tokenizers.vocabulary(args, tokenizers.build_tokenizer(args)) == (257, 384)
    args = parse_args(["bdlm-mask-token-id=400"])
    assert tokenizers.vocabulary(args, tokenizers.build_tokenizer(args)) == (400, 512)
    args = parse_args(["bdlm-mask-token-id=100"])
    args.mask_token_id, args.padded_vocab_size = tokenizers.vocabulary(args, tokenizers.build_tokenizer(args))
    assert (args.mask_token_id, args.padded_vocab_size) == (100, 384)
    with pytest.raises(CheckpointError, match="--bdlm-mask-token-id 257, this run has --bdlm-mask-token-id 100"):
        check_compatible({"mask_token_id": 257}, args, "ckpt")
    prefix = str(tmp_path / "ids")
    datasets.write_indexed_dataset([[5, 200, 256]], prefix, 257)
    assert datasets.check_vocabulary([prefix], 100, 384, 257) == 256  # ids above an existing MASK id are data
    with pytest.raises(ConfigError, match="beyond the tokenizer's ids"):
        datasets.check_vocabulary([prefix], 100, 384, 200)


def test_existing_token_as_mask_round_trips_exactly(converted, tmp_path):
    """`--mask-token` names an unused special token: its id is MASK, no row changes, export is bit-exact."""
    import yaml

    hf_dir, save = os.path.join(converted, "qwen3", "hf"), str(tmp_path / "ckpt")
    run_ranks(_run_conversions, 1, [
        ("import_checkpoint", dict(hf_dir=hf_dir, save=save, mask_token="<|unused_0|>",
                                   make_vocab_size_divisible_by=DIVISIBLE_BY)),
        ("export_checkpoint", dict(load=save, out=str(tmp_path / "out")))], timeout=600)
    fragment = yaml.safe_load(open(tmp_path / "ckpt" / "model.yaml"))
    assert fragment["bdlm-mask-token-id"] == 1  # the tokenizer's second special token
    _assert_bit_exact(_safetensors(str(tmp_path / "out")), _safetensors(hf_dir))
    from transformers import AutoTokenizer
    assert AutoTokenizer.from_pretrained(str(tmp_path / "out")).mask_token_id == 1


def test_a_converted_model_needs_finetune(converted, llama_data, tmp_path):
    config = finetune_config(converted, "llama", tmp_path)
    launcher = [sys.executable, os.path.join(REPO, "scripts", "pretrain_bdlm.py"), "--config", config,
                f"data-path={llama_data}", f"seq-length={SEQ}", f"bdlm-block-size={BLOCK}", "finetune=false",
                "train-iters=1", "lr-warmup-iters=0", "eval-iters=0", "save=null"]
    done = subprocess.run(launcher, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert done.returncode == 2 and "holds a model only" in done.stdout and "--finetune" in done.stdout, done.stdout


# ------------------------------------------------------------------ nothing published is half-written, stale or mixed
def _leftovers(target):
    """Private temporaries (or set-aside copies) of `target` beside it."""
    parent, name = os.path.dirname(str(target)), os.path.basename(str(target))
    return sorted(entry for entry in os.listdir(parent) if entry.startswith(f".{name}."))


def _digests(directory):
    return {name: hashlib.sha256(open(os.path.join(directory, name), "rb").read()).hexdigest()
            for name in sorted(os.listdir(directory))}


# A convert_hf.py run that stops at a named point (`name` or its k-th time, `name#k`), says so on stdout and
# waits for a line on stdin; the test kills it there (SIGKILL) or lets it go on. The points are the functions
# the conversion calls, wrapped here, in this process only.
_STOPPING_RUN = r'''
import collections, sys

seen = collections.Counter()


def stop(name, stage):
    seen[name] += 1
    if stage in (name, f"{name}#{seen[name]}"):
        print(f"STOPPED AT {stage}", flush=True)
        sys.stdin.readline()


def wrap(owner, attribute, stage, before=None, after=None):
    original = getattr(owner, attribute)
    def wrapped(*args, **kwargs):
        if before:
            stop(before, stage)
        result = original(*args, **kwargs)
        if after:
            stop(after, stage)
        return result
    setattr(owner, attribute, wrapped)


def main(stage, argv):
    import safetensors.torch
    from megatron.core import dist_checkpointing
    from megatron_csbp.runtime import publish
    from megatron_csbp.training import checkpointing
    wrap(safetensors.torch, "save_file", stage, after="shard written")
    wrap(checkpointing, "save_checkpoint", stage, before="side files written", after="checkpoint written")
    wrap(dist_checkpointing, "save", stage, after="iteration half-written")
    wrap(publish, "publish_directory", stage, before="before publish")
    wrap(publish, "_exchange", stage, after="exchanged")
    from megatron_csbp.tools import convert_hf
    return convert_hf.main(argv)


if __name__ == "__main__":  # not in the helper processes megatron's checkpoint writer spawns
    sys.exit(main(sys.argv[1], sys.argv[2:]))
'''



def _stopped_run(tmp_path, stage, *argv):
    """Starts convert_hf.py stopping at `stage`; returns the process once it stands there."""
    script = tmp_path / "stopping_run.py"
    script.write_text(_STOPPING_RUN)
    process = start([sys.executable, str(script), stage, *argv], cwd=REPO, stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                    env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO})
    lines = []
    for line in process.stdout:
        lines.append(line)
        if line.startswith(f"STOPPED AT {stage}"):
            return process
    kill_tree(process)
    raise AssertionError(f"the run never reached {stage!r} (exit {process.returncode}):\n{''.join(lines)[-3000:]}")


def _kill(process):
    """SIGKILL, as a user's `kill -9` or the OOM killer, to the run and the helpers it started (megatron-core's
    checkpoint-writer queue manager and its resource tracker, which a kill of the run alone leaves orphaned)."""
    kill_tree(process)


@pytest.fixture(scope="module")
def sharded_export(converted, tmp_path_factory):
    """An earlier export of the Llama import in 5 shards (index + model-0000k-of-00005.safetensors)."""
    out = str(tmp_path_factory.mktemp("earlier") / "export")
    run_ranks(_run_conversions, 1, [("export_checkpoint", dict(load=os.path.join(converted, "llama", "ckpt"), out=out,
                                                                max_shard_bytes=100_000))], timeout=600)
    assert "model.safetensors.index.json" in os.listdir(out) and len(_safetensors_files(out)) == 5
    return out


def _safetensors_files(directory):
    return sorted(name for name in os.listdir(directory) if name.endswith(".safetensors"))


def test_a_killed_export_leaves_the_previous_one_whole_and_a_re_export_leaves_nothing_stale(converted, sharded_export,
                                                                                             tmp_path):
    """An export over an earlier, sharded one (--overwrite, one shard this time), killed while writing its shards
    and just before publishing: the earlier export is there, byte for byte, and loads. Killed right after the
    exchange: the new export is there, whole. Run to the end: exactly the new files (no stale
    model-0000k-of-00005 shards or index beside model.safetensors, which transformers would prefer), and the
    killed runs' private directories are gone."""
    from transformers import AutoModelForCausalLM

    out = str(tmp_path / "export")
    shutil.copytree(sharded_export, out)
    earlier = _digests(out)
    argv = ["export", "--load", os.path.join(converted, "llama", "ckpt"), "--hf-dir", out, "--overwrite"]
    for stage in ("shard written", "before publish"):
        _kill(_stopped_run(tmp_path, stage, *argv))
        assert _digests(out) == earlier, stage
        assert _leftovers(out), "a killed run leaves its private directory (removed by the next run)"
    AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    _kill(_stopped_run(tmp_path, "exchanged", *argv))
    assert _safetensors_files(out) == ["model.safetensors"] and "model.safetensors.index.json" not in os.listdir(out)
    code, output = _convert(*argv)
    assert code == 0, output
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                                       "tokenizer_config.json"]
    assert not _leftovers(out)
    original = _safetensors(os.path.join(converted, "llama", "hf"))
    _assert_bit_exact(_safetensors(out), _expected_export("llama", original))
    AutoModelForCausalLM.from_pretrained(out, local_files_only=True)


def test_export_refuses_a_non_empty_hf_dir_without_overwrite(converted, sharded_export, tmp_path, capsys):
    out = str(tmp_path / "export")
    shutil.copytree(sharded_export, out)
    earlier = _digests(out)
    code = convert_hf.main(["export", "--load", os.path.join(converted, "llama", "ckpt"), "--hf-dir", out])
    error = capsys.readouterr().err.strip()
    assert code == 2 and len(error.splitlines()) == 1 and "--overwrite" in error and "is not empty" in error, error
    assert _digests(out) == earlier


def test_export_reads_the_imported_config_under_the_import_s_field_check(converted, tmp_path, capsys):
    """The checkpoint's hf/config.json (the imported model's, which the export updates) goes through the same field
    check: a wrongly typed field is one line naming --load, the file and the field, exit 2, nothing written; a null
    rope_parameters (transformers' default) is replaced by the checkpoint's RoPE."""
    import argparse

    from megatron.core import dist_checkpointing

    from megatron_csbp.training import checkpointing

    load = os.path.join(converted, "llama", "ckpt")
    side = os.path.join(load, "hf", "config.json")
    original = open(side).read()
    out = str(tmp_path / "export")
    try:
        with open(side, "w") as handle:
            json.dump({**json.loads(original), "mlp_only_layers": 1}, handle)
        code = convert_hf.main(["export", "--load", load, "--hf-dir", out])
    finally:
        with open(side, "w") as handle:
            handle.write(original)
    error = capsys.readouterr().err.strip()
    assert code == 2 and error == (f"convert_hf.py: error: --load {load}: {side}: mlp_only_layers is 1, expected a "
                                   f"list of layer numbers; restore the model's config.json"), error
    assert not os.path.exists(out) and not _leftovers(out)
    args = argparse.Namespace(**checkpointing.saved_args(dist_checkpointing.load_common_state_dict(
        os.path.join(load, "iter_0000000"))))
    config = convert_hf.export_config(args, {**json.loads(original), "rope_parameters": None}, 384, torch.float32)
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": float(args.rotary_base)}


def test_a_killed_import_leaves_nothing_and_the_next_one_completes(converted, tmp_path):
    """Killed after writing the tokenizer and model.yaml, half-way through the checkpoint (iter_0000000.tmp
    written) and just before publishing: `--save` holds no hf/, model.yaml or iter_* (at most the stale writer
    lock, which the next run takes over). Each run takes over the lock the previous one left; the last one
    completes, and no private directory is left beside."""
    from megatron_csbp.runtime import save_lock
    from megatron_csbp.training import checkpointing

    save = tmp_path / "ckpt"
    argv = ["import", "--hf-dir", os.path.join(converted, "llama", "hf"), "--save", str(save),
            "--make-vocab-size-divisible-by", str(DIVISIBLE_BY)]
    for stage in ("side files written", "iteration half-written", "before publish#2"):
        process = _stopped_run(tmp_path, stage, *argv)
        _kill(process)
        assert not save.exists() or os.listdir(save) == [save_lock.LOCK], (stage, os.listdir(save))
        assert _leftovers(save)
    code, output = _convert(*argv)
    assert code == 0, output
    assert "taking over the stale lock" in output
    assert sorted(os.listdir(save)) == ["hf", "iter_0000000", "latest_checkpointed_iteration.txt", "model.yaml"]
    assert not _leftovers(save)
    checkpointing.check_complete(str(save / "iter_0000000"), log=lambda *_: None)
    import yaml
    fragment = yaml.safe_load(open(save / "model.yaml"))
    assert fragment["tokenizer-model"] == str(save / "hf" / "tokenizer.json") and fragment["load"] == str(save)


def test_a_second_import_into_the_same_save_is_refused_and_takes_nothing(converted, tmp_path, capsys):
    """Import A holds --save's lock while it works; import B into the same --save is refused at once, in one
    line naming A, and A (let go on) completes with its model.yaml."""
    save = tmp_path / "ckpt"
    argv = ["import", "--hf-dir", os.path.join(converted, "llama", "hf"), "--save", str(save),
            "--make-vocab-size-divisible-by", str(DIVISIBLE_BY)]
    first = _stopped_run(tmp_path, "checkpoint written", *argv)
    try:
        code = convert_hf.main(argv)
        error = capsys.readouterr().err.strip()
        assert code == 2 and len(error.splitlines()) == 1 and "is in use by another run" in error, error
        assert f"pid {first.pid}" in error
        first.stdin.write("\n")
        first.stdin.flush()
        output, _ = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            _kill(first)
    assert first.returncode == 0, output
    assert sorted(os.listdir(save)) == ["hf", "iter_0000000", "latest_checkpointed_iteration.txt", "model.yaml"]
    assert not _leftovers(save)


def test_import_refuses_a_training_runs_save(converted, tmp_path, capsys):
    """A --save with a training run's tracker and checkpoint: refused in one line, not a byte changed (an import
    there would repoint the tracker to iteration 0)."""
    save = tmp_path / "run"
    (save / "iter_0000020").mkdir(parents=True)
    (save / "iter_0000020" / "common.pt").write_bytes(b"weights")
    (save / "latest_checkpointed_iteration.txt").write_text("20")
    before = {path: path.read_bytes() for path in save.rglob("*") if path.is_file()}
    code = convert_hf.main(["import", "--hf-dir", os.path.join(converted, "llama", "hf"),
                            "--save", str(save)])
    error = capsys.readouterr().err.strip()
    assert code == 2 and len(error.splitlines()) == 1 and "holds a training checkpoint" in error, error
    assert {path: path.read_bytes() for path in save.rglob("*") if path.is_file()} == before
    assert not _leftovers(save)


def _damage(kind, hf_dir, tmp_path):
    """Makes a copy of the Llama HF directory damaged in one way; returns (argv, message, target)."""
    model = str(tmp_path / "model")
    shutil.copytree(hf_dir, model)
    save = str(tmp_path / "ckpt")
    weights = os.path.join(model, "model.safetensors")
    config_path = os.path.join(model, "config.json")
    config = json.load(open(config_path))
    argv = ["import", "--hf-dir", model, "--save", save]
    if kind == "garbage safetensors":
        open(weights, "wb").write(os.urandom(5000))
        return argv, "model.safetensors is not a readable safetensors file, damaged or truncated", save
    if kind == "truncated safetensors":
        os.truncate(weights, os.path.getsize(weights) - 1000)
        return argv, "model.safetensors is not a readable safetensors file, damaged or truncated", save
    if kind in ("config disagrees", "config lacks a key"):
        if kind == "config disagrees":
            config["intermediate_size"] = 128
        else:
            del config["num_hidden_layers"]
        json.dump(config, open(config_path, "w"))
        message = ("config.json disagrees with the weights: model.layers.0.mlp.down_proj.weight is [64, 96] in "
                   "model.safetensors, config.json makes it [64, 128]" if kind == "config disagrees" else
                   "config.json lacks num_hidden_layers")
        return argv, message, save
    if kind == "index names a missing shard":
        from safetensors.torch import load_file, save_file
        tensors = load_file(weights)
        os.remove(weights)
        names = sorted(tensors)
        halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
        save_file({name: tensors[name] for name in halves["model-00001-of-00002.safetensors"]},
                  os.path.join(model, "model-00001-of-00002.safetensors"))
        json.dump({"weight_map": {name: file for file, part in halves.items() for name in part}},
                  open(os.path.join(model, "model.safetensors.index.json"), "w"))
        return argv, ("model.safetensors.index.json names the shard model-00002-of-00002.safetensors, which is "
                      "missing"), save
    if kind == "tokenizer larger than the embedding":
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(model)
        tokenizer.add_tokens([f"<extra_{i}>" for i in range(10)])
        tokenizer.save_pretrained(model)
        return argv, "its tokenizer has 393 ids but the model's embedding only 383 rows", save
    if kind == "huge vocabulary padding":
        return argv + ["--make-vocab-size-divisible-by", str(10 ** 9)], \
            "--make-vocab-size-divisible-by 1000000000 (x TP 1) pads the 384 ids to 1000000000 rows", save
    if kind == "save is a file":
        open(save, "w").write("x")
        return argv, f"--save {save} is a file", save
    if kind == "save under a file":
        open(save, "w").write("x")
        return argv[:-1] + [os.path.join(save, "inner")], "a file stands where a directory is needed", save
    if kind == "hf-dir is a file":
        return ["import", "--hf-dir", config_path, "--save", save], "is a file, not a directory", save
    raise AssertionError(kind)


REFUSED_INPUTS = ["garbage safetensors", "truncated safetensors", "config disagrees", "config lacks a key",
                  "index names a missing shard", "tokenizer larger than the embedding", "huge vocabulary padding",
                  "save is a file", "save under a file", "hf-dir is a file"]


@pytest.mark.parametrize("kind", REFUSED_INPUTS)
def test_bad_import_inputs_are_one_line_exit_2_and_nothing_written(converted, tmp_path, capsys, kind):
    argv, message, target = _damage(kind, os.path.join(converted, "llama", "hf"), tmp_path)
    existed = os.path.exists(target)
    code = convert_hf.main(argv)
    error = capsys.readouterr().err.strip()
    assert code == 2 and len(error.splitlines()) == 1 and error.startswith("convert_hf.py: error: "), error
    assert message in error, error
    assert os.path.exists(target) == existed and not _leftovers(target)


def _refusal(argv, patches):
    """convert_hf.main(argv) with `patches` [(owner, attribute, replacement)] applied; (exit, stderr)."""
    import contextlib
    import io

    originals = [(owner, attribute, getattr(owner, attribute)) for owner, attribute, _ in patches]
    stderr = io.StringIO()
    try:
        for owner, attribute, replacement in patches:
            setattr(owner, attribute, replacement)
        with contextlib.redirect_stderr(stderr):
            code = convert_hf.main(argv)
    finally:
        for owner, attribute, original in originals:
            setattr(owner, attribute, original)
    return code, stderr.getvalue().strip()


def _no_space(*_, **__):
    raise OSError(errno.ENOSPC, "No space left on device")


def _read_only(*_, **__):
    raise OSError(errno.EROFS, "Read-only file system")


def _full_disk_usage(path):
    return shutil._ntuple_diskusage(10 ** 12, 10 ** 12 - 1000, 1000)


def _write_some_then_fill(tensors, path, metadata=None):
    open(path, "wb").write(b"\0" * 1000)  # a partial file, as a filling disk leaves
    raise OSError(errno.ENOSPC, "No space left on device")


def _refusals_on_a_rank(rank, world, load, hf_dir, previous, root):
    """On one rank: export and import under a full disk (checked before writing, or filling mid-write) and a
    read-only location; each case's (exit, stderr, what the target holds afterwards)."""
    import safetensors.torch
    import shutil as shutil_module
    import tempfile
    from megatron.core import dist_checkpointing

    export = ["export", "--load", load, "--hf-dir", previous, "--overwrite"]
    save = os.path.join(root, "ckpt")
    imports = ["import", "--hf-dir", hf_dir, "--save", save, "--make-vocab-size-divisible-by", str(DIVISIBLE_BY)]
    cases = {"export, disk full before": (export, [(shutil_module, "disk_usage", _full_disk_usage)]),
             "export, disk fills while writing": (export, [(safetensors.torch, "save_file", _write_some_then_fill)]),
             "export, read-only": (export, [(tempfile, "mkdtemp", _read_only)]),
             "import, disk fills while writing": (imports, [(dist_checkpointing, "save", _no_space)]),
             "import, disk full before": (imports, [(shutil_module, "disk_usage", _full_disk_usage)]),
             "import, read-only": (imports, [(tempfile, "mkdtemp", _read_only)])}
    results = {}
    for name, (argv, patches) in cases.items():
        code, error = _refusal(argv, patches)
        target = argv[argv.index("--hf-dir" if argv[0] == "export" else "--save") + 1]
        results[name] = (code, error, _digests(target) if os.path.isdir(target) else None, _leftovers(target))
    return results


@pytest.fixture(scope="module")
def refusals_after_start(converted, sharded_export, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("refusals"))
    previous = os.path.join(root, "export")
    shutil.copytree(sharded_export, previous)
    return _digests(previous), run_ranks(_refusals_on_a_rank, 1, os.path.join(converted, "llama", "ckpt"),
                                         os.path.join(converted, "llama", "hf"), previous, root, timeout=600)[0]


@pytest.mark.parametrize("case, message", [
    ("export, disk full before", "are to be written but only 0.0 MiB are free there"),
    ("export, disk fills while writing", "no space left on device while writing the export; nothing was published"),
    ("export, read-only", "cannot write in"),
    ("import, disk full before", "are to be written but only 0.0 MiB are free there"),
    ("import, disk fills while writing", "no space left on device while writing the import; nothing was published"),
    ("import, read-only", "cannot write in"),
])
def test_a_full_disk_or_read_only_target_is_one_line_and_nothing_published(refusals_after_start, case, message):
    previous, results = refusals_after_start
    code, output, holds, leftovers = results[case]
    error = output.splitlines()[-1]  # megatron's and torch's own warnings come before it, on this rank
    assert code == 2 and error.startswith("convert_hf.py: error: ") and "Traceback" not in output, output
    assert message in error, output
    assert holds == (previous if case.startswith("export") else None), "the previous export is untouched"
    assert not leftovers


@pytest.mark.parametrize("argv, message", [
    (["--max-shard-size-mb", "0"], "--max-shard-size-mb 0: the largest safetensors file, in MiB, must be positive"),
    (["--max-shard-size-mb", "-3"], "--max-shard-size-mb -3"),
], ids=["zero", "negative"])
def test_export_refuses_a_shard_size_that_is_not_positive(converted, tmp_path, capsys, argv, message):
    out = tmp_path / "export"
    code = convert_hf.main(["export", "--load", os.path.join(converted, "llama", "ckpt"), "--hf-dir",
                            str(out), *argv])
    error = capsys.readouterr().err.strip()
    assert code == 2 and len(error.splitlines()) == 1 and message in error, error
    assert not out.exists()


def test_export_refuses_a_file_a_non_model_directory_and_its_own_checkpoint(converted, tmp_path, capsys):
    load = os.path.join(converted, "llama", "ckpt")
    (tmp_path / "file").write_text("x")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "mine.txt").write_text("mine")
    for target, flags, message in [(tmp_path / "file", [], "is a file"),
                                   (tmp_path / "notes", ["--overwrite"], "holds no config.json"),
                                   (os.path.join(converted, "llama"), ["--overwrite"], "which the export reads")]:
        code = convert_hf.main(["export", "--load", load, "--hf-dir", str(target), *flags])
        error = capsys.readouterr().err.strip()
        assert code == 2 and len(error.splitlines()) == 1 and message in error, error
    assert (tmp_path / "notes" / "mine.txt").read_text() == "mine"


def test_export_config_says_how_the_model_decodes(converted):
    """config.json names the objective, its label shift and the block size in our keys and the engines'
    (block_size, mask_token_id; bd_size only for Fast-dLLM v2's shifted labels, also dropped from a base
    config that had it)."""
    import argparse

    import torch
    from megatron.core import dist_checkpointing

    from megatron_csbp.training import checkpointing

    directory = os.path.join(converted, "llama", "ckpt", "iter_0000000")
    args = argparse.Namespace(**checkpointing.saved_args(dist_checkpointing.load_common_state_dict(directory)))
    expected = {"bd3lm": {"bdlm_objective": "bd3lm", "bdlm_label_shift": 0, "block_size": 8, "bdlm_block_size": 8},
                "fast-dllm-v2": {"bdlm_objective": "fast-dllm-v2", "bdlm_label_shift": 1, "block_size": 8,
                                 "bdlm_block_size": 8, "bd_size": 8}}
    for objective, keys in expected.items():
        args.bdlm_objective, args.bdlm_block_size = objective, 8
        config = convert_hf.export_config(args, {"bd_size": 99, "architectures": ["LlamaForCausalLM"]}, 384,
                                       torch.float32)
        assert {key: config.get(key) for key in (*keys, "bd_size")} == {"bd_size": None, **keys}, objective
        assert config["mask_token_id"] == _mask_id("llama")


@pytest.fixture
def small_disks(tmp_path):
    """Real filesystems: a 1 MiB tmpfs (an import or export of the tiny Llama needs more) and a read-only one
    (64 MiB).
    Needs root (mount); the monkeypatched cases above cover the same paths everywhere."""
    disks = {}
    for name, options in (("small", "size=1m"), ("read-only", "size=64m,ro")):
        disks[name] = tmp_path / name
        disks[name].mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(disks[name])], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()})")
    try:
        yield disks
    finally:
        for mount in disks.values():
            subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_real_full_or_read_only_disk_is_one_line_and_nothing_written(converted, small_disks, capsys):
    for disk, message in (("small", "are to be written but only"), ("read-only", "(Read-only file system)")):
        save = small_disks[disk] / "ckpt"
        code = convert_hf.main(["import", "--hf-dir", os.path.join(converted, "llama", "hf"), "--save", str(save)])
        error = capsys.readouterr().err.strip()
        assert code == 2 and len(error.splitlines()) == 1 and message in error, error
        assert os.listdir(small_disks[disk]) == []
    out = small_disks["small"] / "export"
    code, output = _convert("export", "--load", os.path.join(converted, "llama", "ckpt"), "--hf-dir", str(out))
    assert code == 2 and "convert_hf.py: error: --hf-dir" in output and "are to be written but only" in output, output
    assert "Traceback" not in output and os.listdir(small_disks["small"]) == []
