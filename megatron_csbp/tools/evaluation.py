"""The BD3-LM metric of a trained model: validation NELBO per token, its perplexity bound, and their errors.

    python scripts/evaluate_bdlm.py --load runs/tiny_cpu --data-path data/stdlib_bytes_text_document \\
        [--split valid|test|train|all] [--eval-sequences N] [--noise-samples K] [--seed S] \\
        [--output-json FILE [--overwrite]] [--tensorboard-dir DIR]
    python -m megatron_csbp.torchrun --nproc-per-node 2 scripts/evaluate_bdlm.py ... --context-block-parallel 2

What it computes. Every sequence `i` of the chosen split is scored under `K` independent noise draws with the
training objective (the checkpoint's BD3-LM NELBO: masked tokens, weight `1/t`): draw `k` gives a weighted
cross-entropy sum `S_ik` over the sequence's supervised tokens `C_i`. The reported NELBO per token is
`sum_ik S_ik / sum_ik C_ik`, the trainer's validation normalisation (weighted CE sum / supervised tokens), and
`exp` of it is an upper bound on perplexity (for `bd3lm` with `inverse-t` weights; otherwise only a loss).

Two standard errors, of two different things:
* `stderr` (over sequences): the spread of the per-sequence estimates `(S_i - NELBO C_i) / mean C` (each
  sequence's `K` draws summed first), divided by `sqrt(N)`. It is the error of the NELBO as an estimate of
  the expected NELBO of a sequence drawn like these, i.e. of the model on the data distribution: it holds
  the data's own spread (which no number of draws removes) plus the noise's, divided by `K`.
* `noise_stderr` (over noise draws, `K >= 2`): `sqrt(sum_i v_i / K) / sum_i C_i`, `v_i` the sample variance
  of `S_ik` over the draws of sequence `i`. It is the error of the NELBO as an estimate of the exact NELBO of
  these `N` sequences (the expectation over the noise): the Monte-Carlo error of the evaluation itself, which
  shrinks as `1/sqrt(K)`.

Noise. Draw `k` is the training objective with its seed replaced by one derived from `(--seed, k)`
(`draw_seed`) and the stratification group set to one sequence: the objective draws sample `s`'s noise from
`(seed, s)` and the group's `u` from `(seed, s // G)` only (`bdlm.objective.BDLMObjective.noise`), so with
`G = 1` the noise of every (sequence, draw) is fixed whatever the layout, the data-parallel cut or the
micro-batching, and the estimates of different sequences and draws are independent (what both standard
errors assume). With the checkpoint's `--bdlm-noise-sampling antithetic` (the default) a sequence's block
times are still stratified, `t_b = (u + b / NB) mod 1`, as training stratifies them over its batch.

How. The model, the objective rows and the schedule are training's: the checkpoint's recorded arguments with
this launch's layout, `providers.RunProviders` (model, datasets, `BDLMForwardStep`), megatron-core's
forward-only schedule (what `Trainer.evaluate` runs) and `checkpointing.load_checkpoint` without an
optimizer. One sequence per micro-batch, so each micro-batch's `[S, C]` report is one sequence's (summed
over the block-parallel ranks, gathered over data-parallel ranks); the reports are summed draw by draw
(`Tally`), so memory grows with N + K, not N x K. Each draw's NELBO is kept for the record: `--noise-samples`
is refused when those do not fit in memory, `--output-json` when its disk has no room for the record.
Sequences are the split's samples of the checkpoint's `--split` (and dataset seed), `--split all` the whole
dataset, the first `--eval-sequences`.
"""

import argparse
import datetime
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, replace

from megatron_csbp.core import rules
from megatron_csbp.core.rules import ConfigError
from megatron_csbp.training import entry

SPLITS = ("valid", "test", "train", "all")
_SPLIT_INDEX = {"train": 0, "valid": 1, "test": 2, "all": 0}
STDERR_OF = ("the expected NELBO per token of a sequence drawn like these (the data's spread between sequences "
             "plus the noise's, over K)")
