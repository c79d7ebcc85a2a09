"""The vocabulary padding takes no probability, and one import trains at any TP size.

Tiny Llama, Qwen2 and Qwen3 models with a 300-id tokenizer are imported once (at TP1, Megatron's default
`--make-vocab-size-divisible-by 128`). MASK is id 300: a new row of the Llama (301 real ids), an unused row of
the Qwens (320 HF rows, all kept: 320 real ids). The model has 384 rows at TP1 and 512 at TP2, so 64 to 211
padding columns past the real ids. Trained from that one import at TP1 and at TP2, the first lm loss equals
the HF model's own BD3-LM NELBO on the same batch at noise 1 (every noisy token MASK, weight 1/t = 1: the mean
CE of noisy row p predicting token p, the softmax over the HF model's rows without MASK), computed here from
`transformers`. The control: the same NELBO with the padding columns left in the softmax (logit 0 for each
zero padding row) is what a model that lets padding take probability reports, and it differs from ours by
far more than the tolerance.
"""

import os
import re

import pytest
import torch

from megatron_csbp.tools import convert_hf, tiny_hf_model
from test_hf import BLOCK, SEQ, TOLERANCE, _pretrain, hf_reference
from spawn import run_ranks

TOKENIZER_IDS = 300
MASK_ID = TOKENIZER_IDS  # a new MASK right after the tokenizer's ids
FAMILIES = {"llama": dict(family="llama", tokenizer_ids=TOKENIZER_IDS),
            "qwen2": dict(family="qwen2", tokenizer_ids=TOKENIZER_IDS, model_rows=320, tied=True),
            "qwen3": dict(family="qwen3", tokenizer_ids=TOKENIZER_IDS, model_rows=320)}
PADDED = {1: 384, 2: 512}  # the real ids padded to a multiple of 128 x TP


def _make_and_import(rank, world, root):
    make, convert = tiny_hf_model, convert_hf
    for name, settings in FAMILIES.items():
        hf_dir = make.make_model(**settings, output=os.path.join(root, name, "hf"))
        convert.import_checkpoint(hf_dir, os.path.join(root, name, "ckpt"), log=lambda *_: None)  # at TP1


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """`root/<family>/{hf,ckpt}` and a dataset of tokenizer ids (never MASK) at `root/data`."""
    from megatron_csbp.data.datasets import write_indexed_dataset

    root = str(tmp_path_factory.mktemp("padding"))
    run_ranks(_make_and_import, 1, root, timeout=600)
    generator = torch.Generator().manual_seed(3)
    documents = [torch.randint(0, TOKENIZER_IDS, (int(n),), generator=generator).tolist()
                 for n in torch.randint(20, 120, (60,), generator=generator)]
    write_indexed_dataset(documents, os.path.join(root, "data"), TOKENIZER_IDS + 1)
    return root


def _overrides(root, tmp_path):
    return [f"data-path={os.path.join(root, 'data')}", f"seq-length={SEQ}", f"bdlm-block-size={BLOCK}",
            "bdlm-objective=bd3lm", "bdlm-noise-range=1 1", "train-iters=1", "lr-warmup-iters=0", "eval-iters=0",
            "micro-batch-size=2", "global-batch-size=2", "lr=1e-4", "use-cpu-initialization=true",
            "split=98,2,0", "log-interval=1", f"data-cache-path={tmp_path / 'cache'}"]


def _first_batch(config, overrides):
    """The first global batch's clean tokens `[b, L]`, as the trainer's datasets give them, and the vocabulary."""
    from megatron_csbp.training import providers
    from megatron_csbp.training.arguments import validate_args
    from megatron_csbp.training.config import parse_args

    args = validate_args(parse_args(["--config", config, *overrides]), 1)
    run_providers = providers.RunProviders(args)
    train, _, _ = run_providers.train_valid_test_datasets_provider()
    return torch.stack([train[i]["tokens"] for i in range(args.global_batch_size)]), run_providers.vocabulary


def _nelbo(logits, x0, columns):
    """Mean CE of row p predicting x0[p] with the softmax over `columns` logits (MASK's column is -inf)."""
    logits = logits[..., :columns].double().clone()
    if MASK_ID < columns:
        logits[..., MASK_ID] = float("-inf")
    return torch.nn.functional.cross_entropy(logits.reshape(-1, columns), x0.reshape(-1)).item()


def _with_zero_padding(logits, padded):
    """The HF logits as a model whose padding rows (and a new MASK row) are zero rows would score them: logit 0
    for every column past the HF model's rows."""
    zeros = logits.new_zeros(*logits.shape[:-1], padded - logits.shape[-1])
    return torch.cat([logits, zeros], dim=-1)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_first_loss_is_the_huggingface_nelbo_at_tp1_and_tp2(imported, family, tmp_path):
    config = os.path.join(imported, family, "ckpt", "model.yaml")
    overrides = _overrides(imported, tmp_path)
    x0, vocabulary = _first_batch(config, overrides)
    hf_rows = FAMILIES[family].get("model_rows", TOKENIZER_IDS)
    real_ids = max(hf_rows, MASK_ID + 1)
    assert (vocabulary.mask_token_id, vocabulary.num_ids, vocabulary.padded_vocab_size) == (MASK_ID, real_ids, 384)
    logits = hf_reference(os.path.join(imported, family, "hf"), torch.full_like(x0, MASK_ID), x0, MASK_ID,
                          TOKENIZER_IDS)
    reference = _nelbo(logits, x0, hf_rows)
    for tp in (1, 2):
        output = _pretrain(tp, config, *overrides, f"tensor-model-parallel-size={tp}")
        first = float(re.search(r"iteration\s+1/\s*1 \|.*?lm loss: ([-+0-9.eE]+)", output).group(1))
        padding_left_in = _nelbo(_with_zero_padding(logits, PADDED[tp]), x0, PADDED[tp])
        print(f"{family} tp{tp}: first loss {first:.7f}, HF NELBO {reference:.7f} (relative "
              f"{abs(first - reference) / reference:.1e}); with the padding left in {padding_left_in:.7f}")
        assert " loaded checkpoint from " in output  # the TP1 import, at this TP size
        assert first == pytest.approx(reference, rel=TOLERANCE)
        assert abs(padding_left_in - reference) > 100 * TOLERANCE * reference  # the control: padding shows
