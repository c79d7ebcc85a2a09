"""Which rows of `[x_t ; x_0]` each rank holds: the CSBP layout and the conventional-CP baseline's.

A rank's rows are always `[noisy rows ; clean rows]`, in the order of `noisy_positions` then
`clean_positions` (global token positions in `[0, L)`, the same for a token's noisy and clean copy).

CSBP (`CSBPLayout`): noisy rows are whole diffusion blocks, dealt out by the dual-end schedule so every
rank's attention work is equal; clean rows are a zigzag shard of the clean sequence over a ring of `C`
ranks. Conventional CP (`CPLayout`, modes `cp` and `cp-traffic`): the `2L` rows of `[x_t ; x_0]` are cut
into `2C` zigzag chunks by position, which hands rank `r` noisy chunk `r` and clean chunk `C-1-r`.
"""

import dataclasses
from dataclasses import dataclass
from functools import cached_property

import torch

from megatron_csbp.core import modes, rules
from megatron_csbp.core.clean_attention import BLOCK_CAUSAL, CLEAN_ATTENTIONS
from megatron_csbp.core.schedule import CLEAN_LAYOUTS, DUAL_END, SCHEDULES, ZIGZAG
from megatron_csbp.core.windows import GLOBAL, Window


def _span(start: int, stop: int) -> torch.Tensor:
    return torch.arange(start, stop, dtype=torch.long)


def _blocks_to_positions(blocks, block_size: int) -> torch.Tensor:
    if not blocks:
        return torch.empty(0, dtype=torch.long)
    return torch.cat([_span(b * block_size, (b + 1) * block_size) for b in blocks])


class _Rows:
    """What both layouts derive from `noisy_positions` and `clean_positions`."""

    transports_noisy_rows = False  # whether the noisy rows' K/V travel the ring too (conventional CP)
    masked_attention = False  # one masked call over all transported keys instead of block-diagonal + prefix

    @property
    def first_transported_row(self) -> int:
        """This rank's rows `[first_transported_row:]` are the ones whose K/V the ring carries: the clean rows,
        or every row where the noisy ones travel too."""
        return 0 if self.transports_noisy_rows else self.num_noisy_rows

    @property
    def num_blocks(self) -> int:
        return self.seq_length // self.block_size

    @property
    def num_noisy_rows(self) -> int:
        return self.noisy_positions.numel()

    @property
    def num_clean_rows(self) -> int:
        return self.clean_positions.numel()

    @property
    def num_rows(self) -> int:
        return self.num_noisy_rows + self.num_clean_rows

    @cached_property
    def row_positions(self) -> torch.Tensor:
        """RoPE position of every row: a token's noisy and clean copy share it."""
        return torch.cat([self.noisy_positions, self.clean_positions])

    @cached_property
    def row_is_clean(self) -> torch.Tensor:
        return torch.cat([torch.zeros(self.num_noisy_rows, dtype=torch.bool),
                          torch.ones(self.num_clean_rows, dtype=torch.bool)])

    @cached_property
    def row_limits(self) -> torch.Tensor:
        """Exclusive limit of the clean keys each row sees, by the layout's clean-attention rule."""
        return self.clean_attention.row_limits(self.row_positions, self.row_is_clean, self.block_size)

    @cached_property
    def row_starts(self) -> torch.Tensor:
        """First clean position each row sees: its window's start in a sliding layer (`core.windows`), else 0."""
        anchors = self.clean_attention.row_anchors(self.row_positions, self.row_is_clean, self.block_size)
        return self.window.starts(anchors)

    @property
    def exchanges_windows(self) -> bool:
        """Whether the ring carries to each rank only the clean rows its rows see (a sliding layer under CSBP)
        rather than every transported row (a global layer; the field's CP, which gathers both copies whole)."""
        return self.window.sliding and not self.transports_noisy_rows

    def windowed(self, window: Window):
        """This rank's layout in a layer of `window` (`core.windows`): the same rows, the window's mask."""
        return self if window == self.window else dataclasses.replace(self, window=window)

    def _coerce_variants(self, **registries):
        """Variant fields given by name become their objects (a library caller may write `schedule="dual_end"`)."""
        for field, registry in registries.items():
            object.__setattr__(self, field, registry(getattr(self, field)))


