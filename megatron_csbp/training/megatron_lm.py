"""Megatron-LM's own `pretrain()` driving the plugin: its parser, its loop, our providers.

Megatron-LM (`megatron.training`) is not on PyPI: it is found where `MEGATRON_LM_PATH` points (a checkout
of the Megatron-LM release that matches the installed megatron-core, e.g. tag `core_v0.16.1`; its
`megatron` folder merges with megatron-core's, both being namespace packages) or wherever it is already
importable (`PYTHONPATH`). `MEGATRON_LM_PATH` goes at the END of `sys.path`, so the installed megatron-core
keeps serving `megatron.core`.

A run here:
1. expands `--config` and `key=value` overrides against Megatron-LM's parser plus the plugin's flags
   (`add_csbp_args`), so any Megatron-LM flag and value can stand in a YAML;
2. applies the plugin's rules (`arguments.validate_plugin_args`) to that namespace before any work: the
   same one-line refusals as our own loop;
3. calls `pretrain()` with the plugin's providers (the bound methods of one `providers.RunProviders()`,
   which builds the run from Megatron-LM's parsed arguments on the first provider call), `args_defaults`
   for the BDLM defaults Megatron-LM keeps as None, inside `cpu_backend.active()` (which does nothing where
   an accelerator exists); each of its parses of the command line takes the plugin's flags too.

A refusal a provider raises inside `pretrain()` (`ConfigError`) comes out of this `pretrain` unchanged: the
training script catches it, one line, exit 2.
"""

import argparse
import contextlib
import importlib.util
import os
import sys

from megatron_csbp.core.rules import ConfigError
from megatron_csbp.training import flag_table
from megatron_csbp.training.arguments import (check_host_memory, check_output_paths, check_shared_values,
                                               validate_plugin_args)
from megatron_csbp.training.config import expand_argv
from megatron_csbp.data.datasets import check_data_prefixes, parse_data_path
from megatron_csbp.training.flags import EVAL_INTERVAL, add_csbp_args, byte_tokenizer_as_null


def import_pretrain():
    """Megatron-LM's `pretrain`, or None where `megatron.training` cannot be imported."""
    path = os.environ.get("MEGATRON_LM_PATH")
    if path:
        if not os.path.isdir(os.path.join(path, "megatron", "training")):
            raise ConfigError(f"MEGATRON_LM_PATH={path}: no megatron/training in it; point it at a Megatron-LM "
                              f"checkout (the tag matching megatron-core, e.g. core_v0.16.1)")
        if path not in sys.path:
            sys.path.append(path)
    import torch

    from megatron_csbp.mcore import cpu_backend

    if not torch.accelerator.is_available():
        cpu_backend.triton_free_batch_invariant_kernels()
    if importlib.util.find_spec("megatron.training") is None:
        return None
    from megatron.training import pretrain
    return pretrain


def build_parser() -> argparse.ArgumentParser:
    """Megatron-LM's whole parser (as `pretrain()` builds it) with the plugin's flags added."""
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    return flag_table.add_our_loop_only_refusals(add_csbp_args(add_megatron_arguments(parser)))


def parse_args(argv: list[str], world_size: int) -> tuple[list[str], argparse.Namespace]:
    """(expanded argv, namespace with the plugin's rules applied): what `pretrain()` will re-parse.

    Every flag set away from its default must be one the flag table honours (or a neutral one), and the values
    Megatron-LM's own `validate_args` would stop on with a bare assert are refused first, one line each."""
    parser = build_parser()
    expanded = byte_tokenizer_as_null(expand_argv(argv, parser))
    args = parser.parse_args(expanded)
    flag_table.check_parsed(parser, args)
    check_shared_values(args)
    settings = validate_plugin_args(args, world_size)
    if settings.shape.linear is not None and settings.block_parallel_size > 1:
        raise ConfigError("--experimental-attention-variant gated_delta_net with --context-parallel-size "
                          f"{settings.block_parallel_size}: megatron-core's TransformerConfig, which Megatron-LM's "
                          "loop builds from its flags, refuses Gated DeltaNet beside context parallelism; use "
                          "--training-loop megatron-core, which runs it block-parallel")
    if args.data_path:
        check_data_prefixes(parse_data_path(args.data_path)[0])
    check_host_memory(settings, args)
    check_output_paths(args)  # not the size estimate: the vocabulary is worked out under pretrain()
    return expanded, args


