"""Which clean keys a row of `[x_t ; x_0]` sees: the clean-attention rule, as an object (docs/algorithm.md §3).

Every visible set of clean keys is a prefix of the clean sequence: a row sees the clean keys at positions below its
limit (in a sliding layer only from its window's start on: `core.windows` reaches back from the row's anchor, the
first position of the unit it attends as, which the rule also states). A noisy row of block `qb` sees the clean
blocks before its own (limit `qb·B`) under every rule; what a clean row sees is the rule's: BD3-LM's block-causal
clean stream sees its own block whole (limit `(qb+1)·B`); a token-causal clean stream (Nemotron-Labs-Diffusion's,
an autoregressive model's) sees the clean keys up to its own position (limit `p + 1`), so its rows can carry a
next-token loss. The noisy keys a noisy row sees (its own block) do not depend on the rule.

Each place that needs the mask asks the rule — the op's plans (`core.ops`), the packed documents' ranges and
pair counts (`core.documents`), the masked kernels (`core.kernels.mask`), the modes' analytic kernel calls
(`core.modes`) and the FLOP count (`bdlm.flops`) — so a new rule is one object here. A layout carries its
rule (`layout.clean_attention`), with the block size it goes with.

Standard library only; `row_limits` works on ints and on torch tensors alike.
"""

import dataclasses

from megatron_csbp.core.variants import Registry, named


@named
@dataclasses.dataclass(frozen=True)
class CleanAttention:
    """BD3-LM's rule (the base): a clean row sees the clean keys up to the end of its own block."""

    name: str
    summary: str

    def clean_row_limit(self, positions, block_size):
        """Exclusive limit of the clean keys a clean row at `positions` sees."""
        return (positions // block_size + 1) * block_size

    def row_limits(self, positions, clean, block_size):
        """Exclusive limit of the clean keys each row sees (`clean`: whether the row is of the clean copy)."""
        noisy = positions // block_size * block_size
        return noisy + clean * (self.clean_row_limit(positions, block_size) - noisy)

    def clean_row_anchor(self, positions, block_size):
        """First position of the unit a clean row attends as (a sliding window reaches back from it): its block,
        which it sees whole."""
        return positions // block_size * block_size

    def row_anchors(self, positions, clean, block_size):
        """Each row's anchor (`core.windows`): a noisy row's block's first position; a clean row's, the rule's."""
        noisy = positions // block_size * block_size
        return noisy + clean * (self.clean_row_anchor(positions, block_size) - noisy)

    def key_runs(self, spans, clean: bool, block_size: int):
        """`(anchor, limit, rows)` for each run of the rows at position `spans` (`[(start, stop)]`) sharing their
        anchor and limit: a run sees the clean keys below `limit` (in a sliding layer, from its window's start on,
        which `core.windows` reaches back from `anchor`)."""
        B = block_size
        for start, stop in spans:
            for block in range(start // B, (stop - 1) // B + 1 if stop > start else start // B):
                yield block * B, (block + int(clean)) * B, min(stop, (block + 1) * B) - max(start, block * B)

    def clean_pairs(self, seq_length: int, block_size: int) -> int:
        """Clean-to-clean pairs per head and layer: clean block `b` sees clean blocks `<= b`."""
        num_blocks = seq_length // block_size
        return block_size * block_size * num_blocks * (num_blocks + 1) // 2


    @property
    def sees_the_future(self) -> bool:
        """Whether a clean row sees a clean key after its own position (so it cannot carry a next-token loss)."""
        return True


@named
class _TokenCausal(CleanAttention):
    """An autoregressive clean stream: a clean row sees the clean keys at its own position and before."""

    def clean_row_limit(self, positions, block_size):
        return positions + 1

    def clean_row_anchor(self, positions, block_size):
        return positions

    def key_runs(self, spans, clean, block_size):
        if not clean:
            yield from super().key_runs(spans, clean, block_size)
            return
        for start, stop in spans:
            for position in range(start, stop):
                yield position, position + 1, 1

    def clean_pairs(self, seq_length, block_size):
        return seq_length * (seq_length + 1) // 2

    @property
    def sees_the_future(self):
        return False


BLOCK_CAUSAL = CleanAttention("block-causal", "BD3-LM: a clean row sees the clean copy up to the end of its block")
TOKEN_CAUSAL = _TokenCausal("token-causal", "an autoregressive clean stream: a clean row sees the clean copy up to "
                                            "its own position")
CLEAN_ATTENTIONS = Registry("--bdlm-clean-attention", BLOCK_CAUSAL, TOKEN_CAUSAL)
