"""The BDLM mask between any rows and keys of `[x_t ; x_0]`, from their positions and copies (docs/algorithm.md §3).

A noisy row of block `qb` sees the noisy keys of its own block and the clean keys of blocks `< qb`; a clean
row sees the clean keys below its limit (the clean-attention rule's, `core.clean_attention`: BD3-LM's clean row
of block `qb` sees blocks `<= qb`) and no noisy key. In a sliding layer (`core.windows`) a row sees only the
clean keys from its window's start on. The masked kernels (the CPU tiles' `MaskedPlan`, flex's block mask) both
evaluate this one expression; it broadcasts, so it serves a whole `[rows, keys]` table and flex's per-element
`mask_mod` alike.
"""

from megatron_csbp.core.clean_attention import BLOCK_CAUSAL
from megatron_csbp.core.windows import GLOBAL


def bdlm_visible(query_positions, query_clean, key_positions, key_clean, block_size, clean_attention=BLOCK_CAUSAL,
                 window=GLOBAL):
    """May each query see each key: bool tensors broadcast from the four inputs (positions are token positions)."""
    limits = clean_attention.row_limits(query_positions, query_clean, block_size)
    same_block = query_positions // block_size == key_positions // block_size
    clean_keys = key_clean & (key_positions < limits)
    if window.sliding:
        anchors = clean_attention.row_anchors(query_positions, query_clean, block_size)
        clean_keys = clean_keys & (key_positions >= window.starts(anchors))
    return clean_keys | (~query_clean & ~key_clean & same_block)
