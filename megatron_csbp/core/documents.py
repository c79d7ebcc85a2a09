"""Packed sequences: which document each position of a sample belongs to.

A packed sample of `L` tokens holds several documents back to back; `Documents(L, starts)` names the first
position of each (`starts[0] == 0`). Under packing, BDLM attention is the block mask intersected with the
document mask: a row of either copy sees a key only where the block mask allows it AND both are in the same
document. Every visible key set stays a contiguous range of positions — `[doc_start, min(limit, doc_end))`
for the clean keys (limit: `qb·B` for a noisy row of block `qb`, `(qb+1)·B` for a clean one), and the noisy
keys of its own block that share its document — so the kernels only gain a lower bound (`query_starts`).

Documents whose starts fall on block boundaries (each padded to a multiple of `B`, as `tools.prepare_data
--pad-to-block` writes them) train exactly as if each were alone in its own sequence: same blocks, same
noise, same loss and gradients. Megatron-LM's GPTDataset ends documents at EOD wherever they fall; then a
block may straddle two documents, and the intersection above is what each document sees.
"""

import functools
import heapq
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Documents:
    """The documents of one packed sample of `seq_length` tokens: the first position of each, ascending."""

    seq_length: int
    starts: tuple = (0,)

    def __post_init__(self):
        starts = tuple(int(s) for s in self.starts)
        object.__setattr__(self, "starts", starts)
        if not starts or starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])) \
                or starts[-1] >= self.seq_length:
            raise ValueError(f"document starts {starts[:8]}... must begin at 0 and rise strictly below "
                             f"seq_length={self.seq_length}")

    @classmethod
    def from_ids(cls, ids) -> "Documents":
        """From per-position document ids `[L]`: a document is a run of equal ids."""
        ids = torch.as_tensor(ids).reshape(-1).cpu()
        change = torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1
        return cls(ids.numel(), (0, *change.tolist()))

    @classmethod
    def from_eod(cls, tokens, eod: int) -> "Documents":
        """Megatron's convention (`--reset-attention-mask`): each EOD ends its document, the next token starts one."""
        return cls.from_ids(document_ids(torch.as_tensor(tokens).reshape(1, -1), eod)[0])

    @property
    def count(self) -> int:
        return len(self.starts)

    @property
    def is_single(self) -> bool:
        return len(self.starts) == 1

    def bounds(self) -> torch.Tensor:
        """`[count + 1]`: every document's start, then `seq_length`."""
        return torch.tensor(self.starts + (self.seq_length,), dtype=torch.long)

    def lengths(self) -> list[int]:
        b = self.starts + (self.seq_length,)
        return [b[i + 1] - b[i] for i in range(len(self.starts))]

    def ids(self) -> torch.Tensor:
        """`[L]` document index of every position."""
        return torch.repeat_interleave(torch.arange(self.count), torch.tensor(self.lengths()))

    def index_of(self, positions) -> torch.Tensor:
        return torch.searchsorted(self.bounds(), torch.as_tensor(positions), right=True) - 1

    def start_of(self, positions) -> torch.Tensor:
        return self.bounds()[self.index_of(positions)]

    def end_of(self, positions) -> torch.Tensor:
        return self.bounds()[self.index_of(positions) + 1]

    def local_positions(self, positions) -> torch.Tensor:
        """RoPE positions restarted at each document (`--reset-position-ids`)."""
        positions = torch.as_tensor(positions)
        return positions - self.start_of(positions)

    def block_aligned(self, block_size: int) -> bool:
        """Whether every document starts on a block boundary (packed then trains exactly as unpacked)."""
        return all(s % block_size == 0 for s in self.starts)


def document_ids(tokens, eod: int) -> torch.Tensor:
    """`[b, L]` document index of every position, a document ending with (and including) each EOD token."""
    tokens = torch.as_tensor(tokens)
    ends = (tokens == eod).long()
    return torch.cumsum(ends, dim=1) - ends


def clean_key_ranges(layout, documents):
    """`(starts, limits)` per row of `layout`: the clean keys a row sees are those with position in `[start, limit)`.

    `limit` is the layout's clean-attention limit (`layout.row_limits`) and `start` its window's (`layout.row_starts`:
    0 in a global layer); with documents the range is cut to the row's own document."""
    positions, starts, limits = layout.row_positions, layout.row_starts, layout.row_limits
    if documents is None or documents.is_single:
        return starts, limits
    return (torch.maximum(starts, documents.start_of(positions)),
            torch.minimum(limits, documents.end_of(positions)))


def noisy_document_ids(layout, documents):
    """Document index of each noisy row, or None where every owned block lies inside one document (the
    block-diagonal part is then unchanged)."""
    if documents is None or documents.is_single or layout.num_noisy_rows == 0:
        return None
    ids = documents.index_of(layout.noisy_positions)
    per_block = ids.view(-1, layout.block_size)
    if bool((per_block == per_block[:, :1]).all()):
        return None
    return ids


