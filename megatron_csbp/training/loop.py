"""Our pretraining loop, built from megatron-core parts, for where Megatron-LM's `pretrain()` cannot run.

DDP, `get_megatron_optimizer`, `OptimizerParamScheduler`, `get_forward_backward_func` and
`dist_checkpointing`, around the very providers `pretrain()` is given (`megatron_csbp.training.providers`): one
`RunProviders(args)` per run, whose run (vocabulary, layout, objective, config, forward step) is built once.

What it adds to a plain loop, and why:
* Exact resumption: a checkpoint holds model, optimizer, scheduler, RNG and the consumed samples; the
  data iterator restarts at that sample and BDLM noise depends on (seed, sample index) only, so k + k
  iterations equal 2k. The logged `lm loss` is the logged iteration's own (not an interval average,
  which a resume in mid-interval would change).
* Preemption: with `--exit-signal-handler`, SIGUSR1 or SIGTERM asks for a save at the next iteration
  boundary and a clean exit (0); `--exit-duration-in-mins` and `--exit-interval` do the same. Ranks
  agree through one all-reduce of their stop flags per iteration, so all stop at the same iteration, and
  say it in one line naming the checkpoint to resume from.
* Numerical faults: a step whose loss or grad norm is not finite is skipped (the optimizer's step is
  split so it never applies it) and counted; `--max-consecutive-bad-steps` in a row stop the run on every
  rank at once (`entry.GuardStop`: one line naming the last good checkpoint, left untouched; exit 17).
* One writer per `--save` (`save_lock`, taken before anything else) and a watchdog per rank
  (`supervision`): an iteration phase, a save or a CSBP collective that does not complete within
  `--distributed-timeout-minutes` ends the run, naming this rank, the operation and the silent ranks.
* Validation: the per-token NELBO (and `exp` of it, a perplexity bound) over `--eval-iters` global batches
  of the validation split. As in Megatron-LM's `pretrain()`, every evaluation takes the next batches of the
  split (the consumed validation samples are checkpointed), so both loops report the same numbers.
"""

import math
import os
import signal
import time

import torch
import torch.distributed as dist

from megatron_csbp.training import checkpointing, providers
from megatron_csbp.core import supervision
from megatron_csbp.training.checkpointing import LoopState
from megatron_csbp.core.device import default_device
from megatron_csbp.training.entry import GuardStop
from megatron_csbp.training.progress import Progress


class _StopSignals:
    """Remembers SIGUSR1/SIGTERM (with `--exit-signal-handler`) until the next iteration boundary."""

    def __init__(self, enabled: bool):
        self.received = None
        self._previous = {}
        if enabled:
            for number in (signal.SIGUSR1, signal.SIGTERM):
                self._previous[number] = signal.signal(number, self._handle)

    def _handle(self, number, frame):
        self.received = signal.Signals(number).name

    def restore(self):
        for number, handler in self._previous.items():
            signal.signal(number, handler)


def _set_seed(seed: int) -> None:
    """Megatron-LM's seeding: one seed per pipeline stage, the tensor-parallel streams derived from it."""
    import random

    import numpy as np
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    seed = seed + 100 * mpu.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def _per_token(totals: dict) -> dict[str, float]:
    """Each reported loss per token (its summed value over its summed tokens), the lm loss first."""
    names = sorted(totals, key=lambda name: name != "lm loss")
    return {name: (totals[name][0] / totals[name][1]).item() for name in names}


def micro_batches(dataset, first_sample: int, args, dp_rank: int, dp_size: int):
    """Endless micro-batches from global sample `first_sample` on, in Megatron's order: each global batch
    of `G` samples is cut into micro-batch rounds of `micro x DP`, DP rank `r` taking slice `r` of each; each
    micro-batch holds what the samples hold (tokens, sample index, and the loss mask of SFT data). None where the
    dataset is not built on this rank (the forward step then receives its batches)."""
    if dataset is None:
        return None
    return _micro_batches(dataset, first_sample, args, dp_rank, dp_size)


def _micro_batches(dataset, first_sample: int, args, dp_rank: int, dp_size: int):
    micro = args.micro_batch_size
    sample = first_sample
    while True:
        for start in range(sample, sample + args.global_batch_size, micro * dp_size):
            indices = [(start + dp_rank * micro + i) % len(dataset) for i in range(micro)]
            items = [dataset[i] for i in indices]
            yield {key: torch.stack([item[key] for item in items]) for key in items[0]}
        sample += args.global_batch_size


