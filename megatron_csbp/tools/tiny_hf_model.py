"""Make a tiny random Hugging Face model locally (nothing downloaded): the recipe's and the tests' AR model.

    python scripts/make_tiny_hf_model.py --family llama --output runs/tiny_llama_hf

A byte-level BPE tokenizer trained on a slice of this Python's standard library, and a Llama / Qwen2 / Qwen3
(or Mistral, without sliding window unless `windows` gives one, or Ministral 3: give it `rope_parameters` with
YaRN and `llama_4_scaling_beta`), a Qwen3-MoE (4 experts, top 2, by default) or a Qwen3.5 (Gated DeltaNet
layers, `TINY_HYBRID`'s unless `hybrid` says otherwise) with random weights, norms
and biases (so none is trivially 1 or 0), saved as `config.json`, `model.safetensors` and the tokenizer files, in
fp32. A Qwen3-MoE's experts are saved per expert, as the hub holds them, or with `fused_experts` as transformers 5
holds them in memory (`save_pretrained(..., save_original_format=False)`).

`main(argv)` is the command of `scripts/make_tiny_hf_model.py`.
"""

import argparse
import os
import sysconfig

SPECIAL_TOKENS = ["<|endoftext|>", "<|unused_0|>"]  # EOD, and an unused special token (for --mask-token)


def training_text(max_bytes: int = 200_000) -> list[str]:
    """A deterministic slice of the standard library's sources."""
    root = sysconfig.get_paths()["stdlib"]
    texts, total = [], 0
    for name in sorted(os.listdir(root)):
        if name.endswith(".py") and total < max_bytes:
            with open(os.path.join(root, name), encoding="utf-8", errors="replace") as handle:
                texts.append(handle.read())
            total += len(texts[-1])
    return texts


def make_tokenizer(vocab_size: int):
    """A byte-level BPE `PreTrainedTokenizerFast` of exactly `vocab_size` ids (special tokens included)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(training_text(), trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"the BPE trainer made {tokenizer.get_vocab_size()} ids, not {vocab_size}")
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")


# A tiny Qwen3.5's Gated DeltaNet layers: every 2nd layer full attention, 2 key heads serving 4 value heads.
TINY_HYBRID = dict(full_attention_interval=2, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=6,
                   linear_num_key_heads=2, linear_num_value_heads=4)


def make_config(family: str, *, tokenizer_ids: int = 383, model_rows: int | None = None, hidden_size: int = 64,
                num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16,
                intermediate_size: int = 96, tied: bool = False, rope_parameters: dict | None = None,
                num_experts: int = 4, experts_per_token: int = 2, moe_intermediate_size: int = 32,
                mlp_only_layers: tuple = (), norm_topk_prob: bool = True, windows: dict | None = None,
                hybrid: dict | None = None):
    """The transformers config of `make_model`'s tiny `family` model (the expert settings: a Qwen3-MoE's only;
    `windows`: transformers' sliding-window keys, e.g. `sliding_window`, `use_sliding_window`, `layer_types`;
    `hybrid`: a Qwen3.5's keys over `TINY_HYBRID`, e.g. `layer_types`, `full_attention_interval`, `linear_*`)."""
    import transformers

    from megatron_csbp.tools.hf import FAMILIES

    family = FAMILIES(family)
    extra = {"sliding_window": None} if family.windowed_by_default else {}
    if rope_parameters:
        extra["rope_parameters"] = rope_parameters
    extra.update(windows or {})
    if family.hybrid:
        extra.update({**TINY_HYBRID, **(hybrid or {})})
    if family.experts:
        extra.update(num_experts=num_experts, num_experts_per_tok=experts_per_token,
                     moe_intermediate_size=moe_intermediate_size, mlp_only_layers=list(mlp_only_layers),
                     norm_topk_prob=norm_topk_prob, router_aux_loss_coef=0.01)
    return getattr(transformers, family.config_class)(
        vocab_size=model_rows or tokenizer_ids, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=tied,
        initializer_range=0.1, eos_token_id=0, bos_token_id=0, pad_token_id=None,
        architectures=[family.architecture], **extra)


def make_model(family: str, output: str, *, tokenizer_ids: int = 383, fused_experts: bool = False, seed: int = 0,
               **settings) -> str:
    """Writes a tiny random `family` model (`make_config`'s, with `settings`) with a `tokenizer_ids`-id tokenizer
    to `output`; returns `output`."""
    import torch
    from transformers import AutoModelForCausalLM

    config = make_config(family, tokenizer_ids=tokenizer_ids, **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.copy_(1 + 0.2 * torch.randn_like(parameter))
            elif name.endswith("bias"):
                parameter.copy_(0.1 * torch.randn_like(parameter))
    os.makedirs(output, exist_ok=True)
    model.save_pretrained(output, save_original_format=not fused_experts)
    make_tokenizer(tokenizer_ids).save_pretrained(output)
    return output


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    from megatron_csbp.tools.hf import FAMILIES, LLAMA

    parser.add_argument("--family", choices=FAMILIES, default=LLAMA.name)
    parser.add_argument("--output", required=True)
    parser.add_argument("--tokenizer-ids", type=int, default=383, help="Tokenizer size (>= 258: byte-level BPE).")
    parser.add_argument("--model-rows", type=int, default=None, help="Embedding rows (default: the tokenizer's ids).")
    parser.add_argument("--tied", action="store_true", help="Tie the embeddings and the LM head.")
    parser.add_argument("--fused-experts", action="store_true",
                        help="qwen3_moe: save the experts fused, as transformers 5 holds them (default: per expert).")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    make_model(args.family, args.output, tokenizer_ids=args.tokenizer_ids, model_rows=args.model_rows,
               tied=args.tied, fused_experts=args.fused_experts, seed=args.seed)
    print(f"wrote a tiny random {args.family} model to {args.output}")
    return 0
