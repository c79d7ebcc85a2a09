#!/usr/bin/env python
"""Readiness of megatron_csbp on one GPU: the flex kernels' exactness and speed, and a ~1B training step.

    python scripts/gpu_check.py [--sections correctness,throughput,train] [--json FILE] [--allow-cpu] [sizes]

The command is `megatron_csbp.tools.gpu_check.main`, where its flags and exit statuses are documented.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_csbp.tools.gpu_check import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
