#!/usr/bin/env python
"""Generate text from a trained block diffusion LM: block-by-block denoising from a torch_dist checkpoint.

    python scripts/generate_bdlm.py --load runs/tiny_cpu --prompt "def " --max-new-tokens 64
    torchrun --nproc-per-node 2 scripts/generate_bdlm.py --load runs/tiny_cpu --tensor-model-parallel-size 2 \\
        --prompt-file prompts.txt --max-new-tokens 64 --strategy top-k --steps-per-block 8

The command is `megatron_csbp.tools.generate.main`, where its flags and exit statuses are documented.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_csbp.tools.generate import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
