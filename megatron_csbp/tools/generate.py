"""Generate text from a trained block diffusion LM: block-by-block denoising from a torch_dist checkpoint.

    python scripts/generate_bdlm.py --load runs/tiny_cpu --prompt "def " --max-new-tokens 64
    torchrun --nproc-per-node 2 scripts/generate_bdlm.py --load runs/tiny_cpu --tensor-model-parallel-size 2 \\
        --prompt-file prompts.txt --max-new-tokens 64 --strategy top-k --steps-per-block 8

`--load` is a `--save` directory (its latest checkpoint) or one `iter_XXXXXXX` directory. The model, the
tokenizer, the block size, the MASK id and the objective come from the arguments the checkpoint recorded;
`--config FILE.yaml` (a training config) overrides every key it sets, e.g. a `tokenizer-model` that moved or
`bdlm-objective: bd3lm`, and the model's shape must still agree with the checkpoint. An empty `--prompt ""`
samples unconditionally (from the end-of-document token, as BD3-LM starts from BOS). Decoding:
`megatron_csbp.tools.sampling`.

Prints the settings, each prompt with its sample (Python string literals), then the tokens/s and the
number of model calls. Exit status: 0 done, 2 refused input (one line, before the model is built), 130
interrupted (Ctrl-C), 1 a failure.

`main(argv)` is the command of `scripts/generate_bdlm.py`.
"""

import argparse
import os
import sys
import textwrap

from megatron_csbp.core.rules import ConfigError
# Reading a checkpoint (directory, recorded arguments, the sampling model) is shared with the lm-eval harness.
from megatron_csbp.tools.inference import build_model, model_args, read_checkpoint

NAME = "generate_bdlm.py"  # the command's name in its messages


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ConfigError(message)


CHAT_END_TOKENS = ("<|im_end|>", "<|eot_id|>")  # Qwen's (Fast-dLLM v2's stop token) and Llama 3's


def _strategies_help() -> str:
    from megatron_csbp.tools.sampling import STRATEGY

    lines = ["strategies (each as its authors' code decodes; where ours differs, it says so):"]
    for strategy in STRATEGY.values():
        lines += textwrap.wrap(f"{strategy.name}: {strategy.follows}. {strategy.differs}", 100,
                               initial_indent="  ", subsequent_indent="    ")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    from megatron_csbp.tools.sampling import DEFAULT_STRATEGY, STRATEGIES

    parser = _Parser(description="Block-diffusion sampling from a megatron_csbp checkpoint.", allow_abbrev=False,
                     epilog=_strategies_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True, help="A --save directory (latest checkpoint) or an iter_XXXXXXX one.")
    parser.add_argument("--config", default=None, metavar="FILE.yaml",
                        help="Training config whose settings override those the checkpoint recorded.")
    parser.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                        help="A prompt; repeat for a batch. An empty one samples unconditionally.")
    parser.add_argument("--prompt-file", default=None, help="One prompt per line (a batch), UTF-8.")
    parser.add_argument("--max-new-tokens", type=int, required=True)
    parser.add_argument("--steps-per-block", type=int, default=None,
                        help="Denoising steps (model calls) per block at most. Default: the block size "
                             "(diffusion-gemma: 48, the reference's max_denoising_steps).")
    parser.add_argument("--strategy", choices=STRATEGIES, default=None,
                        help=f"How a block is denoised (below). Default: {DEFAULT_STRATEGY}, or diffusion-gemma for a "
                             f"uniform-state checkpoint (--bdlm-objective diffusion-gemma).")
    parser.add_argument("--threshold", type=float, default=0.9,
                        help="Confidence threshold (--strategy confidence, fast-dllm-v2).")
    parser.add_argument("--sub-block-size", type=int, default=None,
                        help="--strategy fast-dllm-v2: sub-blocks decoded left to right (its small_block_size). "
                             "Default: 8 when it divides the block size, else the block.")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy.")
    parser.add_argument("--top-k", type=int, default=0, help="Keep the K largest logits (after temperature, "
                        "before top-p, as SDAR and LLaDA2 do). 0: off.")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="Nucleus; its rule follows the strategy (BD3-LM's cumulative <= p, else the token "
                             "crossing p kept).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help="A stop sequence (tokenized); repeatable. A sample is cut before it.")
    parser.add_argument("--stop-id", action="append", default=[], type=int, metavar="ID",
                        help="A stop token id; repeatable.")
    parser.add_argument("--context-window", type=int, default=None, metavar="N",
                        help="BD3-LM's sliding window: the model sees at most the last N positions (whole blocks, "
                             "positions from 0), so samples can run past the trained length; recomputed when it "
                             "moves (as BD3-LM without its cache).")
    parser.add_argument("--no-kv-cache", action="store_true",
                        help="Recompute the committed prefix at every step (the reference the cache must equal).")
    parser.add_argument("--ignore-eos", action="store_true", help="Do not stop at the end-of-document token.")
    parser.add_argument("--suppress-eos", action="store_true",
                        help="Never produce the end-of-document token (the sample fills --max-new-tokens).")
    group = parser.add_argument_group("--strategy diffusion-gemma (defaults: transformers' DiffusionGemma)")
    for flag, kind, default, text in DIFFUSION_GEMMA_FLAGS:
        group.add_argument(flag, type=kind, default=None, help=f"{text} Default: {default}.")
    group.add_argument("--no-early-stop", action="store_true", help="Run every step (no stable-and-confident stop).")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    return parser


