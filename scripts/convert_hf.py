#!/usr/bin/env python
"""Hugging Face models in, BDLMs out: a local HF directory <-> our `torch_dist` checkpoints.

    python scripts/convert_hf.py import --hf-dir DIR --save CKPT [--tensor-model-parallel-size T]
                                        [--make-vocab-size-divisible-by N] [--mask-token TOKEN]
    python scripts/convert_hf.py export --load CKPT --hf-dir OUT [--max-shard-size-mb M] [--format hf|sdar|fast-dllm-v2]

The command is `megatron_csbp.tools.convert_hf.main`, where its flags and exit statuses are documented.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_csbp.tools.convert_hf import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