def data_parallel(model, config, *, use_distributed_optimizer: bool = False, overlap_grad_reduce: bool = False,
                  overlap_param_gather: bool = False, bucket_size: int | None = None):
    """megatron-core's DDP around `model` (gradients reduced in fp32), wired into `config` for the schedule as
    Megatron-LM's `train()` wires it. `overlap_grad_reduce`: each bucket (megatron-core's default size, at least 40M
    parameters, unless `bucket_size`) is reduced as soon as its gradients are ready, during the backward of the last
    micro-batch, and the schedule starts the rest; `overlap_param_gather` (with the distributed optimizer): the
    schedule starts gathering the updated parameters and each module's forward waits for its bucket only."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=use_distributed_optimizer,
        overlap_grad_reduce=overlap_grad_reduce, overlap_param_gather=overlap_param_gather,
        align_param_gather=overlap_param_gather, bucket_size=bucket_size), model)
    config.no_sync_func = ddp.no_sync
    config.grad_sync_func = ddp.start_grad_sync if overlap_grad_reduce else None
    config.param_sync_func = ddp.start_param_sync if overlap_param_gather else None
    return ddp


def synced_parameters(ddp) -> None:
    """Completes the gather of the updated parameters that `--overlap-param-gather` leaves to the next forward, so
    the model holds them before a checkpoint is written (a no-op without it)."""
    if ddp.ddp_config.overlap_param_gather:
        ddp.start_param_sync(force_sync=True)


class Trainer:
    """One run: model, optimizer, scheduler and data on this rank; `run()` trains and returns the state.

    `run_providers`: the run's `providers.RunProviders` (with its validated `args`)."""

    def __init__(self, run_providers: providers.RunProviders):
        from megatron.core import parallel_state as mpu
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        from megatron_csbp.training.megatron_config import lr_schedule_steps, optimizer_config_from_args
        from megatron_csbp.mcore.model import pipeline_seq_length

        self.providers = run_providers
        run = run_providers.run  # built here, once
        # What checkpoints record and the FLOPs count read: the arguments with the run's vocabulary.
        self.args = args = run.vocabulary.recorded(run_providers.args)
        self.progress = Progress(args, run_providers.settings, enabled=dist.get_rank() == dist.get_world_size() - 1)
        _set_seed(args.seed)
        self.config = run.config
        self.model = run_providers.model_provider(mpu.is_pipeline_first_stage(),
                                                  mpu.is_pipeline_last_stage()).to(default_device())
        self.ddp = data_parallel(self.model, self.config, use_distributed_optimizer=args.use_distributed_optimizer,
                                 overlap_grad_reduce=args.overlap_grad_reduce,
                                 overlap_param_gather=args.overlap_param_gather)
        self.optimizer = get_megatron_optimizer(optimizer_config_from_args(args), [self.ddp])
        samples = args.global_batch_size
        warmup_steps, decay_steps = lr_schedule_steps(args)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
            lr_warmup_steps=warmup_steps, lr_decay_steps=decay_steps,
            lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay,
            wsd_decay_steps=(getattr(args, "lr_wsd_decay_iters", None) or 0) * samples or None,
            lr_wsd_decay_style=getattr(args, "lr_wsd_decay_style", None),
            wd_incr_steps=args.train_iters * samples, wd_incr_style="constant")
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.grad_scale_func = self.optimizer.scale_loss
        self.forward_step = run.forward_step
        self.layout = run.layout
        self.seq_length = pipeline_seq_length(self.layout, self.config)
        self.micro_batch_rows = args.micro_batch_size * run.objective.views_per_sample
        self.num_micro_batches = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
        self.dp_rank = mpu.get_data_parallel_rank()
        self.last_stage = mpu.is_pipeline_last_stage()
        self.state = LoopState()
        self.last_saved = None  # the iteration of the newest checkpoint in --save (this run's, or the one resumed)
        self.loaded = None  # (iteration, --load) of the checkpoint this run started from

    # ----------------------------------------------------------------------------------------- checkpoints
    def load(self) -> None:
        args = self.args
        if not args.load:
            return
        requeue = bool(args.save) and os.path.realpath(args.load) == os.path.realpath(args.save)
        empty = not os.path.isdir(args.load) or (checkpointing.read_tracker(args.load) is None
                                                 and not checkpointing.iteration_dirs(args.load))
        if empty and args.exit_on_missing_checkpoint:
            raise checkpointing.CheckpointError(f"--load {args.load}: no checkpoint there, and "
                                                f"--exit-on-missing-checkpoint is set; give the --save directory "
                                                f"of an earlier run, or drop --exit-on-missing-checkpoint")
        if requeue and empty:
            self.progress.print(f" no checkpoint in {args.load} yet (--load is --save, the requeue pattern): "
                                f"starting from scratch")
            return
        if not os.path.isdir(args.load):
            raise checkpointing.CheckpointError(f"--load {args.load}: no such directory; give the --save "
                                                f"directory of an earlier run, or drop --load")
        with supervision.watch(f"verifying the checkpoints in {args.load}"):
            iteration = checkpointing.find_checkpoint(args.load, fallback=args.load_fallback_to_previous,
                                                      log=self.progress.print)
        directory = checkpointing.checkpoint_dir(args.load, iteration)
        load_optimizer = not (args.no_load_optim or args.finetune)
        with supervision.watch(f"loading {directory}"):
            state = checkpointing.load_checkpoint(directory, self.model, self.optimizer, self.scheduler, args,
                                                  load_optimizer=load_optimizer,
                                                  load_rng=not (args.no_load_rng or args.finetune),
                                                  verify=False, resuming=not args.finetune, log=self.progress.print)
        if not args.finetune:
            self.state = state
            if os.path.realpath(args.load) == os.path.realpath(args.save or ""):
                self.last_saved = state.iteration
        self.loaded = (iteration, args.load)
        self.progress.print(f" loaded checkpoint from {args.load} at iteration {iteration}")

    def last_good_checkpoint(self) -> str:
        """Where this run can be resumed from: the newest checkpoint in --save, else the one it loaded."""
        if self.last_saved is not None:
            return f"iteration {self.last_saved} in {self.args.save}"
        if self.loaded is not None:
            return f"iteration {self.loaded[0]} in {self.loaded[1]}"
        return "none (no --save)" if not self.args.save else f"none in {self.args.save} yet"

    def save(self) -> None:
        if not self.args.save or self.last_saved == self.state.iteration:
            return
        os.makedirs(self.args.save, exist_ok=True)
        with supervision.watch(f"saving the checkpoint of iteration {self.state.iteration}"):
            synced_parameters(self.ddp)
            checkpointing.save_checkpoint(self.args.save, self.state, self.model, self.optimizer, self.scheduler,
                                          self.args, log=self.progress.print)
        self.last_saved = self.state.iteration
        self.progress.print(f" saved checkpoint at iteration {self.state.iteration:7d} to {self.args.save}")

    # ------------------------------------------------------------------------------------------- steps
    def _forward_step(self, iteration):
        """The run's forward step for the micro-batches of `iteration`, marking progress for the watchdog."""
        def forward_step(data_iterator, model):
            supervision.progress()  # one mark per micro-batch: a long schedule is not a hang
            return self.forward_step(data_iterator, model)
        return forward_step

    def _forward_backward(self, forward_step, data_iterator, num_micro_batches, forward_only):
        """Runs the schedule; on the last stage returns each reported loss (`lm loss`, and its parts where the loss
        has two) as [weighted CE sum, tokens] over the global batch."""
        from megatron.core import parallel_state as mpu
        from megatron.core.pipeline_parallel import get_forward_backward_func

        reports = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=data_iterator, model=[self.ddp],
            num_microbatches=num_micro_batches, seq_length=self.seq_length,
            micro_batch_size=self.micro_batch_rows, forward_only=forward_only)
        if not self.last_stage:
            return None
        names = sorted(reports[0])
        totals = torch.stack([torch.stack([report[name] for report in reports]).sum(0) for name in names]).double()
        dist.all_reduce(totals, group=mpu.get_data_parallel_group(with_context_parallel=True))
        return dict(zip(names, totals))

    def _guarded_step(self, loss_is_finite: bool):
        """The optimizer's own step, split so a non-finite loss or grad norm never updates anything.
        Returns (updated, grad norm, bad): `bad` for a non-finite loss or norm."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        if self.optimizer.prepare_grads():  # loss-scale overflow (fp16): skipped, as Megatron does
            return False, None, False
        grad_norm = float(self.optimizer.get_grad_norm())
        if not (loss_is_finite and math.isfinite(grad_norm)):
            return False, grad_norm, True
        for optimizer in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            parameters = optimizer.get_parameters()
            if parameters and optimizer.config.clip_grad > 0.0:
                clip_grad_by_total_norm_fp32(parameters, max_norm=optimizer.config.clip_grad, total_norm=grad_norm,
                                             use_decoupled_grad=optimizer.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
        return bool(self.optimizer.step_with_ready_grads()), grad_norm, False

    def evaluate(self, valid) -> dict | None:
        """Validation losses per token over the next `--eval-iters` global batches (last stage; else None): the
        NELBO, or with an autoregressive co-loss the loss and its parts."""
        self.ddp.eval()
        args = self.args
        data = micro_batches(valid, self.state.consumed_valid_samples, args, self.dp_rank, args.data_parallel_size)
        total = None
        with torch.no_grad():
            for _ in range(args.eval_iters):
                batch = self._forward_backward(self.forward_step, data, self.num_micro_batches, forward_only=True)
                total = batch if total is None else {name: total[name] + batch[name] for name in total}
        self.state.consumed_valid_samples += args.eval_iters * args.global_batch_size
        self.ddp.train()
        if args.num_experts:
            from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker
            clear_aux_losses_tracker()  # as Megatron-LM: validation's routing is not the next step's to log
        return None if total is None else _per_token(total)

    def moe_losses(self) -> dict[str, float]:
        """The MoE losses Megatron-LM's training line shows (`load_balancing_loss`), of the step just taken: each
        averaged over the MoE layers and this replica's micro-batches (summed over pipeline stages and TP x CP,
        averaged over DP), as megatron-core's `track_moe_metrics` gives them. Collective: every rank calls it."""
        args = self.args
        if not args.num_experts:
            return {}
        from megatron.core.transformer.moe.moe_utils import track_moe_metrics

        names = ["load_balancing_loss"] if "aux_loss" in args.moe_router_load_balancing_type else []
        totals = {}
        track_moe_metrics(loss_scale=1 / self.num_micro_batches, iteration=self.state.iteration,
                          total_loss_dict=totals, force_initialize=True, track_names=names,
                          num_layers=args.num_layers, moe_layer_freq=args.moe_layer_freq)
        return {name: float(value) for name, value in totals.items()}

    # -------------------------------------------------------------------------------------------- loop
    def _stop_reason(self, signals, started, loss_is_finite) -> tuple[bool, str | None]:
        """One all-reduce per iteration: (any rank saw a non-finite loss, why every rank must stop now)."""
        args = self.args
        over_time = (args.exit_duration_in_mins is not None
                     and time.time() - started > args.exit_duration_in_mins * 60)
        flags = torch.tensor([not loss_is_finite, signals.received is not None, over_time], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        bad_loss, signalled, over_time = (bool(f) for f in flags.tolist())
        reason = ("a stop signal (SIGUSR1/SIGTERM)" if signalled else
                  f"--exit-duration-in-mins {args.exit_duration_in_mins}" if over_time else None)
        return bad_loss, reason

    def run(self, signals: "_StopSignals") -> LoopState:
        args, state = self.args, self.state
        started = time.time()
        train, valid, _ = self.providers.train_valid_test_datasets_provider()
        data = micro_batches(train, state.consumed_train_samples, args, self.dp_rank, args.data_parallel_size)
        has_valid = torch.tensor([valid is not None], dtype=torch.int32)  # the split is built on some ranks only
        dist.all_reduce(has_valid, op=dist.ReduceOp.MAX)
        evaluates = bool(has_valid.item()) and args.eval_iters > 0
        consecutive_bad, interval_start, interval_iterations = 0, time.time(), 0
        if state.iteration >= args.train_iters:
            self.progress.print(f" nothing to train: the checkpoint is at iteration {state.iteration}, "
                                f"--train-iters is {args.train_iters}")
        try:
            while state.iteration < args.train_iters:
                iteration = state.iteration + 1
                self.ddp.zero_grad_buffer()
                self.optimizer.zero_grad()
                with supervision.watch(f"iteration {iteration}: forward/backward"):
                    total = self._forward_backward(self._forward_step(iteration), data, self.num_micro_batches,
                                                   forward_only=False)
                    losses = None if total is None else _per_token(total)
                    loss = None if losses is None else losses.pop("lm loss")
                with supervision.watch(f"iteration {iteration}: the stop-flag all-reduce"):
                    bad_loss, stop_reason = self._stop_reason(signals, started, loss is None or math.isfinite(loss))
                with supervision.watch(f"iteration {iteration}: optimizer step (grad-norm all-reduce)"):
                    updated, grad_norm, bad = self._guarded_step(not bad_loss)
                state.iteration = iteration
                state.consumed_train_samples += args.global_batch_size
                moe_losses = self.moe_losses()
                if updated:
                    self.scheduler.step(increment=args.global_batch_size)
                    consecutive_bad = 0
                else:
                    state.skipped_iterations += 1
                if bad:
                    state.nan_iterations += 1
                    consecutive_bad += 1
                    self.progress.print(f" iteration {iteration}: non-finite {'loss' if bad_loss else 'grad norm'} "
                                        f"(loss {loss}, grad norm {grad_norm}); step skipped "
                                        f"({consecutive_bad} in a row, limit {args.max_consecutive_bad_steps})")
                    if consecutive_bad >= args.max_consecutive_bad_steps:  # every rank: loss and norm are reduced
                        raise GuardStop(f"stopping at iteration {iteration}: {consecutive_bad} consecutive steps with "
                                        f"a non-finite loss or grad norm (--max-consecutive-bad-steps "
                                        f"{args.max_consecutive_bad_steps}); last good checkpoint: "
                                        f"{self.last_good_checkpoint()}")
                interval_iterations += 1
                if iteration % args.log_interval == 0 and loss is not None:
                    now = time.time()
                    self.progress.training(iteration, state.consumed_train_samples,
                                           (now - interval_start) / interval_iterations,
                                           self.optimizer.param_groups[0]["lr"], loss, grad_norm,
                                           state.skipped_iterations, state.nan_iterations,
                                           {**losses, **moe_losses})
                    interval_start, interval_iterations = now, 0
                if evaluates and iteration % args.eval_interval == 0:
                    with supervision.watch(f"iteration {iteration}: validation"):
                        validation = self.evaluate(valid)
                    if validation is not None:
                        self.progress.validation(iteration, validation)
                    interval_start = time.time()
                if args.save_interval and iteration % args.save_interval == 0:
                    self.save()
                    interval_start = time.time()
                exit_interval = args.exit_interval and iteration % args.exit_interval == 0
                if stop_reason or exit_interval:
                    self.save()
                    self.progress.print(f" exiting at iteration {iteration} on "
                                        f"{stop_reason or f'--exit-interval {args.exit_interval}'}; last good "
                                        f"checkpoint: {self.last_good_checkpoint()}")
                    return state
            self.save()
            return state
        finally:
            self.progress.close()


def train(args, settings=None) -> LoopState:
    """Trains with validated `args` on the initialised default process group; returns the final loop state."""
    from megatron_csbp.training import save_lock

    lock = save_lock.take_for_run(args.save)
    try:
        return _train(args, settings)
    finally:
        if lock is not None:
            save_lock.release(lock)


def _train(args, settings) -> LoopState:
    from megatron_csbp.mcore import parallel_state

    run_providers = providers.RunProviders(args, settings=settings)
    timeout = supervision.distributed_timeout_seconds(args)
    parallel_state.initialize_run(run_providers.settings, timeout / 60,
                                  get_embedding_ranks=run_providers.get_embedding_ranks)
    signals = _StopSignals(args.exit_signal_handler)  # from the start: a signal while loading is not lost
    supervision.start_watchdog(timeout, dist.get_rank(), dist.get_world_size())
    try:
        trainer = Trainer(run_providers)
        trainer.load()
        return trainer.run(signals)
    finally:
        supervision.stop_watchdog()
        signals.restore()
        parallel_state.destroy_model_parallel()