@contextlib.contextmanager
def _built_dataset_helpers_kept():
    """megatron-core's `compile_helpers` runs `make` in its package folder; the PyPI wheel ships the
    helper already built and no Makefile, so `make` fails (on GPUs too) and Megatron-LM exits. Where the
    helper imports, there is nothing to compile."""
    from megatron.core.datasets import utils

    original = utils.compile_helpers
    if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None:
        utils.compile_helpers = lambda: None
    try:
        yield
    finally:
        utils.compile_helpers = original


def _load_target(load_dir: str | None, args) -> str | None:
    """The checkpoint directory Megatron-LM's `_load_base_checkpoint` will read from `load_dir` (its tracker, or
    `--ckpt-step`), or None where it will load nothing."""
    from megatron_csbp.training import checkpointing

    if not load_dir:
        return None
    if getattr(args, "ckpt_step", None):
        return checkpointing.checkpoint_dir(load_dir, args.ckpt_step)
    tracker = os.path.join(load_dir, checkpointing.TRACKER)
    if not os.path.isfile(tracker):
        return None
    if open(tracker, encoding="utf-8").read().strip() == "release":
        return os.path.join(load_dir, "release")
    return checkpointing.checkpoint_dir(load_dir, checkpointing.read_tracker(load_dir))  # one line if garbled


