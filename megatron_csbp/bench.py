"""`python -m megatron_csbp.bench`: the command of `megatron_csbp.tools.bench`."""

from megatron_csbp.tools.bench.command import main

if __name__ == "__main__":
    main()