NOISE_STDERR_OF = ("the exact NELBO per token of these sequences (the expectation over the noise): the "
                   "Monte-Carlo error of the K draws, shrinking as 1/sqrt(K)")


class OutputError(entry.RankRefusal):
    """The `--output-json` file could not be published (found by the last rank alone, which says so)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    """The evaluator's flags: what to score and how often, where the numbers go, and the launch's layout
    (the trainer's flag names; a flag left out is 1, or the checkpoint's for the mode and transport)."""
    parser = _Parser(description="BD3-LM validation NELBO per token (and its perplexity bound) of a megatron_csbp "
                                 "checkpoint over a dataset.", allow_abbrev=False)
    parser.add_argument("--load", required=True, help="A --save directory (its latest checkpoint) or an "
                                                      "iter_XXXXXXX one.")
    parser.add_argument("--data-path", required=True, metavar="PREFIX", help="A dataset prefix (PREFIX.bin/.idx).")
    parser.add_argument("--split", choices=SPLITS, default="valid",
                        help="Which part of the data, cut by the checkpoint's --split: valid (default), test, "
                             "train, or all of it.")
    parser.add_argument("--eval-sequences", type=int, default=None, metavar="N",
                        help="Score the first N sequences of the split (default: all of them).")
    parser.add_argument("--noise-samples", type=int, default=1, metavar="K",
                        help="Noise draws per sequence (default 1); K >= 2 also gives the noise's standard error.")
    parser.add_argument("--seed", type=int, default=None,
                        help="Noise seed: draw k uses a seed derived from (seed, k). Default: the checkpoint's. "
                             "Which sequences are scored does not depend on it.")
    parser.add_argument("--log-interval", type=int, default=100, metavar="N",
                        help="A progress line every N sequence evaluations (sequences x draws).")
    parser.add_argument("--output-json", default=None, metavar="FILE",
                        help="Write the numbers to FILE (published whole by a rename); an existing FILE is refused "
                             "unless --overwrite.")
    parser.add_argument("--overwrite", action="store_true", help="Replace an existing --output-json file.")
    parser.add_argument("--tensorboard-dir", default=None, help="TensorBoard scalars at the checkpoint's iteration.")
    parser.add_argument("--data-cache-path", default=None,
                        help="Where the dataset's sample indices are cached. Default: a 'cache' folder beside it.")
    group = parser.add_argument_group("layout (the trainer's flags; any layout the checkpoint loads into)")
    group.add_argument("--tensor-model-parallel-size", type=int, default=1)
    group.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    group.add_argument("--context-block-parallel", type=int, default=1, metavar="P")
    group.add_argument("--context-block-parallel-clean-shards", type=int, default=None, metavar="C")
    group.add_argument("--bdlm-parallel-mode", choices=rules.PARALLEL_MODES, default=None,
                       help="Default: the checkpoint's.")
    group.add_argument("--csbp-transport", choices=rules.TRANSPORTS, default=None,
                       help="Default: the checkpoint's.")
    group.add_argument("--sequence-parallel", action="store_true")
    group.add_argument("--cross-entropy-loss-fusion", action="store_true",
                       help="The loss as a tiled linear cross-entropy (the same numbers; the logits never whole). "
                            "Default: the checkpoint's.")
    group.add_argument("--cross-entropy-tile-rows", type=int, default=None, metavar="N",
                       help="Its rows per tile. Default: the checkpoint's.")
    group.add_argument("--distributed-timeout-minutes", type=int, default=None, help="Default: the checkpoint's.")
    return parser


@dataclass(frozen=True)
class Prepared:
    """Everything `prepare` checked: the options, the run's arguments and vocabulary, the checkpoint."""

    options: argparse.Namespace
    args: argparse.Namespace  # the checkpoint's arguments with this launch's layout, validated
    vocabulary: object  # tokenizers.Vocabulary: the checkpoint's MASK id and real ids, this TP's padding
    directory: str  # the iter_XXXXXXX directory
    iteration: int
    seed: int  # the noise seed (--seed, or the checkpoint's)


