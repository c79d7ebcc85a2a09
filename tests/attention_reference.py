"""A dense fp64 single-process reference of BDLM attention over all `2L` rows, written independently of the op.

Row `i < L` is the noisy copy of token `i`, row `L + i` its clean copy; the mask is the table of the
algorithm doc, spelled out pair by pair.
"""

import torch


def bdlm_mask(seq_length: int, block_size: int, token_causal: bool = False) -> torch.Tensor:
    """`[2L, 2L]` bool: may query row attend to key row. `token_causal`: a clean row sees the clean tokens up to its
    own position (an autoregressive clean stream) instead of its whole block."""
    position = torch.arange(seq_length)
    block = position // block_size
    qb, kb = block.view(-1, 1), block.view(1, -1)
    noisy_to_noisy = qb == kb
    noisy_to_clean = kb < qb
    clean_to_noisy = torch.zeros_like(noisy_to_noisy)
    clean_to_clean = (position.view(1, -1) <= position.view(-1, 1)) if token_causal else kb <= qb
    return torch.cat([torch.cat([noisy_to_noisy, noisy_to_clean], 1), torch.cat([clean_to_noisy, clean_to_clean], 1)], 0)


def windowed_bdlm_mask(seq_length: int, block_size: int, left: int, token_causal: bool = False) -> torch.Tensor:
    """`[2L, 2L]` bool: the BDLM mask of a sliding layer that reaches `left` positions back. A unit (a token-causal
    clean row, or a bidirectional block: a noisy block, a block-causal clean block) sees the clean keys of the `left`
    positions before its first one, and itself: a token-causal clean row at `p` the clean keys `p - left .. p`
    (transformers' `sliding_window = left + 1`, Megatron's `window_size (left, 0)`); a noisy row of block `b` the
    clean keys `bB - left .. bB - 1` (DiffusionGemma's canvas reads the `sliding_window - 1` states the cache keeps);
    a block-causal clean row of block `b` the clean keys `bB - left .. (b+1)B - 1`. Noisy keys as in `bdlm_mask`."""
    L = seq_length
    position = torch.arange(L)
    block_start = position // block_size * block_size
    key = position.view(1, -1)
    noisy_unit = block_start.view(-1, 1)
    clean_unit = position.view(-1, 1) if token_causal else block_start.view(-1, 1)
    inside = torch.ones(2 * L, 2 * L, dtype=torch.bool)
    inside[:L, L:] = key >= noisy_unit - left
    inside[L:, L:] = key >= clean_unit - left
    return bdlm_mask(L, block_size, token_causal) & inside


def dense_attention(query, key, value, seq_length, block_size, scale=None, mask=None):
    """`[2L, b, heads, d]` and `[2L, b, kv_heads, d]` -> `[2L, b, heads·d]`, fp64, K/V repeated for GQA, under
    `mask` (`[2L, 2L]` bool; default: `bdlm_mask`)."""
    group = query.shape[2] // key.shape[2]
    q = query.double().permute(1, 2, 0, 3)
    k = key.double().repeat_interleave(group, dim=2).permute(1, 2, 0, 3)
    v = value.double().repeat_interleave(group, dim=2).permute(1, 2, 0, 3)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    mask = bdlm_mask(seq_length, block_size) if mask is None else mask
    scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    return out.permute(2, 0, 1, 3).flatten(2)


def global_rows(layout) -> torch.Tensor:
    """Indices into the `2L` reference rows of this rank's rows, in layout order."""
    return torch.cat([layout.noisy_positions, layout.seq_length + layout.clean_positions])


def relative_error(actual, expected) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()
