"""`python -m megatron_csbp.plan`: the command of `megatron_csbp.tools.plan`."""

from megatron_csbp.tools.plan import command

if __name__ == "__main__":
    command()