DRAW_BYTES = 64  # memory one noise draw's NELBO takes until the record is written (a float, its slots, a copy)
JSON_BYTES, JSON_DRAW_BYTES = 16 * 2 ** 10, 32  # the record's fixed part (paths included), one draw's line in it


def record_bytes(noise_samples: int) -> int:
    """A bound on the size of the `--output-json` record (it lists every draw's NELBO)."""
    return JSON_BYTES + JSON_DRAW_BYTES * noise_samples


def _check_noise_samples(options) -> None:
    """`--noise-samples` against the machine: the sums over draws are kept per sequence (memory bounded by the
    split), but each draw's NELBO is kept for the record; its time grows with it too, unbounded."""
    import psutil

    needed, available = options.noise_samples * DRAW_BYTES, psutil.virtual_memory().available
    if needed > available:
        raise ConfigError(f"--noise-samples {options.noise_samples}: the evaluation keeps each draw's NELBO for the "
                          f"record, {needed / 2**30:,.1f} GiB, more than the {available / 2**30:,.1f} GiB of memory "
                          f"available; lower it (at most {available // DRAW_BYTES:,})")


def _check_output_json(options) -> None:
    path = options.output_json
    if path is None:
        return
    if os.path.isdir(path):
        raise ConfigError(f"--output-json {path} is a directory; give a file name")
    if os.path.lexists(path) and not options.overwrite:
        raise ConfigError(f"--output-json {path} exists; give another file, or --overwrite to replace it")
    parent = os.path.dirname(os.path.abspath(path))
    probe = parent
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"--output-json {path}: {probe} is not a writable directory; give another file")
    from megatron_csbp.training import publish

    publish.require_free_space(path, record_bytes(options.noise_samples), "--output-json")


def _check_options(options) -> None:
    if options.noise_samples < 1:
        raise ConfigError(f"--noise-samples {options.noise_samples} must be >= 1 (noise draws per sequence)")
    _check_noise_samples(options)
    if options.eval_sequences is not None and options.eval_sequences < 1:
        raise ConfigError(f"--eval-sequences {options.eval_sequences} must be >= 1 (or leave it out: the whole split)")
    if options.seed is not None and options.seed < 0:
        raise ConfigError(f"--seed {options.seed} must be >= 0")
    if options.log_interval < 1:
        raise ConfigError(f"--log-interval {options.log_interval} must be >= 1")
    for flag in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_block_parallel"):
        if getattr(options, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} {getattr(options, flag)} must be >= 1")
    minutes, longest = options.distributed_timeout_minutes, datetime.timedelta.max // datetime.timedelta(minutes=1)
    if minutes is not None and not 1 <= minutes <= longest:  # the process group's timeout is a timedelta
        raise ConfigError(f"--distributed-timeout-minutes {minutes} must be in [1, {longest}]")
    if options.data_path.endswith((".bin", ".idx")):
        raise ConfigError(f"--data-path {options.data_path}: give the prefix without the extension "
                          f"(--data-path {options.data_path[:-4]})")
    from megatron_csbp.training.datasets import check_data_prefixes

    check_data_prefixes([options.data_path])
    _check_output_json(options)


def run_arguments(checkpoint, options, world_size: int):
    """The checkpoint's training arguments with this launch's layout, data and output (`inference.launch_arguments`),
    validated as the trainer validates (a layout the checkpoint cannot load is refused here), and its vocabulary."""
    from megatron_csbp.tools.inference import Launch, launch_arguments
    from megatron_csbp.training.arguments import validate_args

    launch = Launch(options.tensor_model_parallel_size, options.pipeline_model_parallel_size,
                    options.context_block_parallel, options.context_block_parallel_clean_shards,
                    options.sequence_parallel)
    chosen = {flag: getattr(options, flag) for flag in ("bdlm_parallel_mode", "csbp_transport",
                                                        "distributed_timeout_minutes",
                                                        "cross_entropy_tile_rows")
              if getattr(options, flag) is not None}
    if options.cross_entropy_loss_fusion:
        chosen["cross_entropy_loss_fusion"] = True
    # One sequence per micro-batch (each report is one sequence's); nothing is saved or resumed; the validation
    # share may be empty for --split all/train.
    args, vocabulary = launch_arguments(
        checkpoint, launch, **chosen, micro_batch_size=1, global_batch_size=None, data_path=[options.data_path],
        save=None, load=None, tensorboard_dir=options.tensorboard_dir, data_cache_path=options.data_cache_path,
        eval_iters=0, link_gbps=None)
    try:
        validate_args(args, world_size)
    except ConfigError as error:
        ranks = f"{world_size} rank{'' if world_size == 1 else 's'}"
        raise ConfigError(f"checkpoint {checkpoint.directory} under this launch ({ranks}): {error}") from None
    return args, vocabulary


