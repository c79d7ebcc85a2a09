"""What one rank's attention kernels compute: a `KernelCall` per kernel launch of one layer's forward.

The modes state their kernel calls (`ParallelMode.kernel_calls`), the planner prices each call by its
kernel family's rate, and the bench counts the same figures from the kernels' own masks, so a prediction
and a measurement meet without sharing a formula.

Standard library only (the planner runs without torch).
"""

import dataclasses

# Kernel families: "dense" (whole blocks, no mask), "prefix" (keys below a per-row limit, no mask tensor),
# "masked" (an arbitrary mask, tiles fully masked skipped, partial tiles computed then masked).
KINDS = DENSE, PREFIX, MASKED = ("dense", "prefix", "masked")


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """One attention kernel call of one rank in one layer's forward, and the query-key pairs it covers."""

    kind: str  # one of KINDS
    real_pairs: int  # pairs the BDLM mask allows (the useful work; a packed sample's: and the same document)
    computed_pairs: int  # pairs the kernel multiplies: whole tiles at its tile size (>= real_pairs)
    calls: int = 1  # launches of this shape (e.g. one per ring step)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kernel kind {self.kind!r}: one of {', '.join(KINDS)}")
        if not 0 <= self.real_pairs <= self.computed_pairs:
            raise ValueError(f"real pairs {self.real_pairs} must lie in [0, computed pairs {self.computed_pairs}]")