class NoisyDocuments:
    """The document of each of a rank's noisy rows on the device, and the kernels' block-diagonal masks for them
    (built once per plan, reused by every layer and the backward)."""

    def __init__(self, ids: torch.Tensor):
        self.ids = ids
        self.masks = {}

    def visible_pairs(self, block_size: int) -> int:
        """Query-key pairs the block-diagonal masks let through (per head and sample): in each block, each row
        with the rows of its own document."""
        ids = self.ids.view(-1, block_size)
        return int((ids.unsqueeze(2) == ids.unsqueeze(1)).sum())


def row_pairs(layout, documents) -> torch.Tensor:
    """Real query-key pairs of each of `layout`'s rows under the block mask cut to documents (per head and sample):
    a row sees its document's clean keys in its range (`clean_key_ranges`: below its limit, from its window's start
    on), and a noisy row also its block's noisy keys in its document."""
    positions, clean, block = layout.row_positions, layout.row_is_clean, layout.block_size
    documents = documents or Documents(layout.seq_length)
    starts, limits = clean_key_ranges(layout, documents if not documents.is_single else None)
    start, end = documents.start_of(positions), documents.end_of(positions)
    block_start = torch.div(positions, block, rounding_mode="floor") * block
    own_block = torch.minimum(block_start + block, end) - torch.maximum(block_start, start)
    return (torch.minimum(limits, end) - torch.maximum(starts, start)).clamp(min=0) + torch.where(clean, 0, own_block)


def rank_pairs(layouts, documents) -> list[int]:
    """Real attention pairs of every rank's rows (`layouts`: one per block-parallel rank)."""
    return [int(row_pairs(layout, documents).sum()) for layout in layouts]


@dataclass(frozen=True)
class _AllNoisy:
    """The noisy rows of every position, as `row_pairs` reads a layout."""

    seq_length: int
    block_size: int
    clean_attention: object

    @property
    def row_positions(self):
        return torch.arange(self.seq_length)

    @property
    def row_is_clean(self):
        return torch.zeros(self.seq_length, dtype=torch.bool)

    @property
    def row_limits(self):
        return self.clean_attention.row_limits(self.row_positions, self.row_is_clean, self.block_size)

    @property
    def row_starts(self):  # a global layer's: the rows are dealt once for every layer
        return torch.zeros(self.seq_length, dtype=torch.long)


def document_balanced_schedule(layout, documents) -> tuple:
    """Owned blocks of every rank, balancing the real attention pairs of packed `documents`: a noisy block costs
    its document's prefix before it (not its global position) plus its own block; each rank keeps as many blocks
    as the layout's schedule gives it (so its row count, and every tensor shape, stays). Heaviest block first,
    to the least loaded rank with room, counting each rank's clean rows' pairs, which the schedule cannot move.
    The pairs are a global layer's whatever `layout.window`: the rows are the same in every layer."""
    ranks = range(layout.block_parallel_size)
    room = [len(blocks) for blocks in layout.schedule_table]
    bounds = documents.bounds()
    clean_loads = []
    for rank in ranks:  # a clean row sees its document's clean keys below its limit
        positions = layout.for_rank(rank).clean_positions
        index = torch.searchsorted(bounds, positions, right=True) - 1
        limits = layout.clean_attention.clean_row_limit(positions, layout.block_size)
        clean_loads.append(int((torch.minimum(limits, bounds[index + 1]) - bounds[index]).sum()))
    # every position's noisy row: per-block costs
    everything = _AllNoisy(layout.seq_length, layout.block_size, layout.clean_attention)
    costs = row_pairs(everything, documents).view(layout.num_blocks, layout.block_size).sum(1)
    costs = costs.tolist()
    loads, owned = list(clean_loads), [[] for _ in ranks]
    open_ranks = [(load, rank) for rank, load in enumerate(loads) if room[rank]]
    heapq.heapify(open_ranks)
    for block in sorted(range(layout.num_blocks), key=lambda b: (-costs[b], b)):
        load, rank = heapq.heappop(open_ranks)  # the least loaded rank with room (lowest index on ties)
        owned[rank].append(block)
        if len(owned[rank]) < room[rank]:
            heapq.heappush(open_ranks, (load + costs[block], rank))
    return tuple(tuple(sorted(blocks)) for blocks in owned)


@functools.lru_cache(maxsize=32)  # the samples of the micro-batches in flight
def balanced_layout(layout, documents):
    """`layout` with its blocks dealt for `documents` (`document_balanced_schedule`), where the layout deals
    blocks (CSBP and BP; CP's zigzag chunks stay); the same for the forward step's rows and the attention's
    plan of a sample, worked out once for both."""
    deal = getattr(layout, "dealt", None)
    if deal is None or documents is None or documents.is_single:
        return layout
    return deal(document_balanced_schedule(layout, documents))