def _check_data(args, vocabulary, split: str) -> None:
    from megatron_csbp.training.datasets import check_split, check_vocabulary

    check_vocabulary(args.data_prefixes, vocabulary.mask_token_id, vocabulary.padded_vocab_size,
                     vocabulary.tokenizer.vocab_size)
    if split == "all":
        args.split = "1,0,0"
        return
    check_split(args.data_prefixes, args.split)
    from megatron.core.datasets.blended_megatron_dataset_config import (convert_split_vector_to_split_matrix,
                                                                         parse_and_normalize_split)

    if convert_split_vector_to_split_matrix(parse_and_normalize_split(args.split))[_SPLIT_INDEX[split]] is None:
        raise ConfigError(f"--split {split}: the checkpoint's --split '{args.split}' gives the {split} split no "
                          f"documents; choose another split, or --split all for the whole dataset")


def prepare(argv: list[str], world_size: int) -> Prepared:
    """Everything that can be refused, before any process group or model exists (`ConfigError`, one line)."""
    options = build_parser().parse_args(argv)
    _check_options(options)
    from megatron_csbp.tools.inference import read_checkpoint

    checkpoint = read_checkpoint(options.load, verify=False)  # verified when it loads, by every rank together
    args, vocabulary = run_arguments(checkpoint, options, world_size)
    _check_data(args, vocabulary, options.split)
    seed = args.seed if options.seed is None else options.seed
    return Prepared(options, args, vocabulary, checkpoint.directory, checkpoint.iteration, seed)


