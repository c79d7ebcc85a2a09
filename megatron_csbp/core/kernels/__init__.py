"""The two attention shapes a rank computes locally, on the CPU and on the GPU, with their LSE.

BDLM attention, seen from one rank, is a sum of two parts merged by log-sum-exp:
* block-diagonal: noisy rows attend to the noisy rows of their own block (all of them);
* prefix: any row attends to clean keys whose position is below the row's limit (`qb·B` for a noisy
  row of block `qb`, `(qb+1)·B` for a clean one). With keys sorted by position that is a prefix.

Tensors are `q [b, kv_heads, group, n, d]` (GQA query heads grouped under their K/V head, never
expanding K/V) and `k, v [b, kv_heads, n_k, d]`; outputs `o` like `q`, `lse [b, kv_heads, group, n]`.
Backward takes the FINAL merged output and LSE (the flash-attention identity), so each part's gradient
is exact on its own and the parts add.

The field's conventional CP does not decompose: one MASKED call per rank (per ring step when streamed)
over its rows against any keys, under the BDLM mask (`mask.bdlm_visible`), with flex attention's tiles:
key tiles a query tile cannot see are skipped, partly visible ones computed and masked. Its LSE follows the
same identity, so a streamed call's parts merge and differentiate like the two parts above.

One module per family: `merge` (the LSE merge and its accumulation dtype), `mask` (the BDLM mask of any rows
and keys), `cpu_tiles` (torch's CPU flash kernel, tile by tile: one loop over its `PrefixPlan`, `RangePlan`
and `MaskedPlan`), `flex` (flex attention on GPUs). Every kernel family offers `plan(query_limits, key_positions)`,
`block_diagonal_forward/backward`, `prefix_forward/backward`, `masked_plan(query_positions, query_clean,
key_positions, key_clean, block_size, clean_attention=BLOCK_CAUSAL)` and `masked_forward/backward`; a plan's
`work()` gives the (real, computed) pairs its kernel covers, read off its own masks (the CPU plans).
"""

import math

import torch

from megatron_csbp.core.kernels.cpu_tiles import DEFAULT_TILE, MASKED_TILE, CPUKernels, MaskedPlan, PrefixPlan
from megatron_csbp.core.kernels.flex import FlexKernels, FlexMaskedPlan, FlexPrefixPlan
from megatron_csbp.core.kernels.mask import bdlm_visible
from megatron_csbp.core.kernels.merge import accumulation_dtype, merge_into, merge_partials, running_merge

__all__ = ["DEFAULT_TILE", "MASKED_TILE", "CPUKernels", "PrefixPlan", "MaskedPlan", "FlexKernels", "FlexPrefixPlan",
           "FlexMaskedPlan", "bdlm_visible", "accumulation_dtype",
           "merge_partials", "running_merge", "merge_into", "default_kernels", "default_scale"]

_kernels = {}


def default_kernels(device: torch.device):
    """Flex attention on an accelerator, the tiled CPU flash kernel on the CPU; one instance per kind."""
    kind = "cpu" if device.type == "cpu" else "flex"
    if kind not in _kernels:
        _kernels[kind] = CPUKernels() if kind == "cpu" else FlexKernels()
    return _kernels[kind]


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