@dataclass(frozen=True)
class CSBPLayout(_Rows):
    """Rows of block-parallel rank `rank` of `P`: owned noisy blocks, then its ring's clean shard.

    `P = k·C`: ranks `[i·C, (i+1)·C)` form ring `i`, which holds the clean sequence once; ranks with the
    same `ring_rank` in different rings are clean replicas. `C = 1` is pure block parallelism.
    """

    seq_length: int
    block_size: int
    block_parallel_size: int
    clean_shards: int
    rank: int = 0
    schedule: object = DUAL_END  # core.schedule.BlockSchedule
    clean_layout: object = ZIGZAG  # core.schedule.CleanLayout
    owned_table: tuple | None = None  # owned blocks of every rank, given (a packed sample's balanced deal)
    clean_attention: object = BLOCK_CAUSAL  # core.clean_attention.CleanAttention
    window: Window = GLOBAL  # the layer's window (core.windows): the mask's, never the rows'

    def __post_init__(self):
        self._coerce_variants(schedule=SCHEDULES, clean_layout=CLEAN_LAYOUTS, clean_attention=CLEAN_ATTENTIONS)
        rules.refuse(rules.layout_problem(modes.CSBP, self.seq_length, self.block_size, self.block_parallel_size,
                                          self.clean_shards, self.schedule, self.clean_layout))
        if not 0 <= self.rank < self.block_parallel_size:
            raise ValueError(f"rank={self.rank} is outside block_parallel_size={self.block_parallel_size}")

    @property
    def num_rings(self) -> int:
        return self.block_parallel_size // self.clean_shards

    @property
    def ring_index(self) -> int:
        return self.rank // self.clean_shards

    @property
    def ring_rank(self) -> int:
        return self.rank % self.clean_shards

    @property
    def ring_ranks(self) -> list[int]:
        """Block-parallel ranks of this rank's ring, in ring order."""
        return [self.ring_index * self.clean_shards + i for i in range(self.clean_shards)]

    @property
    def clean_replica_ranks(self) -> list[int]:
        """Block-parallel ranks holding the same clean shard as this one, one per ring."""
        return [ring * self.clean_shards + self.ring_rank for ring in range(self.num_rings)]

    @cached_property
    def schedule_table(self) -> list[list[int]]:
        """Owned blocks of every block-parallel rank, in row order."""
        if self.owned_table is not None:
            return [list(blocks) for blocks in self.owned_table]
        return self.schedule.deal(self.num_blocks, self.block_parallel_size)

    @property
    def owned_blocks(self) -> tuple[int, ...]:
        return tuple(self.schedule_table[self.rank])

    @cached_property
    def noisy_positions(self) -> torch.Tensor:
        return _blocks_to_positions(self.owned_blocks, self.block_size)

    @property
    def clean_spans(self) -> list[tuple[int, int]]:
        """The `(start, stop)` position chunks of this rank's clean rows, in row order (every ring member holds as
        many, of one length)."""
        return self.clean_layout.spans(self.seq_length, self.clean_shards, self.ring_rank)

    @cached_property
    def clean_positions(self) -> torch.Tensor:
        return torch.cat([_span(start, stop) for start, stop in self.clean_spans])

    def for_rank(self, rank: int) -> "CSBPLayout":
        return dataclasses.replace(self, rank=rank)

    def dealt(self, owned_table) -> "CSBPLayout":
        """This rank's layout with the blocks dealt as `owned_table` (each rank keeping its block count: same
        rows, same shapes), e.g. `documents.document_balanced_schedule`'s for a packed sample."""
        if [len(blocks) for blocks in owned_table] != [len(blocks) for blocks in self.schedule_table] or sorted(
                b for blocks in owned_table for b in blocks) != list(range(self.num_blocks)):
            raise ValueError("a deal of the blocks must give every block to one rank and each rank its block count")
        return dataclasses.replace(self, owned_table=tuple(tuple(blocks) for blocks in owned_table))


