"""`python -m megatron_csbp.torchrun`: the command of `megatron_csbp.training.torchrun`."""

import sys

from megatron_csbp.training.torchrun import main

if __name__ == "__main__":
    sys.exit(main())