DIFFUSION_GEMMA_FLAGS = (  # flag, type, default (SamplingSettings'), help
    ("--entropy-bound", float, 0.1, "Entropy-bound acceptance: the lowest-entropy positions are accepted while "
                                    "their entropy sum less its maximum stays within it."),
    ("--t-min", float, 0.4, "The temperature schedule's end (after the last step)."),
    ("--t-max", float, 0.8, "The temperature schedule's start (the first step)."),
    ("--stability-threshold", int, 1, "Early stop: steps the argmax canvas must stay the same."),
    ("--confidence-threshold", float, 0.005, "Early stop: the mean entropy it must be below."),
)


def stop_sequences(options, tokenizer, strategy) -> tuple:
    """--stop texts (tokenized) and --stop-id ids; the chat end token for a strategy whose authors stop there."""
    stops = []
    for text in options.stop:
        if not text:
            raise ConfigError("--stop: a stop sequence is empty")
        stops.append(tuple(tokenizer.tokenize(text)))
    stops += [(token,) for token in options.stop_id]
    if strategy.stops_at_chat_end:
        stops += [tuple(ids) for ids in map(tokenizer.tokenize, CHAT_END_TOKENS) if len(ids) == 1]  # a special token
    for token, in (stop for stop in stops if len(stop) == 1):
        if not 0 <= token < tokenizer.vocab_size:
            raise ConfigError(f"--stop-id {token} is not an id of the tokenizer (0..{tokenizer.vocab_size - 1})")
    return tuple(dict.fromkeys(stops))


def settings_from(options, args):
    from megatron_csbp.core.objectives import UNIFORM_STATE, objective_kind
    from megatron_csbp.tools.sampling import SamplingSettings, strategy_for

    eod = args.tokenizer.eod
    corruption = objective_kind(args.bdlm_objective).corruption
    strategy = strategy_for(corruption, options.strategy)
    chosen = strategy.name
    uniform = {flag[2:].replace("-", "_"): getattr(options, flag[2:].replace("-", "_"))
               for flag, *_ in DIFFUSION_GEMMA_FLAGS}
    given = [f"--{name.replace('_', '-')}" for name, value in uniform.items() if value is not None]
    given += ["--no-early-stop"] if options.no_early_stop else []
    if given and strategy.corruption != UNIFORM_STATE:
        raise ConfigError(f"{', '.join(given)}: for --strategy diffusion-gemma only (this is {chosen})")
    return SamplingSettings(
        **{name: value for name, value in uniform.items() if value is not None}, early_stop=not options.no_early_stop,
        block_size=args.bdlm_block_size, mask_token_id=args.mask_token_id,
        steps_per_block=strategy.steps(args.bdlm_block_size, options.steps_per_block),
        strategy=chosen, threshold=options.threshold, temperature=options.temperature,
        top_p=options.top_p, top_k=options.top_k, seed=options.seed,
        eos_token_id=None if options.ignore_eos or options.suppress_eos else eod,
        stop_sequences=stop_sequences(options, args.tokenizer, strategy),
        suppressed_token_ids=(eod,) if options.suppress_eos else (), start_token_id=eod,
        sub_block_size=options.sub_block_size, context_window=options.context_window,
        shifted_labels=bool(objective_kind(args.bdlm_objective).label_shift), vocab_size=args.tokenizer.vocab_size,
        corruption=corruption,
        kv_cache=not options.no_kv_cache)


