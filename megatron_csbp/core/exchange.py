"""What a sliding layer moves between the members of a ring: each rank gets only the clean rows its rows see.

In a global layer every rank needs every clean key, so the ring gathers them all (docs/algorithm.md §7). In a
sliding layer (`core.windows`) a rank's rows see only the clean keys in their windows: for each noisy block the
`left` positions before it, for each clean row the window behind its unit. So a rank receives, from each other
member of its ring, the rows of that member's shard that some row of its own sees, and sends each member the
rows of its own shard that member sees; the rows it holds never travel, nor does anything no row sees. The
backward returns the gradients of exactly those rows to their owners. Turbo-dLLM's windowed clean exchange
does the same (`windowed_clean_exchange_plan`); here the sets are read off the rows' own key ranges
(`documents.clean_key_ranges`), so they are exact under any clean-attention rule, layout and packing.
"""

from dataclasses import dataclass
from functools import cached_property

import torch

from megatron_csbp.core.documents import clean_key_ranges


def seen_positions(starts, limits, seq_length: int) -> torch.Tensor:
    """`[L]` bool: which clean positions some row with clean keys `[start, limit)` sees."""
    seen = starts < limits
    cover = torch.zeros(seq_length + 1, dtype=torch.long)
    cover.index_add_(0, starts[seen].clamp(min=0), torch.ones(int(seen.sum()), dtype=torch.long))
    cover.index_add_(0, limits[seen].clamp(max=seq_length), -torch.ones(int(seen.sum()), dtype=torch.long))
    return torch.cumsum(cover, 0)[:seq_length] > 0


@dataclass(frozen=True, eq=False)
class WindowExchange:
    """One rank's side of a sliding layer's exchange over its ring (members in ring order).

    `send_rows[j]`: indices into this rank's transported rows of those member `j`'s rows see, in position order;
    `receive_positions[j]`: the positions of the rows it gets from member `j`, in the order they arrive (position
    order). Its own entries are its own keys: one all-to-all over the ring then leaves every piece, its own
    included, in ring order, and the own piece is a local copy, never sent (`rows_sent`)."""

    send_rows: tuple
    receive_positions: tuple
    ring_rank: int

    @property
    def send_counts(self) -> list[int]:
        return [rows.numel() for rows in self.send_rows]

    @property
    def receive_counts(self) -> list[int]:
        return [positions.numel() for positions in self.receive_positions]

    @property
    def rows_sent(self) -> int:
        """Rows that leave this rank (its own piece stays)."""
        return sum(self.send_counts) - self.send_counts[self.ring_rank]

    @cached_property
    def outgoing(self) -> torch.Tensor:
        """The rows of every piece it gives, member by member: what one all-to-all takes (and its backward adds
        the returned gradients into)."""
        return torch.cat(self.send_rows)


def window_exchange(layout, documents, member_keys, device) -> WindowExchange:
    """The exchange of `layout`'s rank, whose ring members' keys are `member_keys[j] = (rows, positions)`: indices
    into member `j`'s transported rows of its clean rows, and their positions, in position order."""
    L, C = layout.seq_length, layout.clean_shards
    members = [layout.for_rank(layout.ring_index * C + j) for j in range(C)]
    seen = [seen_positions(*clean_key_ranges(member, documents), L) for member in members]
    me = layout.ring_rank
    own_rows, own_positions = member_keys[me]
    send = tuple(own_rows[seen[j][own_positions]].to(device) for j in range(C))
    receive = tuple(positions[seen[me][positions]] for _, positions in member_keys)
    return WindowExchange(send, receive, me)
