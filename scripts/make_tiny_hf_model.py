#!/usr/bin/env python
"""Make a tiny random Hugging Face model locally (nothing downloaded): the recipe's and the tests' AR model.

    python scripts/make_tiny_hf_model.py --family llama --output runs/tiny_llama_hf

The command is `megatron_csbp.tools.tiny_hf_model.main`, where its flags and exit statuses are documented.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_csbp.tools.tiny_hf_model import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
