"""`python -m megatron_csbp.harness ...`: lm-evaluation-harness's command line with `--model megatron_csbp`.

lm-eval has no plugin entry point for models, so this registers ours (`megatron_csbp.tools.harness`) and then
runs lm-eval's own CLI with the same flags, e.g.

    python -m megatron_csbp.harness --model megatron_csbp --model_args load=runs/demo_sequences \\
        --tasks my_task --include_path my_tasks/

and under tensor parallelism, as many ranks as `tensor_parallel_size` (torchrun's `-m` runs this module):

    python -m megatron_csbp.torchrun --standalone --nproc-per-node 2 -m megatron_csbp.harness --model megatron_csbp \
        --model_args load=runs/demo_sequences,tensor_parallel_size=2 --tasks my_task --include_path my_tasks/

Needs the `[eval]` extra (`pip install -e ".[eval]"`);
without it, says so in one line (exit 2).
"""

import sys


def main(argv: list | None = None) -> int:
    try:
        from megatron_csbp.tools.harness import main as run
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] != "lm_eval":
            raise
        print("python -m megatron_csbp.harness: error: lm-eval is not installed; install the extra: pip install -e \".[eval]\"",
              file=sys.stderr, flush=True)
        return 2
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
