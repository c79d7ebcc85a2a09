"""Hugging Face models in, BDLMs out: a local HF directory <-> our `torch_dist` checkpoints.

    python scripts/convert_hf.py import --hf-dir DIR --save CKPT [--tensor-model-parallel-size T]
                                        [--make-vocab-size-divisible-by N] [--mask-token TOKEN]
    python scripts/convert_hf.py export --load CKPT --hf-dir OUT [--max-shard-size-mb M] [--format hf|sdar|fast-dllm-v2]

import: a dense Llama / Mistral / Qwen2 / Qwen3, a Qwen3-MoE, a Qwen3.5 (Gated DeltaNet hybrid) or a DiffusionGemma
directory (`config.json`, `*.safetensors`, tokenizer files; nothing is downloaded) becomes `CKPT/iter_0000000`, a
model-only checkpoint (fp32) that training loads with `--load CKPT --finetune` into any TP / PP / CSBP (/ EP) layout
(dist_checkpointing reshards it). Beside it: `CKPT/hf/` (the tokenizer with the MASK token, for `--tokenizer-type
HuggingFaceTokenizer`, and the HF config) and `CKPT/model.yaml`, the model flags as a config fragment. The MASK
token is a new one, `<|mask|>`, right after the tokenizer's ids (its rows: see `megatron_csbp.tools.hf`), or, with
`--mask-token`, an existing unused token. Its id is recorded as `bdlm-mask-token-id` in the fragment and in the
checkpoint's arguments, which training checks. `--tensor-model-parallel-size` / `--make-vocab-size-divisible-by`
must be those training will use: they fix the padded vocabulary. Weights are read tensor by tensor and copied into
one (uninitialised) model, never two full copies.

export: the latest checkpoint of any of our runs (saved at any TP / PP / EP) becomes an HF directory that
`transformers` loads offline with `from_pretrained(OUT)`: safetensors shards, `config.json` (with how it
decodes: `mask_token_id`, `block_size`, `bdlm_objective`, `bdlm_label_shift`; see `hf.bdlm_config`), and the
tokenizer with its MASK token. A non-empty OUT is refused unless `--overwrite`, which replaces it whole.
`--format sdar` / `fast-dllm-v2` write the same weights under the architecture and config keys SGLang /
lmdeploy (SDAR) and Fast-dLLM v2's code read, and refuse a checkpoint they cannot serve (see
`megatron_csbp.tools.hf_formats`).

Both write into a private directory beside the target and publish it by one rename (see
`megatron_csbp.runtime.publish`): a kill at any point leaves the target as it was. import refuses a
`--save` that holds anything (a training run's checkpoints above all) and holds `--save`'s writer lock
while it works, so a second import (or a training run) into the same `--save` is refused at once.

Exit status: 0 done, 2 refused input (one line: what and how to fix it), 1 a failure.

`main(argv)` is the command of `scripts/convert_hf.py`.
"""

import argparse
import contextlib
import datetime
import json
import os
import shutil
import sys


from megatron_csbp.core import modes, objectives
from megatron_csbp.core.clean_attention import BLOCK_CAUSAL
from megatron_csbp.core.rules import ConfigError
from megatron_csbp.tools import hf_diffusion_gemma, hf_formats

NEW_MASK_TOKEN = "<|mask|>"
HF_SIDE = "hf"  # CKPT/hf: the tokenizer and HF config the checkpoint goes with
FRAGMENT = "model.yaml"
_IGNORED_HF_TENSORS = ("rotary_emb.inv_freq",)
_DROPPED_HF_PREFIXES = ("mtp.",)  # the hub's Qwen3.5 multi-token-prediction head, which transformers drops too


@contextlib.contextmanager
def _single_process():
    """One gloo rank and megatron's parallel state (no parallelism): what building a model needs."""
    import torch.distributed as dist

    from megatron_csbp.mcore import cpu_backend, parallel_state
    from megatron_csbp.core.device import default_backend
    from megatron_csbp.runtime.launch import free_port

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group(default_backend(), rank=0, world_size=1, timeout=datetime.timedelta(minutes=10))
    if dist.get_world_size() != 1:
        raise ConfigError("convert_hf.py runs on one process: launch it with python, not torchrun")
    with cpu_backend.active():
        parallel_state.initialize_model_parallel(1, 1, context_block_parallel_size=1, clean_shards=1)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()


def _uninitialised_model(args, vocabulary):
    """Our model for `args` and `vocabulary` (training's, whatever the TP size here) on this one rank, its
    weights allocated but not initialised (they are overwritten)."""
    from megatron_csbp.training import providers

    run_providers = providers.RunProviders(args, vocabulary)
    run_providers.run.config.perform_initialization = False
    return run_providers.model_provider(True, True)


def _model_tensors(model, names) -> dict:
    """The model's parameters, and the buffers the mapping names (Gemma 4's `layer_scalar`), by name."""
    buffers = {name: buffer for name, buffer in model.named_buffers() if name in names}
    return {**dict(model.named_parameters()), **buffers}


