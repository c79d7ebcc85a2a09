"""Megatron-style progress lines, memory lines, validation lines and TensorBoard scalars.

Printed by one rank (the last, which holds the loss, as in Megatron-LM). Throughput counts the work a
BDLM really does (`flops.bdlm_step_flops`: `L² + L·B` attention pairs per head and layer, LM head over
noisy rows) and tokens as clean context tokens (`L` per sample), as users count "256K context".
(Named `progress`, not `logging`, so it never shadows the standard library's module.)
"""

import math
import resource
import sys
import time

import torch

from megatron_csbp.core.device import default_device
from megatron_csbp.bdlm.flops import run_step_flops

_MB = 1024 * 1024


def memory_stats() -> dict:
    """Megabytes in use and at peak: the accelerator's allocator, or the process's resident set on the CPU."""
    device = default_device()
    if device.type != "cpu":
        module = torch.get_device_module(device)
        return {"allocated": module.memory_allocated(device) / _MB,
                "max allocated": module.max_memory_allocated(device) / _MB,
                "reserved": module.memory_reserved(device) / _MB}
    import psutil
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux
    return {"rss": psutil.Process().memory_info().rss / _MB, "peak rss": peak_kb / 1024}


def _stamp() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


class Progress:
    """Formats and emits the run's lines (only where `enabled`) and TensorBoard scalars (`--tensorboard-dir`)."""

    def __init__(self, args, settings, enabled: bool, stream=None):
        """`args`: the run's arguments with its vocabulary (what its lines name); `settings`: its `RunConfig`."""
        self.args = args
        # the validation loss is the NELBO (its exp bounds perplexity): the diffusion part's, with an AR co-loss
        self.loss_is_bound = settings.objective.loss_is_bound(settings.loss_weighting)
        self.bound = "diffusion loss" if settings.clean_logits else "lm loss"
        self.enabled = enabled
        self.stream = stream or sys.stdout
        self.flops_per_step = run_step_flops(settings, args.padded_vocab_size)
        self.writer = None
        if enabled and args.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(log_dir=args.tensorboard_dir, max_queue=100)

    def print(self, line: str) -> None:
        if self.enabled:
            print(line, file=self.stream, flush=True)

    def training(self, iteration, consumed_samples, seconds_per_iteration, learning_rate, loss, grad_norm,
                 skipped, nan_iterations, other_losses=None) -> None:
        """One iteration's line; `other_losses` (the loss's parts, `diffusion loss` and `ar loss`, and the MoE
        `load_balancing_loss` where positive) follow the lm loss, as in Megatron-LM's line."""
        args = self.args
        other_losses = {name: value for name, value in (other_losses or {}).items()
                        if value > 0 or name.endswith(" loss")}
        others = "".join(f" {name}: {value:.6E} |" for name, value in other_losses.items())
        tokens_per_second = args.global_batch_size * args.seq_length / seconds_per_iteration
        tflops_per_rank = self.flops_per_step / seconds_per_iteration / args.world_size / 1e12
        norm = "nan" if grad_norm is None else f"{grad_norm:.3f}"
        self.print(f" [{_stamp()}] iteration {iteration:8d}/{args.train_iters:8d} | consumed samples: "
                   f"{consumed_samples:12d} | elapsed time per iteration (ms): {seconds_per_iteration * 1e3:.1f} | "
                   f"tokens/s: {tokens_per_second:.1f} | TFLOP/s per rank: {tflops_per_rank:.4g} | "
                   f"learning rate: {learning_rate:.6E} | global batch size: {args.global_batch_size:5d} | "
                   f"lm loss: {loss:.6E} |{others} grad norm: {norm} | number of skipped iterations: {skipped:3d} | "
                   f"number of nan iterations: {nan_iterations:3d} |")
        memory = memory_stats()
        self.print(" memory (MB) | " + " | ".join(f"{name}: {value:.1f}" for name, value in memory.items()) + " |")
        if self.writer is not None:
            scalars = {"lm loss": loss, "learning-rate": learning_rate, "tokens-per-second": tokens_per_second,
                       "tflops-per-rank": tflops_per_rank, "skipped-iterations": skipped, **other_losses}
            if grad_norm is not None and math.isfinite(grad_norm):
                scalars["grad-norm"] = grad_norm
            scalars.update({f"memory/{name} (MB)": value for name, value in memory.items()})
            for name, value in scalars.items():
                self.writer.add_scalar(name, value, iteration)
            self.writer.flush()

    def validation(self, iteration, losses: dict) -> None:
        """Each validation loss per token (`lm loss`, and its parts with an AR co-loss) and `exp` of it: the
        NELBO's (BD3-LM, 1/t weights: the lm loss, or the diffusion part beside an AR co-loss) is an upper bound
        on perplexity; with unit weights, Fast-dLLM v2 or the AR part, `exp` is only a loss's."""
        parts = []
        for name, value in losses.items():
            ppl = math.exp(min(value, 700.0))
            bound = " (upper bound)" if self.loss_is_bound and name == self.bound else ""
            parts.append(f" {name} value: {value:.6E} | {name} PPL{bound}: {ppl:.6E} |")
            if self.writer is not None:
                self.writer.add_scalar(f"{name} validation", value, iteration)
                self.writer.add_scalar(f"{name} validation ppl{' bound' if bound else ''}", ppl, iteration)
        line = f" validation loss at iteration {iteration} |" + "".join(parts)
        self.print("-" * len(line) + "\n" + line + "\n" + "-" * len(line))
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
