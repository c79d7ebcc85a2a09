#!/usr/bin/env python
"""Generate text from a trained block diffusion LM: block-by-block denoising from a torch_dist checkpoint.

    python scripts/generate_bdlm.py --load runs/tiny_cpu --prompt "def " --max-new-tokens 64
    torchrun --nproc-per-node 2 scripts/generate_bdlm.py --load runs/tiny_cpu --tensor-model-parallel-size 2 \\
        --prompt-file prompts.txt --max-new-tokens 64 --strategy top-k --steps-per-block 8

`--load` is a `--save` directory (its latest checkpoint) or one `iter_XXXXXXX` directory. The model, the
tokenizer, the block size, the MASK id and the objective come from the arguments the checkpoint recorded;
`--config FILE.yaml` (a training config) overrides what it sets, e.g. a `tokenizer-model` that moved, and
the model's shape must still agree with the checkpoint. Decoding: `megatron_csbp.tools.sampling`.

Prints the settings, each prompt with its sample (Python string literals), then the tokens/s and the
number of model calls. Exit status: 0 done, 2 refused input (one line, before the model is built), 1 a failure.
"""

import argparse
import os
import sys
import traceback

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(SCRIPTS))
sys.path.insert(1, SCRIPTS)

from megatron_csbp.training.arguments import ConfigError  # noqa: E402

NAME = os.path.basename(__file__)


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    from megatron_csbp.tools.sampling import STRATEGIES

    parser = _Parser(description="Block-diffusion sampling from a megatron_csbp checkpoint.", allow_abbrev=False)
    parser.add_argument("--load", required=True, help="A --save directory (latest checkpoint) or an iter_XXXXXXX one.")
    parser.add_argument("--config", default=None, metavar="FILE.yaml",
                        help="Training config whose settings override those the checkpoint recorded.")
    parser.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                        help="A prompt; repeat for a batch.")
    parser.add_argument("--prompt-file", default=None, help="One prompt per line (a batch).")
    parser.add_argument("--max-new-tokens", type=int, required=True)
    parser.add_argument("--steps-per-block", type=int, default=None,
                        help="Denoising steps (model calls) per block at most. Default: the block size.")
    parser.add_argument("--strategy", choices=STRATEGIES, default="confidence",
                        help="Which masked positions to unmask at each step (see megatron_csbp.tools.sampling).")
    parser.add_argument("--threshold", type=float, default=0.9, help="Confidence threshold (--strategy confidence).")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy.")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-kv-cache", action="store_true",
                        help="Recompute the committed prefix at every step (the reference the cache must equal).")
    parser.add_argument("--ignore-eos", action="store_true", help="Do not stop at the end-of-document token.")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    return parser


def _checkpoint_directory(load: str) -> str:
    from megatron_csbp.training import checkpointing

    if os.path.isfile(os.path.join(load, checkpointing.MANIFEST)):
        return load
    if not os.path.isdir(load):
        raise ConfigError(f"--load {load}: no such directory; give the --save directory of a training run")
    return checkpointing.checkpoint_dir(load, checkpointing.find_checkpoint(load, fallback=False))


def model_args(directory: str, config: str | None, tensor_parallel: int) -> argparse.Namespace:
    """The training arguments of the checkpoint (then `--config`), set up for one model replica over TP."""
    from megatron_csbp.training import checkpointing
    from megatron_csbp.training.arguments import build_parser as training_parser
    from megatron_csbp.training.arguments import null_as_byte_tokenizer
    from megatron_csbp.training.config import parse_args
    from megatron_csbp.core import rules
    from megatron_csbp.training.data import build_tokenizer

    checkpointing.check_complete(directory)
    try:
        saved = checkpointing.saved_args(checkpointing.common_state(directory))
    except Exception as error:
        raise ConfigError(f"checkpoint {directory} is corrupt: its common state cannot be read ({error})") from None
    if not saved:
        raise ConfigError(f"checkpoint {directory} records no training arguments: it was not written by "
                          f"megatron_csbp's training loop (scripts/pretrain_bdlm.py)")
    args = training_parser().parse_args([])
    vars(args).update(saved)
    if config is not None:
        defaults, given = vars(parse_args([])), vars(parse_args(["--config", config]))
        vars(args).update({key: value for key, value in given.items() if value != defaults.get(key)})
    args.tensor_model_parallel_size = tensor_parallel
    args.tokenizer = build_tokenizer(null_as_byte_tokenizer(args))
    # The MASK id and the padded vocabulary are the checkpoint's, whatever the TP size now.
    args.mask_token_id, args.padded_vocab_size = saved["mask_token_id"], saved["padded_vocab_size"]
    args.pipeline_model_parallel_size = args.context_parallel_size = 1
    args.context_block_parallel = 1
    args.sequence_parallel = False
    problem = rules.tensor_parallel_problem(args.num_attention_heads, args.num_query_groups, tensor_parallel)
    if problem is None and args.padded_vocab_size % tensor_parallel:  # padded for the TP size it was trained at
        problem = (f"--tensor-model-parallel-size {tensor_parallel} does not divide the padded vocabulary "
                   f"{args.padded_vocab_size}; use a TP size dividing it")
    if problem:
        raise ConfigError(f"checkpoint {directory}: {problem}")
    return args


