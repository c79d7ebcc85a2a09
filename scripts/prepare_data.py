#!/usr/bin/env python
"""Build a Megatron indexed dataset (.bin/.idx) from JSONL or plain-text files.

The command is `megatron_csbp.tools.prepare_data.main`, where its flags and exit statuses are documented.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_csbp.tools.prepare_data import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