def _single_rank(args):
    """An import's `args` for its model built on this one rank (the padded vocabulary stays the one computed for
    training's TP size, which the checkpoint records)."""
    args.tensor_model_parallel_size = args.pipeline_model_parallel_size = 1
    args.context_parallel_size = args.context_block_parallel = args.context_block_parallel_clean_shards = 1
    args.sequence_parallel, args.world_size, args.data_parallel_size = False, 1, 1
    args.expert_model_parallel_size = args.expert_tensor_parallel_size = 1
    args.bdlm_parallel_mode = modes.CSBP.name
    args.use_cpu_initialization = True  # conversion happens in host memory, also on a GPU machine
    return args


def _vocabulary_rows(vocabulary) -> int:
    """Ids the model's tokenizer side has: the tokenizer's (MASK included) and MASK's; rows an export writes."""
    return max(vocabulary.tokenizer.vocab_size, vocabulary.mask_token_id + 1)


# ------------------------------------------------------------------------------------------------ import
def _tokenizer_with_mask(hf_dir: str, mask_token: str | None):
    """The HF tokenizer with its MASK token added; returns (tokenizer, MASK id, MASK is new, original ids)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    except Exception as error:
        raise ConfigError(f"--hf-dir {hf_dir}: no tokenizer transformers can read offline "
                          f"({' '.join(str(error).split())[:200]})") from None
    original_ids = len(tokenizer)
    vocabulary = tokenizer.get_vocab()
    if mask_token is not None:
        if mask_token not in vocabulary:
            raise ConfigError(f"--mask-token {mask_token!r} is not a token of {hf_dir}'s tokenizer: name an "
                              f"existing unused special token, or drop --mask-token for a new {NEW_MASK_TOKEN}")
        tokenizer.add_special_tokens({"mask_token": mask_token})
        mask_id, new = vocabulary[mask_token], False
    else:
        if NEW_MASK_TOKEN in vocabulary:
            raise ConfigError(f"{hf_dir}'s tokenizer already has {NEW_MASK_TOKEN} (id {vocabulary[NEW_MASK_TOKEN]}): "
                              f"use it with --mask-token '{NEW_MASK_TOKEN}'")
        tokenizer.add_special_tokens({"mask_token": NEW_MASK_TOKEN})
        mask_id, new = tokenizer.convert_tokens_to_ids(NEW_MASK_TOKEN), True
        assert mask_id == original_ids, (mask_id, original_ids)
    return tokenizer, mask_id, new, original_ids


def _check_tying(weights, flags: dict, hf_dir: str) -> None:
    import torch

    from megatron_csbp.tools import hf

    tied = not flags["untie-embeddings-and-output-weights"]
    if tied and "lm_head.weight" in weights:
        if not torch.equal(weights.get("lm_head.weight"), weights.get(hf.embedding_key(hf.read_config(hf_dir)))):
            raise ConfigError(f"--hf-dir {hf_dir}: config.json ties the embeddings (tie_word_embeddings) but "
                              f"lm_head.weight differs from the embedding; fix tie_word_embeddings")
    if not tied and "lm_head.weight" not in weights:
        raise ConfigError(f"--hf-dir {hf_dir}: config.json unties the embeddings but the weights have no "
                          f"lm_head.weight; set tie_word_embeddings: true")


def _check_empty_save(save: str) -> None:
    """An import publishes a whole new `--save`: a directory holding anything (above all a training run's
    checkpoints, whose tracker the import would repoint to iteration 0) is refused. A lock left by a killed
    import or run is no content: `save_lock` takes it over when its holder is gone."""
    from megatron_csbp.runtime import save_lock
    from megatron_csbp.training import checkpointing

    if os.path.exists(save) and not os.path.isdir(save):
        raise ConfigError(f"--save {save} is a file: give a new directory for the imported checkpoint")
    if not os.path.isdir(save):
        return
    entries = sorted(set(os.listdir(save)) - {save_lock.LOCK})
    if checkpointing.TRACKER in entries or checkpointing.iteration_dirs(save):
        raise ConfigError(f"--save {save} holds a training checkpoint ({checkpointing.TRACKER} or iter_*): an "
                          f"import there would repoint its tracker to iteration 0 and break its resume; give a "
                          f"new --save")
    if entries:
        raise ConfigError(f"--save {save} is not empty ({len(entries)} entries, e.g. {entries[0]}): an import "
                          f"writes a whole new directory; give a new or empty --save")


def _import_bytes(weights, hf_dir: str, padded: int, hf_rows: int, hidden: int, tied: bool) -> int:
    """Bytes an import writes: every HF tensor in fp32, the padding rows, the tokenizer and config files."""
    side = sum(os.path.getsize(os.path.join(hf_dir, name)) for name in os.listdir(hf_dir)
               if not name.endswith(".safetensors") and os.path.isfile(os.path.join(hf_dir, name)))
    padding = max(padded - hf_rows, 0) * hidden * (1 if tied else 2)
    return 4 * (weights.numel() + padding) + side + (1 << 20)


def import_checkpoint(hf_dir: str, save: str, *, tensor_model_parallel_size: int = 1,
                      make_vocab_size_divisible_by: int = 128, mask_token: str | None = None,
                      log=print) -> str:
    """HF directory -> `save`/iter_0000000 (+ `save`/hf, `save`/model.yaml); returns the fragment's path.

    Everything is written into a private directory beside `save` and published as the whole `save` by one
    rename, under `save`'s writer lock: a kill at any point leaves `save` as it was (at most an empty
    directory holding a stale lock that the next import or run takes over), and a second import into the
    same `save` is refused at once instead of racing the first."""
    from megatron_csbp.core import rules
    from megatron_csbp.runtime import publish, save_lock
    from megatron_csbp.tools import hf
    from megatron_csbp.training import checkpointing

    config = hf.read_config(hf_dir)
    flags = hf.model_flags(config, hf_dir)  # refuses what the mapping cannot express, before any work
    weights = hf.SafetensorsDir(hf_dir)
    _check_tying(weights, flags, hf_dir)
    hf.check_shapes(hf_dir, weights)
    problem = flags.get("gemma4-attention") and hf_diffusion_gemma.weights_problem(weights, flags["num-layers"])
    if problem:
        raise hf.UnsupportedModel(f"--hf-dir {hf_dir}: {problem}")
    hf_rows = weights.shape(hf.embedding_key(config))[0]
    used = {name for names in hf.name_map(hf.Shape.from_flags(flags)).values() for name in names} | {"lm_head.weight"}
    unused = sorted(key for key in weights.keys() if key not in used and not key.endswith(_IGNORED_HF_TENSORS)
                    and not key.startswith(_DROPPED_HF_PREFIXES + hf_diffusion_gemma.DROPPED_PREFIXES))
    if unused:
        raise hf.UnsupportedModel(f"--hf-dir {hf_dir}: tensors the mapping cannot express, e.g. {unused[0]} "
                                  f"({len(unused)} in all)")
    tokenizer, mask_id, new_mask, original_ids = _tokenizer_with_mask(hf_dir, mask_token)
    if original_ids > hf_rows:
        raise ConfigError(f"--hf-dir {hf_dir}: its tokenizer has {original_ids} ids but the model's embedding only "
                          f"{hf_rows} rows (ids {hf_rows}..{original_ids - 1} would get zero rows); use the "
                          f"model's own tokenizer")
    rows_needed = max(len(tokenizer), mask_id + 1, hf_rows)
    problem = rules.vocab_padding_problem(rows_needed, make_vocab_size_divisible_by, tensor_model_parallel_size)
    if problem:
        raise ConfigError(problem)
    padded = rules.padded_vocab_size(rows_needed, make_vocab_size_divisible_by, tensor_model_parallel_size)

    save = os.path.abspath(save)
    _check_empty_save(save)
    publish.require_free_space(save, _import_bytes(weights, hf_dir, padded, hf_rows, flags["hidden-size"],
                                                   not flags["untie-embeddings-and-output-weights"]), "--save")
    existed = os.path.isdir(save)
    with publish.private_directory(save, "--save") as private:
        try:
            lock = save_lock.acquire(save, log=log)
        except OSError as error:
            raise ConfigError(f"--save {save}: cannot write there ({error.strerror}); give a writable --save") from None
        try:
            _check_empty_save(save)  # what another writer may have published before we held the lock
            try:
                fragment_path = _write_import(hf_dir, save, private, config, flags, weights, tokenizer, mask_id,
                                              new_mask, original_ids, hf_rows, padded, tensor_model_parallel_size,
                                              make_vocab_size_divisible_by, log)
            except Exception as error:
                if isinstance(error, checkpointing.CheckpointSaveError) or publish.out_of_space(error):
                    raise ConfigError(f"--save {save}: no space left on device while writing the import; nothing "
                                      f"was published: free space or give another --save") from None
                raise
            publish.publish_directory(private, save, replace=True, flag="--save")  # takes the lock away with it
        finally:
            save_lock.release(lock)
            if not existed and os.path.isdir(save) and not os.listdir(save):
                os.rmdir(save)
    log(f" saved {checkpointing.checkpoint_dir(save, 0)}; tokenizer in {os.path.join(save, HF_SIDE)}; model flags "
        f"in {fragment_path}")
    return fragment_path


def _write_import(hf_dir, save, private, config, flags, weights, tokenizer, mask_id, new_mask, original_ids,
                  hf_rows, padded, tensor_model_parallel_size, make_vocab_size_divisible_by, log) -> str:
    """Writes the import into `private` (which becomes `save`: every path recorded names `save`)."""
    import torch
    import yaml

    from megatron_csbp.tools import hf
    from megatron_csbp.training import checkpointing
    from megatron_csbp.training.arguments import validate_args
    from megatron_csbp.training.config import parse_args
    from megatron_csbp.data.tokenizers import HuggingFaceTokenizer, Vocabulary

    side = os.path.join(private, HF_SIDE)
    os.makedirs(side)
    tokenizer.save_pretrained(side)
    if not os.path.isfile(os.path.join(side, "tokenizer.json")):
        raise ConfigError(f"--hf-dir {hf_dir}: its tokenizer has no fast (tokenizer.json) form, which "
                          f"--tokenizer-type HuggingFaceTokenizer reads")
    for name in ("config.json", "generation_config.json"):
        if os.path.isfile(os.path.join(hf_dir, name)):
            shutil.copyfile(os.path.join(hf_dir, name), os.path.join(side, name))
    tokenizer_model = os.path.join(save, HF_SIDE, "tokenizer.json")  # where it will be, once published
    fragment = {**flags, "tokenizer-type": "HuggingFaceTokenizer", "tokenizer-model": tokenizer_model,
                "bdlm-mask-token-id": mask_id, "make-vocab-size-divisible-by": make_vocab_size_divisible_by}
    if HuggingFaceTokenizer(os.path.join(side, "tokenizer.json")).vocab_size < hf_rows:
        # Keep every HF row (e.g. Qwen's unused padding rows): --vocab-size N means ids up to N (EOD's).
        fragment["vocab-size"] = hf_rows - 1
    fragment.update({"load": save, "finetune": True})
    fragment_path = os.path.join(private, FRAGMENT)
    with open(fragment_path, "w", encoding="utf-8") as handle:
        handle.write(f"# Model flags of {os.path.abspath(hf_dir)}, imported by scripts/convert_hf.py: put them in "
                     f"a training config\n# (beside e.g. configs/ar_to_bdlm_fast_dllm_v2.yaml). Trained with "
                     f"--tensor-model-parallel-size {tensor_model_parallel_size} in mind (it fixes the padded "
                     f"vocabulary).\n")
        yaml.safe_dump(fragment, handle, sort_keys=False)

    block = fragment.get("bdlm-block-size", 16)  # a model's own canvas (DiffusionGemma's), else a placeholder
    args = parse_args(["--config", fragment_path, f"seq-length={2 * block}", f"bdlm-block-size={block}",
                       "micro-batch-size=1", "train-iters=1", "lr=0", "data-path=unused", "finetune=true",
                       f"tokenizer-model={os.path.join(side, 'tokenizer.json')}",
                       f"tensor-model-parallel-size={tensor_model_parallel_size}"])
    args = validate_args(args, tensor_model_parallel_size, on_accelerator=False, check_paths=False)
    vocabulary = Vocabulary.from_args(args)  # at training's TP size: it fixes the padding
    if vocabulary.padded_vocab_size != padded:
        raise RuntimeError(f"padded vocabulary {vocabulary.padded_vocab_size}, {padded} expected")
    vocab = hf.Vocabulary(hf_rows=hf_rows, padded=vocabulary.padded_vocab_size, mask_id=mask_id, new_mask=new_mask,
                          mean_of=min(original_ids, hf_rows), rows=_vocabulary_rows(vocabulary))
    log(f" {config['architectures'][0]}: {flags['num-layers']} layers, {hf_rows} HF vocabulary rows -> "
        f"{vocab.padded} padded; MASK id {mask_id} ({'new, rows initialised to the mean' if new_mask else 'existing'})")

    args = vocabulary.recorded(_single_rank(args))
    args.tokenizer_model = tokenizer_model  # the checkpoint records the published path
    shape = hf.Shape.from_args(args)
    names = hf.name_map(shape)
    with _single_process():
        model = _uninitialised_model(args, vocabulary)
        parameters = _model_tensors(model, names)
        if set(parameters) != set(names):
            raise RuntimeError(f"the mapping and the model disagree: {sorted(set(parameters) ^ set(names))[:4]}")
        with torch.no_grad():
            for name, parameter in parameters.items():
                parameter.copy_(hf.to_megatron(name, [weights.get(key) for key in names[name]], shape, vocab,
                                               parameter.dtype))
        checkpointing.save_checkpoint(private, checkpointing.LoopState(), model, None, None, args, log=log)
    return os.path.join(save, FRAGMENT)


# ------------------------------------------------------------------------------------------------ export
def export_config(args, base: dict | None, rows: int, dtype, export_format: str = hf_formats.HF.name) -> dict:
    """The HF `config.json` of our model (the imported one updated, or one built from the flags), with the
    keys that say how it decodes (`hf.bdlm_config`), as `export_format` writes it (`hf_formats`; it refuses
    a checkpoint the format's engine cannot serve)."""
    from megatron_csbp.core.positions import RotaryPositions
    from megatron_csbp.tools import hf, hf_formats

    if getattr(args, "gemma4_attention", False):  # DiffusionGemma: a block-diffusion model of its own form
        return _diffusion_gemma_config(args, base, rows, dtype, export_format)
    if args.normalization != "RMSNorm" or not args.swiglu or args.add_bias_linear:
        raise hf.UnsupportedModel("export needs a Llama-family model (--normalization RMSNorm --swiglu "
                                  "--disable-bias-linear); this checkpoint has another shape")
    hybrid = any(getattr(args, name, None) for name in ("experimental_attention_variant", "attention_output_gate",
                                                        "apply_layernorm_1p"))
    problem = hf.GatedDeltaHybrid.export_problem(args) if hybrid else None
    if problem:
        raise hf.UnsupportedModel(problem)
    positions = RotaryPositions.from_args(args)  # the checkpoint's record (one before YaRN: plain RoPE)
    family = hf.exported_family(args.add_qkv_bias, args.qk_layernorm, bool(getattr(args, "num_experts", None)),
                                positions.query_scaling is not None, hybrid)
    window_keys, family = _window_keys(args, family, base, export_format)
    problem = family.experts.export_problem(args) if family.experts else None
    if problem:
        raise hf.UnsupportedModel(problem)
    config = dict(base) if base else {"hidden_act": "silu", "attention_bias": False}
    based_on = hf.FAMILIES.get(hf.ARCHITECTURES.get(hf.model_name(base))) if base else None
    if based_on is None or based_on.query_scaling != family.query_scaling or based_on.hybrid != family.hybrid:
        config.update(architectures=[family.architecture], model_type=family.name)  # the query scaling's family
    if family.experts:
        config.update(family.experts.config(args, base))
    rope = {"rope_type": "default", "rope_theta": float(args.rotary_base)}
    if family.hybrid:  # its layers, its partial rotary, and its multimodal RoPE's sections (one position for text)
        config.pop("full_attention_interval", None)
        config.update(family.hybrid.config(args))
        sections = ((base or {}).get("rope_parameters") or {}).items()
        rope.update({key: value for key, value in sections if key.startswith("mrope_")},
                    partial_rotary_factor=float(args.rotary_percent))
    family = family.name
    if getattr(args, "use_rope_scaling", False):
        rope.update(rope_type="llama3", factor=float(args.rope_scaling_factor), **hf.LLAMA3_ROPE_FIXED)
    rope.update(hf.rope_parameters(positions))
    # the checkpoint's RoPE, all of it (original_max_position_embeddings: Phi-3's, read before the rope parameters');
    # bd_size: only a shifted-label model may claim it
    for stale in ("rope_scaling", "rope_theta", "original_max_position_embeddings", "bd_size"):
        config.pop(stale, None)
    config["rope_parameters"] = rope
    objective = getattr(args, "bdlm_objective", objectives.BD3LM.name)
    clean_attention = getattr(args, "bdlm_clean_attention", BLOCK_CAUSAL.name)  # older checkpoints: BD3-LM's
    config.update(hidden_size=args.hidden_size, intermediate_size=args.ffn_hidden_size,
                  num_hidden_layers=args.num_layers, num_attention_heads=args.num_attention_heads,
                  num_key_value_heads=args.num_query_groups, head_dim=args.kv_channels,
                  rms_norm_eps=args.norm_epsilon, max_position_embeddings=args.max_position_embeddings,
                  vocab_size=rows, tie_word_embeddings=not args.untie_embeddings_and_output_weights,
                  dtype=str(dtype).removeprefix("torch."),
                  **hf.bdlm_config(objective, args.bdlm_block_size, args.mask_token_id, clean_attention))
    config.update(window_keys)
    return hf_formats.export_format(export_format).config(config, family, objective, args.bdlm_block_size,
                                                          args.mask_token_id, clean_attention)


def _diffusion_gemma_config(args, base, rows, dtype, export_format) -> dict:
    """DiffusionGemma's `config.json` (`hf_diffusion_gemma.export_config`); its one form is transformers'."""
    from megatron_csbp.tools import hf, hf_formats

    if export_format != hf_formats.HF.name:
        raise hf.UnsupportedModel(f"--format {export_format}: its engine has no DiffusionGemma; export it with "
                                  f"--format {hf_formats.HF.name} (DiffusionGemmaForBlockDiffusion)")
    problem = hf_diffusion_gemma.export_problem(args)
    if problem:
        raise hf.UnsupportedModel(problem)
    keys = hf.bdlm_config(args.bdlm_objective, args.bdlm_block_size, args.mask_token_id, args.bdlm_clean_attention)
    return hf_diffusion_gemma.export_config(args, base, rows, dtype, keys)


# what transformers 5 writes in tokenizer_config.json that transformers 4 (the serving engines pin 4.5x) cannot load
_TRANSFORMERS_4_CLASSES = {"TokenizersBackend": "PreTrainedTokenizerFast"}  # both load tokenizer.json as it is
# how this export loaded the tokenizer (offline), which transformers 5 saves as if it were the tokenizer's own
_LOADING_KEYS = ("local_files_only", "is_local")


def portable_tokenizer_config(config: dict) -> dict:
    """`tokenizer_config.json` as transformers 5 saves it, made loadable by transformers 4.5x as well (5 reads
    both spellings): transformers 4 knows no `TokenizersBackend` class, and takes `extra_special_tokens` as a
    dict of named tokens, where 5 writes a list (4's `additional_special_tokens`). The keys of how the export
    loaded it (`local_files_only`) are not the tokenizer's and would follow it to a Hub upload: dropped."""
    config = {key: value for key, value in config.items() if key not in _LOADING_KEYS}
    if config.get("tokenizer_class") in _TRANSFORMERS_4_CLASSES:
        config["tokenizer_class"] = _TRANSFORMERS_4_CLASSES[config["tokenizer_class"]]
    if isinstance(config.get("extra_special_tokens"), list):
        config["additional_special_tokens"] = config.pop("extra_special_tokens")
    return config


def _window_keys(args, family, base: dict | None, export_format: str) -> tuple[dict, object]:
    """The `config.json` keys of a checkpoint's sliding-window layers (`--window-size`, `--window-attn-skip-freq`)
    as transformers reads them (`hf.hf_windows`: `sliding_window` = LEFT + 1), and the family that holds them: a
    Llama-shaped model windowed in every layer is a Mistral. Refuses (one line) a pattern the family cannot hold."""
    from megatron_csbp.core.windows import layer_windows
    from megatron_csbp.tools import hf, hf_formats

    layers = layer_windows(getattr(args, "window_size", None), getattr(args, "window_attn_skip_freq", None),
                           args.num_layers)
    pattern = [int(window.sliding) for window in layers]
    if not any(pattern):
        return {}, family
    shown = ",".join(map(str, args.window_size))
    if export_format != hf_formats.HF.name:
        raise hf.UnsupportedModel(f"--format {export_format}: its engines run full attention in every layer, and this "
                                  f"checkpoint has sliding-window layers (--window-size {shown}); export it with "
                                  f"--format {hf_formats.HF.name}")
    if family is hf.LLAMA:
        family = hf.MISTRAL
    if family.windows != hf.PER_LAYER and not all(pattern):
        raise hf.UnsupportedModel(f"--window-attn-skip-freq: {family.display} windows every layer or none, and this "
                                  f"checkpoint keeps layers {[i for i, on in enumerate(pattern) if not on]} global; "
                                  f"only a Qwen2/Qwen3 model holds a per-layer pattern")
    keys = {"sliding_window": layers[pattern.index(1)].hf_sliding_window}
    if family.window_switch:
        keys["use_sliding_window"] = True
    if family.windows == hf.PER_LAYER:
        default = (base or {}).get("max_window_layers", hf.QWEN_MAX_WINDOW_LAYERS)
        keys.update(layer_types=["sliding_attention" if on else "full_attention" for on in pattern],
                    max_window_layers=default if pattern == [int(i >= default) for i in range(len(pattern))]
                    else pattern.index(1))
    return keys, family


def _export_tokenizer(hf_side: str, out: str, mask_id: int, log) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_side, local_files_only=True)
    if tokenizer.mask_token_id != mask_id:
        if mask_id == len(tokenizer):
            tokenizer.add_special_tokens({"mask_token": NEW_MASK_TOKEN})
        elif mask_id < len(tokenizer):
            tokenizer.add_special_tokens({"mask_token": tokenizer.convert_ids_to_tokens(mask_id)})
        else:
            log(f" note: MASK id {mask_id} lies beyond the tokenizer's {len(tokenizer)} ids; it has no token")
    tokenizer.save_pretrained(out)
    path = os.path.join(out, "tokenizer_config.json")
    with open(path, encoding="utf-8") as handle:
        config = portable_tokenizer_config(json.load(handle))
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=2, ensure_ascii=False)