def available_memory() -> int:
    """Bytes of the device the model runs on: the accelerator's, else the machine's."""
    import torch

    if torch.accelerator.current_accelerator(check_available=True) is not None:
        return torch.accelerator.get_memory_info()[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def decoding_bytes(args, batch: int, total_length: int, positions_seen: int) -> int:
    """What decoding allocates beyond the weights: the token sequence and the K/V cache of every layer (a
    sliding layer's: the `LEFT` positions before the active block and the block; with `--gemma4-attention` a
    global layer's K/V heads are `--global-num-query-groups` of `--global-kv-channels`)."""
    from megatron_csbp.core.windows import layer_windows

    groups = (args.num_query_groups or args.num_attention_heads) // args.tensor_model_parallel_size
    channels = args.kv_channels or args.hidden_size // args.num_attention_heads
    element = 2 if args.bf16 or args.fp16 else 4
    window_size = getattr(args, "window_size", None)
    windows = layer_windows(tuple(window_size) if window_size is not None else None,
                            getattr(args, "window_attn_skip_freq", None), args.num_layers)
    per_position = groups * channels
    global_per_position = per_position
    if getattr(args, "gemma4_attention", False):
        global_per_position = ((args.global_num_query_groups or groups * args.tensor_model_parallel_size)
                               // args.tensor_model_parallel_size) * (args.global_kv_channels or channels)
    cached = sum(min(positions_seen, window.left + args.bdlm_block_size) * per_position if window.sliding
                 else positions_seen * global_per_position for window in windows)
    return 8 * batch * total_length + 2 * cached * batch * element


def check_memory(options, args, settings, encoded) -> None:
    from megatron_csbp.tools.sampling import positions_seen

    lengths = [max(len(ids), 1) for ids in encoded]
    total = -(-(max(lengths) + options.max_new_tokens) // settings.block_size) * settings.block_size
    needed = decoding_bytes(args, len(encoded), total, positions_seen(lengths, options.max_new_tokens, settings))
    have = available_memory()
    if needed > have:
        window = "" if settings.context_window else " or give --context-window"
        raise ConfigError(f"--max-new-tokens {options.max_new_tokens}: decoding {len(encoded)} prompt(s) to "
                          f"{total} positions needs {needed / 2**30:,.1f} GiB (sequence and K/V cache), more than "
                          f"the {have / 2**30:,.1f} GiB this device has; lower it{window}")


def read_prompts(options) -> list[str]:
    if (options.prompt is None) == (options.prompt_file is None):
        raise ConfigError("give the prompts with --prompt TEXT (repeatable) or --prompt-file FILE, one of the two")
    if options.prompt is not None:
        prompts = options.prompt
    else:
        if not os.path.isfile(options.prompt_file):
            raise ConfigError(f"--prompt-file {options.prompt_file}: no such file")
        with open(options.prompt_file, "rb") as handle:
            data = handle.read()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ConfigError(f"--prompt-file {options.prompt_file} is not UTF-8: byte offset {error.start} "
                              f"({data[error.start:error.start + 1]!r}, {error.reason}); save it as UTF-8") from None
        prompts = [line.rstrip("\r") for line in text.split("\n") if line.strip()]
        if not prompts:
            raise ConfigError(f"--prompt-file {options.prompt_file} holds no prompt (one per line)")
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
    checkpoint = read_checkpoint(options.load)
    directory = checkpoint.directory
    args = model_args(checkpoint, options.config, options.tensor_model_parallel_size)
    settings = settings_from(options, args)
    encoded = [args.tokenizer.tokenize(prompt) for prompt in prompts]
    if any(not ids for ids, prompt in zip(encoded, prompts) if prompt):
        raise ConfigError("--prompt: a prompt tokenizes to no token")
    check_memory(options, args, settings, encoded)
    return options, args, directory, settings, prompts, encoded


def warn_past_trained_length(args, settings, encoded, max_new_tokens: int) -> None:
    from megatron_csbp.tools.sampling import past_trained_length

    warning = past_trained_length([len(ids) for ids in encoded], max_new_tokens, settings, args.seq_length)
    if warning and int(os.environ.get("RANK", "0")) == 0:
        print(f"{NAME}: warning: {warning}", file=sys.stderr, flush=True)


def describe(args, directory, settings) -> str:
    from megatron_csbp.core.objectives import UNIFORM_STATE

    window = f" | context window {settings.context_window}" if settings.context_window else ""
    if settings.method.corruption == UNIFORM_STATE:
        stop = (f"stop: stable {settings.stability_threshold}, entropy < {settings.confidence_threshold}"
                if settings.early_stop else "no early stop")
        decoding = (f"strategy {settings.strategy} (entropy bound {settings.entropy_bound}) | steps/block "
                    f"{settings.steps_per_block} | temperature {settings.t_max} -> {settings.t_min} | {stop} | ")
    else:
        decoding = (f"strategy {settings.strategy} (threshold {settings.threshold}) | steps/block "
                    f"{settings.steps_per_block} | temperature {settings.temperature} | top-k {settings.top_k} | "
                    f"top-p {settings.top_p} | ")
    return (f"checkpoint {directory} | {args.bdlm_objective} | block {settings.block_size} | {decoding}"
            f"seed {settings.seed} | kv cache {'on' if settings.kv_cache else 'off'}{window} | "
            f"tp {args.tensor_model_parallel_size}")


def report(options, args, directory, settings, prompts, generation) -> None:
    for index, (prompt, tokens) in enumerate(zip(prompts, generation.tokens)):
        print(f"prompt {index}: {prompt!r}")
        print(f"sample {index}: {args.tokenizer.detokenize(tokens)!r}")
    count = sum(len(tokens) for tokens in generation.tokens)
    print(f"generated {count} tokens in {generation.seconds:.2f} s ({generation.tokens_per_second:.1f} tokens/s) | "
          f"{generation.model_calls} model calls ({generation.model_rows} token rows)", flush=True)


def main(argv: list[str] | None = None) -> int:
    from megatron_csbp.runtime import entry, quiet

    argv = sys.argv[1:] if argv is None else list(argv)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    quiet.quiet_start_up()
    prepared, status = entry.accepted(NAME, lambda: prepare(argv), rank)
    if status is not None:
        return status
    options, args, directory, settings, prompts, encoded = prepared
    warn_past_trained_length(args, settings, encoded, options.max_new_tokens)

    import torch.distributed as dist

    from megatron_csbp.mcore import cpu_backend, parallel_state
    from megatron_csbp.tools import sampling
    from megatron_csbp.training.loops import init_distributed

    def work():
        init_distributed(args.distributed_timeout_minutes)
        with cpu_backend.active():
            model = build_model(args, directory)
            if rank == 0:
                print(describe(args, directory, settings), flush=True)
            generation = sampling.generate(model, encoded, options.max_new_tokens, settings)
        if rank == 0:
            report(options, args, directory, settings, prompts, generation)

    entry.run(NAME, rank, world, work)  # returns only when the prompts are answered
    if parallel_state.is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0
