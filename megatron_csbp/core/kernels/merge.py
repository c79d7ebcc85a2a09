"""Log-sum-exp merge of partial attention results over disjoint key sets, in at least fp32.

A part is `(o, lse)`: its softmax-normalised output and the log-sum-exp of its scores, per query row
(`-inf` and a zero output for a row that sees none of the part's keys). Two ways to combine parts:
`merge_partials` takes them all at once; `merge_into` folds one part into a running result in place,
so a loop over parts (the streaming ring) holds one running output, never every part.
"""

import torch


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """LSEs and sums over parts are kept in at least fp32, whatever the inputs' precision."""
    return torch.promote_types(dtype, torch.float32)


def finite_lse(lse):
    """`lse` with the rows nobody sees (`-inf`) at 0, so weights `exp(part_lse - lse)` are 0 there, not NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def merge_partials(parts):
    """Online-softmax merge of partial `(o, lse)` results over disjoint key sets; rows nobody sees stay 0/-inf.

    The sum runs in at least fp32; the output keeps the parts' dtype, the LSE stays in fp32 (or fp64). The
    parts are left as they are; the merge holds one running result (`merge_into`), not a product per part.
    """
    if len(parts) == 1:
        return parts[0]
    (first_out, first_lse), acc = parts[0], accumulation_dtype(parts[0][0].dtype)
    running = running_merge((first_out.to(acc, copy=True), first_lse.to(acc, copy=True)))
    for part in parts[1:]:
        merge_into(running, part)
    out, lse = running
    return out.to(first_out.dtype), lse


def running_merge(part):
    """A running result started from its first part: output and LSE in the accumulation dtype, owned by the
    caller (the part's own tensors where they already are that dtype: pass a fresh result, or a copy)."""
    out, lse = part
    acc = accumulation_dtype(out.dtype)
    return out.to(acc), lse.to(acc)


def merge_into(running, part):
    """Folds `part` into `running` (from `running_merge`) in place: `O <- O·e^(L−L') + o·e^(l−L')`,
    `L' = logaddexp(L, l)`. Beside the two results it allocates only LSE-sized temporaries."""
    out, lse = running
    part_out, part_lse = part
    merged_lse = torch.logaddexp(lse, part_lse.to(lse.dtype))
    finite = finite_lse(merged_lse)
    out.mul_(torch.exp(lse - finite).unsqueeze(-1))
    out.addcmul_(part_out, torch.exp(part_lse.to(lse.dtype) - finite).unsqueeze(-1))
    lse.copy_(merged_lse)
    return running
