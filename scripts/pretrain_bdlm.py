#!/usr/bin/env python
"""Pretrain a block diffusion LM with context-sharded block parallelism (CSBP) on Megatron-Core.

    torchrun --nproc-per-node 2 scripts/pretrain_bdlm.py --config configs/tiny_cpu.yaml [key=value ...]

Launch it like any Megatron script: torchrun, or one `srun` task per rank exporting RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT and LOCAL_RANK (`python scripts/pretrain_bdlm.py ...` alone is one rank).

`--training-loop megatron-lm` runs Megatron-LM's own `pretrain()` with the plugin's providers and flags
(`megatron_csbp.training.megatron_lm`; Megatron-LM is found through `MEGATRON_LM_PATH` or the Python path);
`--training-loop megatron-core` runs `megatron_csbp.training.loop`, a loop built from megatron-core parts with
the same providers; `auto` (the default) takes Megatron-LM's where `megatron.training` imports. Both run on
GPUs and, with gloo, on CPUs.

Exit status: 0 done (or saved and stopped on a signal / exit condition), 2 refused input (one line, before
any work), 17 stopped by a guard (one line), 1 a failure (`megatron_csbp.training.pretrain`, which holds the
command).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_csbp.core import supervision  # noqa: E402

supervision.die_with_launcher()  # at import: a killed torchrun/srun takes its ranks, and their spawned helpers, with it

from megatron_csbp.training.pretrain import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