# ------------------------------------------------------------------------------------------------ the noise
def draw_seed(seed: int, draw: int) -> int:
    """The objective seed of noise draw `draw`: a function of `(seed, draw)` only, non-negative."""
    digest = hashlib.blake2b(f"{seed}/evaluation-draw/{draw}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def draw_objective(objective, seed: int, draw: int):
    """The training objective for draw `draw`: its seed from `(seed, draw)`, one sequence per stratification
    group (each sequence's noise, and so its estimate, independent of every other's)."""
    return replace(objective, seed=draw_seed(seed, draw), antithetic_group=1)


# ------------------------------------------------------------------------------------------- the estimate
@dataclass(frozen=True)
class Estimate:
    """The NELBO per token over N sequences x K draws, and its two standard errors (module docstring)."""

    nelbo: float
    stderr: float | None  # over sequences; None for one sequence
    noise_stderr: float | None  # over noise draws; None for K = 1
    sequences: int
    noise_samples: int
    tokens: float  # supervised tokens, summed over sequences and draws
    per_draw: tuple  # the NELBO per token of each draw alone (draw k's is the same whatever K is)

    @property
    def ppl(self) -> float:
        return math.exp(min(self.nelbo, 700.0))


class Tally:
    """What the estimate needs, summed draw by draw (memory O(N + K) whatever K): per sequence its CE and token
    sums over the draws and the spread of its CE sums between draws (Welford's running mean and squares), the
    first draw's tokens, and each draw's own NELBO."""

    def __init__(self, sequences: int):
        import torch

        self.draws, self.first_tokens, self.per_draw = 0, None, []
        self.sums, self.counts, self.mean, self.squares = (torch.zeros(sequences, dtype=torch.float64)
                                                           for _ in range(4))

    def add(self, sums, counts) -> None:
        """Draw `k`'s weighted CE sum and supervised tokens of each sequence ([N] each)."""
        import torch

        sums, counts = torch.as_tensor(sums, dtype=torch.float64), torch.as_tensor(counts, dtype=torch.float64)
        self.draws += 1
        delta = sums - self.mean
        self.mean += delta / self.draws
        self.squares += delta * (sums - self.mean)
        self.sums += sums
        self.counts += counts
        if self.first_tokens is None:
            self.first_tokens = counts.sum()
        self.per_draw.append((sums.sum() / counts.sum()).item())

    def estimate(self) -> Estimate:
        """The NELBO per token and its standard errors over sequences and over noise draws."""
        import torch

        K, N = self.draws, self.sums.shape[0]
        total = self.counts.sum()
        if total <= 0:
            raise ConfigError("the evaluated sequences hold no supervised token")
        nelbo = (self.sums.sum() / total).item()
        stderr = None
        if N >= 2:  # the ratio estimator's linearisation; with equal counts, sd(per-sequence NELBO) / sqrt(N)
            residual = (self.sums - nelbo * self.counts) / self.counts.mean()
            stderr = (residual.std(correction=1) / math.sqrt(N)).item()
        noise_stderr = None
        if K >= 2:  # counts do not depend on the noise: Var(NELBO | sequences) = sum_i Var(S_i) / (K C²)
            within = (self.squares / (K - 1)).sum()
            noise_stderr = (torch.sqrt(within / K) / self.first_tokens).item()
        return Estimate(nelbo, stderr, noise_stderr, N, K, total.item(), tuple(self.per_draw))


def estimate(sums, counts) -> Estimate:
    """From `sums[k][i]` (weighted CE sum of sequence `i` under draw `k`) and `counts[k][i]` (its supervised
    tokens): the NELBO per token and its standard errors over sequences and over noise draws (`Tally`)."""
    import torch

    sums, counts = torch.as_tensor(sums, dtype=torch.float64), torch.as_tensor(counts, dtype=torch.float64)
    tally = Tally(sums.shape[1])
    for draw_sums, draw_counts in zip(sums, counts):
        tally.add(draw_sums, draw_counts)
    return tally.estimate()


def _error(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.6E}"


def summary_line(result: dict) -> str:
    """The Megatron-like line that states the result (the JSON holds the same numbers)."""
    bound = " (upper bound)" if result["ppl_is_upper_bound"] else ""
    return (f" evaluation at iteration {result['iteration']} | split: {result['split']} | sequences: "
            f"{result['sequences']} | noise samples per sequence: {result['noise_samples']} | lm loss value "
            f"(NELBO per token): {result['nelbo']:.6E} | standard error (sequences): {_error(result['stderr'])} | "
            f"standard error (noise): {_error(result['noise_stderr'])} | lm loss PPL{bound}: {result['ppl']:.6E} | "
            f"tokens/s: {result['tokens_per_second']:.1f} | sequences/s: {result['sequences_per_second']:.2f} |")


def write_json(path: str, record: dict, overwrite: bool) -> None:
    """Writes `record` to `path` whole or not at all: into a private directory beside it (`publish`), then
    linked onto `path` (refused if something appeared there meanwhile) or, with `overwrite`, renamed over it."""
    from megatron_csbp.training import publish

    target = os.path.abspath(path)
    with publish.private_directory(target, "--output-json") as private:
        written = os.path.join(private, os.path.basename(target))
        try:
            with open(written, "w", encoding="utf-8") as handle:
                json.dump(record, handle, indent=2)
                handle.write("\n")
                handle.flush()
                os.fsync(handle.fileno())
            if overwrite:
                os.replace(written, target)
            else:
                os.link(written, target)
            publish.fsync_dir(os.path.dirname(target))
        except FileExistsError:
            raise ConfigError(f"--output-json {path}: a file appeared there during the evaluation; nothing was "
                              f"written: give another file, or --overwrite") from None
        except OSError as error:  # e.g. the disk filled during the evaluation
            raise ConfigError(f"--output-json {path}: cannot write it ({error.strerror or error}); nothing was "
                              f"written: free space there or give another file") from None


# ---------------------------------------------------------------------------------------------- the run
def _stamp() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


class Evaluator:
    """This rank's part of an evaluation: the run's model loaded from the checkpoint, the split's sequences, and
    the forward-only schedule over them, draw after draw. Every rank of the launch makes one; the results
    (and the lines) are the last rank's, which is on the last pipeline stage, as in training."""

    def __init__(self, prepared: Prepared, objective_for_draw=None):
        """`objective_for_draw(objective, draw)`: the objective of each noise draw, `draw_objective` with the
        noise seed by default (the tests give the trainer's own noise, to reproduce its validation)."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        from megatron_csbp.core.device import default_device
        from megatron_csbp.mcore import parallel_state
        from megatron_csbp.mcore.model import pipeline_seq_length
        from megatron_csbp.training import checkpointing, providers
        from megatron_csbp.training.progress import Progress

        self.prepared = prepared
        self.objective_for_draw = objective_for_draw or (lambda objective, draw: draw_objective(objective,
                                                                                                prepared.seed, draw))
        args = prepared.args
        self.run_providers = providers.RunProviders(args, prepared.vocabulary)
        parallel_state.initialize_run(self.run_providers.settings, args.distributed_timeout_minutes,
                                      get_embedding_ranks=self.run_providers.get_embedding_ranks)
        torch.manual_seed(args.seed)
        model_parallel_cuda_manual_seed(args.seed)  # the tensor-parallel RNG streams the model is built with
        self.recorded = prepared.vocabulary.recorded(args)
        self.progress = Progress(self.recorded, self.run_providers.settings,
                                 enabled=dist.get_rank() == dist.get_world_size() - 1)
        run = self.run_providers.run
        self.run = run
        self.model = self.run_providers.model_provider(mpu.is_pipeline_first_stage(),
                                                       mpu.is_pipeline_last_stage()).to(default_device())
        checkpointing.load_checkpoint(prepared.directory, self.model, None, None, self.recorded,
                                      load_optimizer=False, load_rng=False, verify=True, log=self.progress.print)
        self.model.eval()
        self.seq_length = pipeline_seq_length(run.layout, run.config)
        self.micro_batch_rows = run.objective.views_per_sample  # one sequence per micro-batch
        self.last_stage = mpu.is_pipeline_last_stage()
        self.dp_rank, self.dp_size = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
        self.micro_batches = max(4, 2 * args.pipeline_model_parallel_size)  # per data-parallel rank and call

    def _dataset(self):
        import torch
        import torch.distributed as dist

        split = self.prepared.options.split
        datasets = self.run_providers.train_valid_test_datasets_provider([None, None, None])
        dataset = datasets[_SPLIT_INDEX[split]]
        length = torch.tensor([len(dataset) if dataset is not None else -1], dtype=torch.int64)
        dist.all_reduce(length, op=dist.ReduceOp.MAX)  # built on the first and last stages' TP rank 0 only
        available = int(length.item())
        if available < 1:
            raise ConfigError(f"--data-path {self.prepared.options.data_path}: the {split} split holds no whole "
                              f"sequence of --seq-length {self.prepared.args.seq_length} tokens; use more data or "
                              f"another --split")
        wanted = self.prepared.options.eval_sequences
        return dataset, available if wanted is None else min(wanted, available), available

    def _batches(self, dataset, indices):
        import torch

        if dataset is None:
            return None
        return iter([{"tokens": dataset[i]["tokens"].unsqueeze(0), "sample_index": torch.tensor([i])}
                     for i in indices])

    def _call(self, forward_step, dataset, start: int, count: int):
        """One schedule call over sequences `[start, start + count)` dealt over the data-parallel ranks as
        Megatron deals micro-batches; returns their `[S, C]` rows on the last stage (else None)."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from megatron_csbp.core import supervision
        from megatron_csbp.core.device import default_device

        micro_batches = -(-count // self.dp_size)
        positions = [j * self.dp_size + self.dp_rank for j in range(micro_batches)]
        indices = [start + (p if p < count else 0) for p in positions]  # past the end: a stand-in, discarded

        def step(data_iterator, model):
            supervision.progress()
            return forward_step(data_iterator, model)

        with torch.no_grad():
            reports = get_forward_backward_func()(
                forward_step_func=step, data_iterator=self._batches(dataset, indices), model=[self.model],
                num_microbatches=micro_batches, seq_length=self.seq_length, micro_batch_size=self.micro_batch_rows,
                forward_only=True)
        if not self.last_stage:
            return None
        rows = torch.zeros(micro_batches * self.dp_size, 2, dtype=torch.float64, device=default_device())
        for position, report in zip(positions, reports):
            rows[position] = report["lm loss"].double()
        dist.all_reduce(rows, group=mpu.get_data_parallel_group(with_context_parallel=True))
        return rows[:count].cpu()

    def evaluate(self) -> dict | None:
        """Scores the sequences under every draw; the result record on the last pipeline stage, else None."""
        import torch

        from megatron_csbp.bdlm.forward_step import BDLMForwardStep
        from megatron_csbp.core import supervision

        prepared, args = self.prepared, self.prepared.args
        options = prepared.options
        dataset, count, available = self._dataset()
        K = options.noise_samples
        tally = Tally(count)
        self.progress.print(f" evaluating {prepared.directory} (iteration {prepared.iteration}) on {count} of the "
                            f"{available} sequences of the {options.split} split x {K} noise samples (seed "
                            f"{prepared.seed}) | tp {args.tensor_model_parallel_size} pp "
                            f"{args.pipeline_model_parallel_size} {args.bdlm_parallel_mode} "
                            f"{args.context_parallel_size} (clean shards {self.run_providers.settings.clean_shards}) "
                            f"dp {args.data_parallel_size}")
        per_call = self.micro_batches * self.dp_size
        total, done, logged, last_logged = K * count, 0, 0, 0
        started = interval_start = time.perf_counter()
        for draw in range(K):
            forward_step = BDLMForwardStep(self.objective_for_draw(self.run.objective, draw), self.run.layout)
            sums, counts = torch.zeros(count, dtype=torch.float64), torch.zeros(count, dtype=torch.float64)
            for start in range(0, count, per_call):
                size = min(per_call, count - start)
                with supervision.watch(f"evaluation: noise sample {draw}, sequences {start}-{start + size - 1}"):
                    rows = self._call(forward_step, dataset, start, size)
                if rows is not None:
                    sums[start:start + size], counts[start:start + size] = rows[:, 0], rows[:, 1]
                done += size
                if done // options.log_interval > logged or done == total:
                    now = time.perf_counter()
                    self._progress_line(done, total, draw, K, done - last_logged, now - interval_start)
                    logged, last_logged, interval_start = done // options.log_interval, done, now
            if self.last_stage:
                tally.add(sums, counts)
        seconds = time.perf_counter() - started
        if not self.last_stage:
            return None
        return self._record(tally.estimate(), seconds)

    def _progress_line(self, done, total, draw, K, evaluated, seconds) -> None:
        seconds = max(seconds, 1e-9)
        self.progress.print(f" [{_stamp()}] evaluated {done:8d}/{total:8d} sequences x noise samples (noise sample "
                            f"{draw + 1}/{K}) | sequences/s: {evaluated / seconds:.2f} | tokens/s: "
                            f"{evaluated * self.prepared.args.seq_length / seconds:.1f} |")

    def _record(self, result: Estimate, seconds: float) -> dict:
        prepared, args = self.prepared, self.prepared.args
        settings = self.run_providers.settings
        seconds = max(seconds, 1e-9)
        evaluated = result.sequences * result.noise_samples
        return {
            "checkpoint": os.path.abspath(prepared.directory), "iteration": prepared.iteration,
            "data_path": prepared.options.data_path, "split": prepared.options.split,
            "checkpoint_split": args.split if prepared.options.split != "all" else None,
            "sequences": result.sequences, "noise_samples": result.noise_samples, "seed": prepared.seed,
            "seq_length": args.seq_length, "objective": settings.objective.name,
            "loss_weighting": settings.loss_weighting,
            "noise_sampling": args.bdlm_noise_sampling,
            "nelbo": result.nelbo, "ppl": result.ppl,
            "ppl_is_upper_bound": self.progress.loss_is_bound,
            "stderr": result.stderr, "stderr_of": STDERR_OF,
            "noise_stderr": result.noise_stderr, "noise_stderr_of": NOISE_STDERR_OF,
            "nelbo_per_draw": list(result.per_draw),
            "supervised_tokens": result.tokens, "tokens": evaluated * args.seq_length, "seconds": seconds,
            "tokens_per_second": evaluated * args.seq_length / seconds, "sequences_per_second": evaluated / seconds,
            "layout": {"world_size": args.world_size, "tensor_model_parallel_size": args.tensor_model_parallel_size,
                       "pipeline_model_parallel_size": args.pipeline_model_parallel_size,
                       "context_block_parallel": args.context_parallel_size,
                       "context_block_parallel_clean_shards": settings.clean_shards,
                       "bdlm_parallel_mode": settings.mode.name, "data_parallel_size": settings.data_parallel_size,
                       "logits_tile_rows": settings.logits_tile_rows},
        }

    def report(self, record: dict | None) -> None:
        """The summary line, TensorBoard scalars and the JSON file, on the last rank."""
        if record is None or not self.progress.enabled:
            return
        line = summary_line(record)
        self.progress.print("-" * len(line) + "\n" + line + "\n" + "-" * len(line))
        writer = self.progress.writer
        if writer is not None:
            scalars = {"evaluation/nelbo": record["nelbo"], "evaluation/ppl": record["ppl"],
                       "evaluation/stderr": record["stderr"], "evaluation/noise-stderr": record["noise_stderr"],
                       "evaluation/tokens-per-second": record["tokens_per_second"]}
            for name, value in scalars.items():
                if value is not None:
                    writer.add_scalar(name, value, record["iteration"])
            writer.flush()
        if self.prepared.options.output_json:
            try:
                write_json(self.prepared.options.output_json, record, self.prepared.options.overwrite)
            except ConfigError as error:
                raise OutputError(str(error)) from None
            self.progress.print(f" wrote {self.prepared.options.output_json}")

    def close(self) -> None:
        self.progress.close()


def run(prepared: Prepared) -> dict | None:
    """The evaluation on this rank of an initialised default process group; the record on the last rank."""
    from megatron_csbp.core import supervision
    import torch.distributed as dist

    from megatron_csbp.mcore import parallel_state

    supervision.start_watchdog(supervision.distributed_timeout_seconds(prepared.args), dist.get_rank(),
                               dist.get_world_size())
    evaluator = None
    try:
        evaluator = Evaluator(prepared)
        record = evaluator.evaluate()
        evaluator.report(record)
        return record if evaluator.progress.enabled else None
    finally:
        if evaluator is not None:
            evaluator.close()
        supervision.stop_watchdog()
        if parallel_state.is_initialized():
            parallel_state.destroy_model_parallel()


def main(argv: list[str] | None = None, name: str = "evaluate_bdlm.py") -> int:
    """The script: refusals (one line, exit 2) before any work, then the evaluation on every rank. Exit status
    0 done, 2 refused, 130 interrupted, 1 a failure (`rank R failed: ...`)."""
    from megatron_csbp.training import quiet

    argv = sys.argv[1:] if argv is None else list(argv)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    quiet.quiet_start_up()
    prepared, status = entry.accepted(name, lambda: prepare(argv, world), rank,
                                      on_refusal=lambda: entry.leave_together(world))
    if status is not None:
        return status

    import torch.distributed as dist

    from megatron_csbp.mcore import cpu_backend
    from megatron_csbp.training.loops import init_distributed

    def work():
        init_distributed(prepared.args.distributed_timeout_minutes)
        with cpu_backend.active():
            run(prepared)

    entry.run(name, rank, world, work)  # returns only when the evaluation is done
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0
