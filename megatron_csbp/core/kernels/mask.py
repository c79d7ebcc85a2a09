"""The BDLM mask between any rows and keys of `[x_t ; x_0]`, from their positions and copies (docs/algorithm.md §3).

A noisy row of block `qb` sees the noisy keys of its own block and the clean keys of blocks `< qb`; a clean
row of block `qb` sees the clean keys of blocks `<= qb` and no noisy key. The masked kernels (the CPU tiles'
`MaskedPlan`, flex's block mask) both evaluate this one expression; it broadcasts, so it serves a whole
`[rows, keys]` table and flex's per-element `mask_mod` alike.
"""


def bdlm_visible(query_positions, query_clean, key_positions, key_clean, block_size):
    """May each query see each key: bool tensors broadcast from the four inputs (positions are token positions)."""
    query_block, key_block = query_positions // block_size, key_positions // block_size
    noisy_query = ~query_clean
    return ((query_clean & key_clean & (key_block <= query_block))
            | (noisy_query & key_clean & (key_block < query_block))
            | (noisy_query & ~key_clean & (key_block == query_block)))