@dataclass(frozen=True)
class CPLayout(_Rows):
    """Conventional context parallelism over `[x_t ; x_0]`: `2C` zigzag chunks of `L/C` rows by position.

    Every chunk must hold whole diffusion blocks so that a noisy block never straddles two ranks.
    """

    seq_length: int
    block_size: int
    context_parallel_size: int
    rank: int = 0
    # One masked kernel call over the rank's rows against all gathered keys (the field's CP, mode `cp`), or
    # CSBP's block-diagonal and prefix calls on the same rows and traffic (mode `cp-traffic`).
    masked_attention: bool = True
    clean_attention: object = BLOCK_CAUSAL  # core.clean_attention.CleanAttention
    window: Window = GLOBAL  # the layer's window (core.windows)

    def __post_init__(self):
        self._coerce_variants(clean_attention=CLEAN_ATTENTIONS)
        rules.refuse(rules.layout_problem(modes.CP, self.seq_length, self.block_size, self.context_parallel_size))
        if not 0 <= self.rank < self.context_parallel_size:
            raise ValueError(f"rank={self.rank} is outside context_parallel_size={self.context_parallel_size}")

    @property
    def clean_shards(self) -> int:
        """All `C` ranks form one ring that shards both copies."""
        return self.context_parallel_size

    block_parallel_size = clean_shards
    num_rings = 1
    transports_noisy_rows = True  # ring-CP moves the K/V of both copies

    @property
    def ring_rank(self) -> int:
        return self.rank

    @property
    def ring_index(self) -> int:
        return 0

    @property
    def ring_ranks(self) -> list[int]:
        return list(range(self.context_parallel_size))

    @property
    def owned_blocks(self) -> tuple[int, ...]:
        per_rank = self.num_blocks // self.context_parallel_size
        return tuple(range(self.rank * per_rank, (self.rank + 1) * per_rank))

    @cached_property
    def noisy_positions(self) -> torch.Tensor:
        chunk = self.seq_length // self.context_parallel_size
        return _span(self.rank * chunk, (self.rank + 1) * chunk)

    @property
    def clean_spans(self) -> list[tuple[int, int]]:
        chunk = self.seq_length // self.context_parallel_size
        mirror = self.context_parallel_size - 1 - self.rank
        return [(mirror * chunk, (mirror + 1) * chunk)]

    @cached_property
    def clean_positions(self) -> torch.Tensor:
        return _span(*self.clean_spans[0])

    def for_rank(self, rank: int) -> "CPLayout":
        return dataclasses.replace(self, rank=rank)


def layout_for(mode, seq_length: int, block_size: int, parallel_size: int, clean_shards: int | None = None,
               rank: int = 0, *, schedule=DUAL_END, clean_layout=ZIGZAG, clean_attention=BLOCK_CAUSAL,
               window: Window = GLOBAL) -> CSBPLayout | CPLayout:
    """The rows rank `rank` holds under `mode` (a `modes.ParallelMode`, or its `--bdlm-parallel-mode` name), so
    one model can be compared across the modes: conventional CP's zigzag chunks of both copies (CSBP's schedule
    and clean layout do not apply), else whole noisy blocks and a clean shard of the mode's `C`. `window`: the
    layer's (`core.windows`)."""
    mode = modes.parallel_mode(mode)
    if mode.shards_both_copies:
        return CPLayout(seq_length, block_size, parallel_size, rank, mode.masked_attention, clean_attention, window)
    return CSBPLayout(seq_length, block_size, parallel_size, mode.clean_shards(parallel_size, clean_shards), rank,
                      schedule, clean_layout, clean_attention=clean_attention, window=window)