def _rank0_log(line: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(line, flush=True)


@contextlib.contextmanager
def _checkpoints_under_our_rules(args: argparse.Namespace):
    """Megatron-LM's checkpoints kept to our loop's rules, for one `pretrain()`:
    * load: before Megatron-LM's `_load_base_checkpoint` (the one reader behind `load_checkpoint` and
      `--use-checkpoint-args`) reads a torch_dist directory, it is verified as our loop verifies one
      (`checkpointing.check_complete`: the manifest's sizes and SHA-256 where there is one, `.metadata` through
      `safe_load`'s allow-list, the common state), and it then reads under `safe_load.restricted()`; a run that
      continues it (not --finetune) must have its RoPE and its windows (`checkpointing.check_same_positions`,
      `check_same_windows`), as in our loop;
    * save: after Megatron-LM's `save_checkpoint` returns, the manifest is recorded (Megatron-LM writes into
      `iter_XXXXXXX` and its tracker directly, so a crash between its tracker and our manifest leaves a
      checkpoint that loads as Megatron-LM's own, verified without checksums, and says so);
    * the `--save` writer lock is taken once Megatron-LM has initialised the process group, and released at the
      end, however `pretrain()` ends.
    Megatron-LM's own non-persistent (local) checkpoints and `--async-save` are outside these rules."""
    from megatron.core import dist_checkpointing
    from megatron.training import checkpointing as megatron_checkpointing
    from megatron.training import get_args
    from megatron.training import training as megatron_training

    from megatron_csbp.runtime import safe_load, save_lock
    from megatron_csbp.training import checkpointing

    if getattr(args, "async_save", False):
        raise ConfigError("--async-save under --training-loop megatron-lm: the checkpoint manifest is recorded when "
                          "the save returns; drop --async-save")
    original_load, original_save = megatron_checkpointing._load_base_checkpoint, megatron_checkpointing.save_checkpoint
    original_initialize = megatron_training.initialize_megatron
    verified, lock = set(), []  # directories checked in this run (Megatron-LM reads one twice); the lock taken

    def load_base_checkpoint(load_dir, run_args, *rest, **options):
        directory = _load_target(load_dir, run_args)
        if directory is not None and (os.path.isfile(os.path.join(directory, checkpointing.MANIFEST)) or
                                      dist_checkpointing.check_is_distributed_checkpoint(directory)):
            if directory not in verified:
                checkpointing.check_complete(directory, log=_rank0_log)
                _rank0_log(f" verified {directory} (sizes, {checkpointing.CHECKSUM}, .metadata, common state)")
                verified.add(directory)
            safe_load.check_metadata(directory)
        elif directory is not None and not os.path.isdir(directory):
            checkpointing.check_complete(directory, log=_rank0_log)  # one line: it does not exist
        with safe_load.restricted():
            loaded = original_load(load_dir, run_args, *rest, **options)
        state_dict = loaded[0] if isinstance(loaded, tuple) else None
        if directory is not None and isinstance(state_dict, dict) and "args" in state_dict and \
                not getattr(run_args, "finetune", False):
            checkpointing.check_same_positions(checkpointing.saved_args(state_dict), run_args, directory)
            checkpointing.check_same_windows(checkpointing.saved_args(state_dict), run_args, directory)
        return loaded

    def save_checkpoint(iteration, *rest, **options):
        checkpointing.writer_helpers_die_with_us()
        result = original_save(iteration, *rest, **options)
        saved = get_args()
        directory = checkpointing.checkpoint_dir(saved.save, iteration) if saved.save else None
        if not options.get("non_persistent_ckpt") and not options.get("release") and directory and \
                os.path.isdir(directory):
            checkpointing.record_manifest(directory, log=_rank0_log)
            verified.discard(directory)
        return result

    def initialize_megatron(*positional, **options):
        result = original_initialize(*positional, **options)
        lock.append(save_lock.take_for_run(get_args().save))
        return result

    patched = [(megatron_checkpointing, "_load_base_checkpoint", load_base_checkpoint),
               (megatron_checkpointing, "save_checkpoint", save_checkpoint),
               (megatron_training, "save_checkpoint", save_checkpoint),
               (megatron_training, "initialize_megatron", initialize_megatron)]
    originals = [(module, name, getattr(module, name)) for module, name, _ in patched]
    for module, name, replacement in patched:
        setattr(module, name, replacement)
    try:
        yield
    finally:
        for module, name, original in originals:
            setattr(module, name, original)
        if lock and lock[0] is not None:
            save_lock.release(lock[0])


@contextlib.contextmanager
def _plugin_flags_in_every_parse():
    """Megatron-LM's `pretrain()` parses the command line again without the plugin's flags (`ft_integration.setup`:
    `parse_args(ignore_unknown_args=True)`). It would ignore them, but not a value the plugin adds to one of its own
    flags' choices (`--position-embedding-type yarn`): inside `pretrain()` every parse takes the plugin's flags."""
    from megatron.training import arguments

    original = arguments.parse_args

    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        return original(extra_args_provider or add_csbp_args, ignore_unknown_args)

    arguments.parse_args = parse_args
    try:
        yield
    finally:
        arguments.parse_args = original


def pretrain(expanded: list[str], args: argparse.Namespace) -> None:
    """Trains with Megatron-LM's `pretrain()` on the argv `parse_args` expanded (and validated, as `args`)."""
    from megatron.core.enums import ModelType

    from megatron_csbp.mcore import cpu_backend
    from megatron_csbp.training import providers
    from megatron_csbp.core.device import default_backend

    megatron_pretrain = import_pretrain()
    if "--distributed-backend" not in expanded:  # Megatron-LM's default is nccl, which needs a GPU
        expanded = [*expanded, "--distributed-backend", default_backend()]
    sys.argv = [sys.argv[0], *expanded]
    defaults = {"max_position_embeddings": args.seq_length}
    if args.eval_interval is None:  # Megatron-LM's None fails counting its validation samples: our loop's default
        defaults["eval_interval"] = EVAL_INTERVAL
    run_providers = providers.RunProviders()  # Megatron-LM's args: parsed by pretrain(), read on first call
    with cpu_backend.active(), _built_dataset_helpers_kept(), _checkpoints_under_our_rules(args), \
            _plugin_flags_in_every_parse():
        megatron_pretrain(run_providers.train_valid_test_datasets_provider, run_providers.model_provider,
                          ModelType.encoder_or_decoder, run_providers.forward_step,
                          extra_args_provider=add_csbp_args, args_defaults=defaults,
                          get_embedding_ranks=run_providers.get_embedding_ranks)


def main(argv=None) -> int:
    """`--check-flags`: the flag table (`flag_table`) against this Megatron-LM's parser, and its counts."""
    cli = argparse.ArgumentParser(description="Checks the flag table against Megatron-LM's parser "
                                              "(MEGATRON_LM_PATH) and prints the counts per class.")
    cli.add_argument("--check-flags", action="store_true", required=True,
                     help="exit 1 when a flag is missing on either side")
    cli.parse_args(argv)
    if import_pretrain() is None:
        print("Megatron-LM is absent: set MEGATRON_LM_PATH to a checkout of tag core_v0.16.1", file=sys.stderr)
        return 2
    missing, stale = flag_table.mismatches(build_parser())
    for flag in missing:
        print(f"missing from the table: {flag}")
    for flag in stale:
        print(f"in the table, not in Megatron-LM's parser: {flag}")
    print(flag_table.summary())
    return 1 if missing or stale else 0


if __name__ == "__main__":
    sys.exit(main())
