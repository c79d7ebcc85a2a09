#!/usr/bin/env python3
"""Submit a BDLM pretraining run to Slurm, refusing a topology that does not fit before anything is queued.

    submit.py --config configs/X.yaml --nodes N --gpus-per-node G [--ntasks-per-node K] [...] [-- key=value ...]

The command is `megatron_csbp.tools.slurm_submit.main`, where its flags and exit statuses are documented.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_csbp.tools.slurm_submit import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
