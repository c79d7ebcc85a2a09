#!/usr/bin/env python
"""Evaluate a trained block diffusion LM: BD3-LM validation NELBO per token, its perplexity bound, standard errors.

    python scripts/evaluate_bdlm.py --load runs/tiny_cpu --data-path data/stdlib_bytes_text_document \\
        [--split valid|test|train|all] [--eval-sequences N] [--noise-samples K] [--seed S] \\
        [--output-json FILE [--overwrite]] [--tensorboard-dir DIR]
    python -m megatron_csbp.torchrun --nproc-per-node 2 scripts/evaluate_bdlm.py ... --context-block-parallel 2

Any layout the checkpoint loads into (TP, PP, CSBP, DP: the trainer's flags); the numbers do not depend on it.
What the numbers are and how they are computed: `megatron_csbp.tools.evaluation`. Exit status: 0 done, 2
refused input (one line, before any work), 130 interrupted, 1 a failure.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_csbp.core import supervision  # noqa: E402

supervision.die_with_launcher()  # a killed launcher takes its ranks with it

if __name__ == "__main__":
    from megatron_csbp.tools import evaluation

    sys.exit(evaluation.main(name=os.path.basename(__file__)))