def settings_from(options, args):
    from megatron_csbp.tools.sampling import SamplingSettings

    return SamplingSettings(
        block_size=args.bdlm_block_size, mask_token_id=args.mask_token_id,
        steps_per_block=options.steps_per_block or args.bdlm_block_size, strategy=options.strategy,
        threshold=options.threshold, temperature=options.temperature, top_p=options.top_p, seed=options.seed,
        eos_token_id=None if options.ignore_eos else args.tokenizer.eod,
        shifted_labels=args.bdlm_objective == "fast-dllm-v2", vocab_size=args.tokenizer.vocab_size,
        kv_cache=not options.no_kv_cache)


def read_prompts(options) -> list[str]:
    if (options.prompt is None) == (options.prompt_file is None):
        raise ConfigError("give the prompts with --prompt TEXT (repeatable) or --prompt-file FILE, one of the two")
    if options.prompt is not None:
        prompts = options.prompt
    else:
        if not os.path.isfile(options.prompt_file):
            raise ConfigError(f"--prompt-file {options.prompt_file}: no such file")
        with open(options.prompt_file, encoding="utf-8") as handle:
            prompts = [line.rstrip("\n") for line in handle if line.strip()]
        if not prompts:
            raise ConfigError(f"--prompt-file {options.prompt_file} holds no prompt (one per line)")
    if any(not prompt for prompt in prompts):
        raise ConfigError("--prompt: a prompt is empty; the model needs at least one token to continue")
    return prompts


def prepare(argv):
    """Everything that can be refused, checked before any distributed or model work."""
    options = build_parser().parse_args(argv)
    prompts = read_prompts(options)
    if options.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {options.max_new_tokens} must be >= 1")
    if options.tensor_model_parallel_size < 1:
        raise ConfigError(f"--tensor-model-parallel-size {options.tensor_model_parallel_size} must be >= 1")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != options.tensor_model_parallel_size:
        raise ConfigError(f"{world} ranks were launched for --tensor-model-parallel-size "
                          f"{options.tensor_model_parallel_size}: sampling runs one model replica, so launch "
                          f"exactly --tensor-model-parallel-size ranks")
    directory = _checkpoint_directory(options.load)
    args = model_args(directory, options.config, options.tensor_model_parallel_size)
    settings = settings_from(options, args)
    encoded = [args.tokenizer.tokenize(prompt) for prompt in prompts]
    return options, args, directory, settings, prompts, encoded


def build_model(args, directory: str | None):
    """The sampling model over this rank's TP shard, with the weights of checkpoint `directory` (None:
    freshly initialised, an untrained model)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_csbp.training import checkpointing, providers
    from megatron_csbp.mcore import parallel_state
    from megatron_csbp.tools import sampling
    from megatron_csbp.training.arguments import transformer_config_from_args
    from megatron_csbp.core.device import default_device

    parallel_state.initialize_model_parallel(args.tensor_model_parallel_size, 1, context_block_parallel_size=1,
                                             clean_shards=1, distributed_timeout_minutes=args.distributed_timeout_minutes)
    model_parallel_cuda_manual_seed(args.seed)
    model = sampling.sampling_model(  # the GPTModel keywords RunProviders.model_provider gives the training model
        transformer_config_from_args(args), args.padded_vocab_size, args.bdlm_block_size,
        **providers.gpt_model_kwargs(args)).to(default_device())
    if directory is not None:
        checkpointing.load_checkpoint(directory, model, None, None, args, load_optimizer=False, load_rng=False,
                                      log=lambda *_: None)
    return model


def report(options, args, directory, settings, prompts, generation) -> None:
    method = settings.strategy + (f" (threshold {settings.threshold})" if settings.strategy == "confidence" else "")
    print(f"checkpoint {directory} | {args.bdlm_objective} | block {settings.block_size} | strategy {method} | "
          f"steps/block {settings.steps_per_block} | temperature {settings.temperature} | top-p {settings.top_p} | "
          f"seed {settings.seed} | kv cache {'on' if settings.kv_cache else 'off'} | "
          f"tp {args.tensor_model_parallel_size}")
    for index, (prompt, tokens) in enumerate(zip(prompts, generation.tokens)):
        print(f"prompt {index}: {prompt!r}")
        print(f"sample {index}: {args.tokenizer.detokenize(tokens)!r}")
    count = sum(len(tokens) for tokens in generation.tokens)
    print(f"generated {count} tokens in {generation.seconds:.2f} s ({generation.tokens_per_second:.1f} tokens/s) | "
          f"{generation.model_calls} model calls ({generation.model_rows} token rows)", flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        options, args, directory, settings, prompts, encoded = prepare(argv)
    except ConfigError as error:
        if rank == 0:
            print(f"{NAME}: error: {error}", file=sys.stderr, flush=True)
        return 2

    import torch.distributed as dist

    from megatron_csbp.mcore import cpu_backend, parallel_state
    from megatron_csbp.tools import sampling
    from megatron_csbp.training.loops import init_distributed

    try:
        init_distributed(args.distributed_timeout_minutes)
        with cpu_backend.active():
            model = build_model(args, directory)
            generation = sampling.generate(model, encoded, options.max_new_tokens, settings)
        if rank == 0:
            report(options, args, directory, settings, prompts, generation)
    except ConfigError as error:  # e.g. a checkpoint that does not load into this model: every rank agrees
        if rank == 0:
            print(f"{NAME}: error: {error}", file=sys.stderr, flush=True)
        sys.stderr.flush()
        os._exit(2)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        print(f"rank {rank} failed", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
    finally:
        if parallel_state.is_initialized():
            parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