def _check_export_target(out: str, overwrite: bool, protected: list[str]) -> None:
    """`--hf-dir` must be a new or empty directory, or, with `--overwrite`, an HF model directory (one
    with a config.json) that is replaced whole; never one holding what the export reads."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"--hf-dir {out} is a file: give a directory")
    for path in protected:
        if os.path.commonpath([out, path]) == out:
            raise ConfigError(f"--hf-dir {out} holds {path}, which the export reads: give another --hf-dir")
    if not os.path.isdir(out) or not os.listdir(out):
        return
    if not overwrite:
        raise ConfigError(f"--hf-dir {out} is not empty: give --overwrite to replace it whole (its old contents "
                          f"go once the new export is complete), or another --hf-dir")
    if not os.path.isfile(os.path.join(out, "config.json")):
        raise ConfigError(f"--hf-dir {out} holds no config.json, so it is not a Hugging Face model directory that "
                          f"--overwrite may replace; empty it yourself or give another --hf-dir")


def export_checkpoint(load: str, out: str, *, max_shard_bytes: int = 2 << 30, overwrite: bool = False,
                      export_format: str = hf_formats.HF.name, log=print) -> str:
    """The latest checkpoint under `load` -> an HF directory `out` in `export_format` (`hf_formats`: `hf`,
    `sdar`, `fast-dllm-v2`; the weights are the same in each); returns `out`.

    Written into a private directory beside `out` and published by one rename: `out` is never a mixture of
    two exports, and a kill leaves the previous one as it was. A non-empty `out` is refused unless
    `overwrite`, which replaces it whole."""
    import torch

    from megatron_csbp.tools import inference
    from megatron_csbp.runtime import publish
    from megatron_csbp.tools import hf, hf_formats
    from megatron_csbp.training import checkpointing

    fmt = hf_formats.export_format(export_format)
    if max_shard_bytes <= 0:
        raise ConfigError(f"--max-shard-size-mb must be positive (got {max_shard_bytes >> 20}): the largest "
                          f"safetensors file, in MiB")
    out, load = os.path.abspath(out), os.path.abspath(load)
    _check_export_target(out, overwrite, [load])
    checkpoint = inference.read_checkpoint(load, log=log)
    directory, iteration, recorded = checkpoint.directory, checkpoint.iteration, checkpoint.recorded
    hf_side, found = None, {}
    if recorded.get("tokenizer_type") == "HuggingFaceTokenizer":  # its tokenizer, where it is now
        for candidate in (recorded.get("tokenizer_model"), os.path.join(load, HF_SIDE, "tokenizer.json")):
            if candidate and os.path.isfile(candidate):
                hf_side, found = os.path.dirname(os.path.abspath(candidate)), {"tokenizer_model": candidate}
                break
        if hf_side is None:
            raise ConfigError(f"--load {load}: its tokenizer {recorded.get('tokenizer_model')} is gone; put it back "
                              f"(or in {os.path.join(load, HF_SIDE)})")
        _check_export_target(out, overwrite, [load, hf_side])
    # the model on this one rank, every expert on it, in host memory (also on a GPU machine)
    args, vocabulary = inference.launch_arguments(checkpoint, bdlm_parallel_mode=modes.CSBP.name, world_size=1,
                                                  data_parallel_size=1, use_cpu_initialization=True, **found)
    args = vocabulary.recorded(args)
    base_path = os.path.join(hf_side, "config.json") if hf_side else None
    base = hf.read_config(hf_side, f"--load {load}") if base_path and os.path.isfile(base_path) else None
    rows = _vocabulary_rows(vocabulary)
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    config = export_config(args, base, rows, dtype, fmt.name)  # refuses, before any tensor is read
    for note in fmt.notes(args.bdlm_block_size):
        log(f" {note}")

    shape = hf.Shape.from_args(args)
    vocab = hf.Vocabulary(hf_rows=rows, padded=args.padded_vocab_size, mask_id=args.mask_token_id,
                          new_mask=False, mean_of=0, rows=rows)
    names = hf.name_map(shape)
    with _single_process():
        model = _uninitialised_model(args, vocabulary)
        parameters = _model_tensors(model, names)
        side_bytes = sum(os.path.getsize(os.path.join(hf_side, name)) for name in os.listdir(hf_side)) if hf_side else 0
        publish.require_free_space(out, sum(p.numel() for p in parameters.values()) * dtype.itemsize + side_bytes
                                   + (1 << 20), "--hf-dir")
        checkpointing.load_checkpoint(directory, model, None, None, args, load_optimizer=False, load_rng=False,
                                      log=lambda *_: None)
    shards, size, unit = [[]], 0, None
    for name, parameter in parameters.items():
        nbytes = parameter.numel() * parameter.element_size()
        # a layer's experts stay in one shard: a hub may hold them as one tensor (`hf.hub_tensors`)
        unit, previous = name.split("local_experts.")[0] if "local_experts." in name else name, unit
        if shards[-1] and size + nbytes > max_shard_bytes and unit != previous:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    with publish.private_directory(out, "--hf-dir") as private:
        try:
            _write_export(private, shards, parameters, names, shape, vocab, dtype, config, hf_side, args, log)
            for name, text in fmt.files.items():
                with open(os.path.join(private, name), "w", encoding="utf-8") as handle:
                    handle.write(text)
        except Exception as error:
            if publish.out_of_space(error):
                raise ConfigError(f"--hf-dir {out}: no space left on device while writing the export; nothing was "
                                  f"published (the previous contents are as they were): free space or give "
                                  f"another --hf-dir") from None
            raise
        publish.publish_directory(private, out, replace=overwrite, flag="--hf-dir")
    log(f" exported {directory} (iteration {iteration}) to {out} as --format {fmt.name} "
        f"({config['architectures'][0]}): {len(shards)} shard(s), vocabulary {rows}, "
        f"MASK id {args.mask_token_id}, block size {args.bdlm_block_size}, objective "
        f"{config['bdlm_objective']} (row p predicts token p+{config['bdlm_label_shift']})")
    return out


def _write_export(out, shards, parameters, names, shape, vocab, dtype, config, hf_side, args, log) -> None:
    """Writes the safetensors shards (and their index), config.json and the tokenizer into `out`."""
    from safetensors.torch import save_file

    from megatron_csbp.tools import hf

    weight_map, total = {}, 0
    for index, shard in enumerate(shards):
        file = "model.safetensors" if len(shards) == 1 else f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in shard:
            for key, tensor in zip(names[name], hf.to_hf(name, parameters[name].detach(), shape, vocab)):
                tensors[key] = tensor.to(dtype).clone()
        tensors = hf.hub_tensors(shape, tensors)
        for key, tensor in tensors.items():
            weight_map[key] = file
            total += tensor.numel() * tensor.element_size()
        save_file(tensors, os.path.join(out, file), metadata={"format": "pt"})
        del tensors
    if len(shards) > 1:
        with open(os.path.join(out, hf.INDEX), "w", encoding="utf-8") as handle:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, handle, indent=2)
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=2, sort_keys=True)
    if hf_side:
        _export_tokenizer(hf_side, out, args.mask_token_id, log)
        if os.path.isfile(os.path.join(hf_side, "generation_config.json")):
            shutil.copyfile(os.path.join(hf_side, "generation_config.json"),
                            os.path.join(out, "generation_config.json"))
    else:
        log(f" note: the {args.tokenizer_type} has no Hugging Face form; the export holds the model without a "
            f"tokenizer")


def build_parser() -> argparse.ArgumentParser:
    from megatron_csbp.tools import hf_formats

    parser = argparse.ArgumentParser(description="Hugging Face <-> megatron_csbp checkpoints.", allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True)
    to_ours = commands.add_parser("import", help="a local HF directory -> a torch_dist checkpoint to fine-tune")
    to_ours.add_argument("--hf-dir", required=True, help="Local HF model directory (config.json, *.safetensors, "
                                                         "tokenizer files).")
    to_ours.add_argument("--save", required=True, help="Checkpoint directory to write (training's --load).")
    to_ours.add_argument("--tensor-model-parallel-size", type=int, default=1,
                         help="The TP size training will use (it fixes the padded vocabulary).")
    to_ours.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                         help="As training's flag: the vocabulary is padded to a multiple of this x TP.")
    to_ours.add_argument("--mask-token", default=None,
                         help=f"An existing unused token to use as MASK (default: a new {NEW_MASK_TOKEN}).")
    to_ours_back = commands.add_parser("export", help="one of our checkpoints -> a HF directory")
    to_ours_back.add_argument("--load", required=True, help="Checkpoint root (its latest iteration is exported).")
    to_ours_back.add_argument("--hf-dir", required=True, help="HF directory to write.")
    to_ours_back.add_argument("--max-shard-size-mb", type=int, default=2048, help="Largest safetensors file.")
    to_ours_back.add_argument("--format", default=hf_formats.HF.name, choices=tuple(hf_formats.FORMATS),
                              help="hf: the source family's own architecture (Llama/Qwen2/Qwen3/Qwen3.5); sdar: "
                                   "SDAR for SGLang / lmdeploy (Qwen3, MASK 151669); fast-dllm-v2: Fast-dLLM v2 "
                                   "(Qwen2.5, MASK 151665). The weights are the same.")
    to_ours_back.add_argument("--overwrite", action="store_true",
                              help="Replace a non-empty --hf-dir (an HF model directory) whole, once the new "
                                   "export is complete; without it a non-empty --hf-dir is refused.")
    return parser


def main(argv: list[str] | None = None) -> int:
    from megatron_csbp.runtime import quiet

    quiet.quiet_start_up()  # megatron-core's start-up warnings would bury a refusal's one line
    args = build_parser().parse_args(argv)
    try:
        if args.command == "import":
            if args.tensor_model_parallel_size < 1 or args.make_vocab_size_divisible_by < 1:
                raise ConfigError("--tensor-model-parallel-size and --make-vocab-size-divisible-by must be >= 1")
            if not os.path.isdir(args.hf_dir):
                what = "is a file, not a directory" if os.path.exists(args.hf_dir) else "no such directory"
                raise ConfigError(f"--hf-dir {args.hf_dir}: {what} (a local HF model directory is needed)")
            import_checkpoint(args.hf_dir, args.save, tensor_model_parallel_size=args.tensor_model_parallel_size,
                              make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                              mask_token=args.mask_token)
        else:
            if not os.path.isdir(args.load):
                raise ConfigError(f"--load {args.load}: no such directory")
            if args.max_shard_size_mb <= 0:
                raise ConfigError(f"--max-shard-size-mb {args.max_shard_size_mb}: the largest safetensors file, "
                                  f"in MiB, must be positive")
            export_checkpoint(args.load, args.hf_dir, max_shard_bytes=args.max_shard_size_mb << 20,
                              overwrite=args.overwrite, export_format=args.format)
    except ConfigError as error:
        print(f"convert_hf.py: error: {error}", file=sys.stderr, flush=True)
        return 2
    return 0
