"""The pretraining command with faults injected: what the reliability tests run instead of scripts/pretrain_bdlm.py.

    torchrun --nproc-per-node 2 tests/faults.py [the script's arguments]   # with some of the variables below set

Each rank wraps the package's own functions, from these environment variables, then runs the command's
`main()` (`megatron_csbp.training.pretrain`); with none set it is the script itself:
* `MEGATRON_CSBP_TEST_NAN_ITERATIONS=3,7`: the loss of those iterations is NaN (in either loop);
* `MEGATRON_CSBP_TEST_INF_GRAD_ITERATIONS=4`: a gradient of those iterations is infinite (the loss finite);
* `MEGATRON_CSBP_TEST_FAIL=RANK:ITERATION[:kill]`: that rank raises (or SIGKILLs itself) in that iteration's
  forward step;
* `MEGATRON_CSBP_TEST_CRASH_BEFORE_PUBLISH=ITERATION`: rank 0 fails after writing that iteration's checkpoint,
  before publishing it (the directory stays `iter_N.tmp`);
* `MEGATRON_CSBP_TEST_TIMEOUT_SECONDS=12`: the distributed timeout (model-parallel groups and watchdog) in
  seconds, so a hang test need not wait a minute (`--distributed-timeout-minutes` counts whole minutes).
"""

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_csbp.core import supervision  # noqa: E402

supervision.die_with_launcher()  # as the script does at import (spawned helpers import this file too)

NAN_ITERATIONS = "MEGATRON_CSBP_TEST_NAN_ITERATIONS"
INF_GRAD_ITERATIONS = "MEGATRON_CSBP_TEST_INF_GRAD_ITERATIONS"
FAIL = "MEGATRON_CSBP_TEST_FAIL"
CRASH_BEFORE_PUBLISH = "MEGATRON_CSBP_TEST_CRASH_BEFORE_PUBLISH"
TIMEOUT_SECONDS = "MEGATRON_CSBP_TEST_TIMEOUT_SECONDS"


def _iterations(name: str) -> frozenset:
    return frozenset(int(i) for i in os.environ.get(name, "").split(",") if i.strip())


def _inject_step_faults() -> None:
    """NaN losses, a failing rank (`Trainer._forward_step`) and infinite gradients (`Trainer._guarded_step`)."""
    import torch.distributed as dist

    from megatron_csbp.training.loop import Trainer

    nan_iterations, inf_grad_iterations = _iterations(NAN_ITERATIONS), _iterations(INF_GRAD_ITERATIONS)
    fail = os.environ.get(FAIL, "").split(":")
    fail_rank, fail_iteration = (int(fail[0]), int(fail[1])) if fail[0] else (None, None)
    fail_by_kill = len(fail) > 2 and fail[2] == "kill"
    forward_step_of, guarded_step = Trainer._forward_step, Trainer._guarded_step

    def faulty_forward_step_of(trainer, iteration):
        forward_step = forward_step_of(trainer, iteration)
        fails = fail_iteration == iteration and fail_rank == dist.get_rank()

        def faulty_forward_step(data_iterator, model):
            if fails:
                if fail_by_kill:
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError(f"injected failure at iteration {iteration} ({FAIL})")
            output, loss_func = forward_step(data_iterator, model)
            if iteration not in nan_iterations:
                return output, loss_func

            def poisoned_loss(output_tensor):
                loss, num_tokens, report = loss_func(output_tensor)
                return loss * float("nan"), num_tokens, {"lm loss": report["lm loss"] * float("nan")}
            return output, poisoned_loss
        return faulty_forward_step

    def faulty_guarded_step(trainer, loss_is_finite):
        if trainer.state.iteration + 1 in inf_grad_iterations:  # the iteration being stepped
            next(trainer.model.parameters()).main_grad.view(-1)[0] = float("inf")
        return guarded_step(trainer, loss_is_finite)

    Trainer._forward_step, Trainer._guarded_step = faulty_forward_step_of, faulty_guarded_step


def _inject_nan_losses_under_megatron_lm() -> None:
    """NaN losses in the iterations named, under Megatron-LM's loop (whose iteration is its `args.curr_iteration`,
    the iterations done): the BDLM loss function the forward step calls is wrapped."""
    from megatron_csbp.bdlm import forward_step

    nan_iterations, loss_func = _iterations(NAN_ITERATIONS), forward_step.loss_func

    def poisoned_loss_func(*args, **kwargs):
        loss, num_tokens, report = loss_func(*args, **kwargs)
        from megatron.training import get_args

        if getattr(get_args(), "curr_iteration", -1) + 1 in nan_iterations:
            return loss * float("nan"), num_tokens, {"lm loss": report["lm loss"] * float("nan")}
        return loss, num_tokens, report

    forward_step.loss_func = poisoned_loss_func


def _takes_megatron_lms_loop(argv: list[str]) -> bool:
    """Whether the command will run Megatron-LM's loop (as it decides: `loops.uses_megatron_lm`)."""
    from megatron_csbp.core.rules import ConfigError
    from megatron_csbp.training import loops
    from megatron_csbp.training.config import training_loop

    try:
        return loops.uses_megatron_lm(training_loop(argv))
    except ConfigError:  # the command refuses it, in its own words
        return False


def _inject_crash_before_publish(iteration: int) -> None:
    """Checkpointing publishes a written checkpoint with `publish.publish_directory`: fail just before."""
    from megatron_csbp.runtime import publish
    from megatron_csbp.training import checkpointing

    publish_directory = publish.publish_directory
    target = os.path.basename(checkpointing.checkpoint_dir("", iteration))

    def crashing_publish_directory(private, final, **options):
        if os.path.basename(final) == target:
            raise RuntimeError(f"injected crash before publishing {final} ({CRASH_BEFORE_PUBLISH})")
        return publish_directory(private, final, **options)

    publish.publish_directory = crashing_publish_directory


def _inject_timeout(seconds: float) -> None:
    supervision.distributed_timeout_seconds = lambda args: seconds


def main() -> int:
    from megatron_csbp.runtime import quiet
    from megatron_csbp.training import pretrain

    quiet.quiet_start_up()  # before the wrapped modules import megatron, as the command does
    if any(os.environ.get(name) for name in (NAN_ITERATIONS, INF_GRAD_ITERATIONS, FAIL)):
        _inject_step_faults()
    if os.environ.get(NAN_ITERATIONS) and _takes_megatron_lms_loop(sys.argv[1:]):
        _inject_nan_losses_under_megatron_lm()
    if os.environ.get(CRASH_BEFORE_PUBLISH):
        _inject_crash_before_publish(int(os.environ[CRASH_BEFORE_PUBLISH]))
    if os.environ.get(TIMEOUT_SECONDS):
        _inject_timeout(float(os.environ[TIMEOUT_SECONDS]))
    return pretrain.main()


if __name__ == "__main__":
    sys.exit(main())
