"""The CPU kernels: torch's flash kernel (`_scaled_dot_product_flash_attention_for_cpu`, tiled, returns LSE).

Every CPU plan is one shape (`_TilePlan`): groups of query rows, each with the key spans its rows attend to,
a span wholly visible (computed unmasked) or partly visible (computed with its mask). One loop runs them all
(`_tiles_forward`, `_tiles_backward`); the plans differ only in how they cut rows and keys:

* The prefix part is cut into key tiles (`PrefixPlan`): rows whose visible keys end in tile `j` attend to
  tiles `< j` unmasked and to tile `j` with a mask, so no hidden tile is ever computed and no fully hidden
  row is passed to the kernel. The plan holds that cut, once per (rows, keys).
* Packed documents (`RangePlan`): each row's keys are a range, so its first and last tiles are masked, the
  tiles between them whole and other documents' tiles never computed.
* The masked part (the field's conventional CP: one call over a rank's rows against any keys under the BDLM
  mask) has flex attention's semantics: `MaskedPlan` cuts rows and keys into `masked_tile` tiles (flex's 128
  by default), skips the key tiles a query tile cannot see, computes wholly visible ones unmasked and partly
  visible ones with their mask, so its computed pairs are what flex with a block mask computes.

The block-diagonal part runs every block as a separate batch entry of one kernel call.
"""

import torch

from megatron_csbp.core.clean_attention import BLOCK_CAUSAL
from megatron_csbp.core.windows import GLOBAL
from megatron_csbp.core.kernels.mask import bdlm_visible
from megatron_csbp.core.kernels.merge import accumulation_dtype, finite_lse, merge_into, running_merge

_flash_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
DEFAULT_TILE = 512
MASKED_TILE = 128  # flex attention's default block size: the masked kernel's tiles are flex's


def _fold(q):
    """`[b, h, g, n, d]` -> `[b, h, g·n, d]`: a group's query heads become extra rows of its K/V head."""
    b, h, g, n, d = q.shape
    return q.reshape(b, h, g * n, d)


def _queries_by_block(x, block_size):
    """`[b, h, g, nb·B, d]` -> `[b·nb, h, g·B, d]`: each block a separate attention problem."""
    b, h, g, n, d = x.shape
    nb = n // block_size
    return x.reshape(b, h, g, nb, block_size, d).permute(0, 3, 1, 2, 4, 5).reshape(b * nb, h, g * block_size, d)


def _queries_from_blocks(x, shape):
    b, h, g, n, d = shape
    block = x.shape[2] // g
    return x.reshape(b, n // block, h, g, block, d).permute(0, 2, 3, 1, 4, 5).reshape(shape)


def _keys_by_block(x, block_size):
    b, h, n, d = x.shape
    return x.reshape(b, h, n // block_size, block_size, d).transpose(1, 2).reshape(-1, h, block_size, d)


def _keys_from_blocks(x, shape):
    b, h, n, d = shape
    return x.reshape(b, n // x.shape[2], h, x.shape[2], d).transpose(1, 2).reshape(shape)


def _size(index) -> int:
    """How many rows or keys `index` picks: a `slice(start, stop)` or an index tensor."""
    return index.stop - index.start if isinstance(index, slice) else index.numel()


def _take(x, dim, index):
    """`x`'s entries `index` along `dim`: a view for a slice, a copy for an index tensor."""
    if isinstance(index, slice):
        return x.narrow(dim, index.start, index.stop - index.start)
    return x.index_select(dim, index)


def _add_at(total, dim, index, part):
    """`total[index] += part` along `dim` (`total` in the accumulation dtype)."""
    if isinstance(index, slice):
        total.narrow(dim, index.start, index.stop - index.start).add_(part)
    else:
        total.index_add_(dim, index, part.to(total.dtype))


class _TilePlan:
    """Row groups, each with the key spans its rows attend to: `groups` holds `(rows, spans)`, `rows` a slice or
    an index tensor of query rows, a span `(keys, visible)` with `keys` a slice or an index tensor of keys and
    `visible` the `[rows, keys]` mask of a partly visible span (None: wholly visible, computed unmasked). A
    group's spans are disjoint and its rows are no other group's, so parts merge by LSE and gradients add."""

    blind_rows = False  # may a masked span hide all its keys from some rows? (prefix and range plans: never)

    def __init__(self, groups):
        self.groups = groups
        self._masks = {}

    def additive_mask(self, group_index, span_index, dtype, query_group):
        """One span's mask as the flash kernel takes it, and (plans with `blind_rows`) the folded rows that see
        none of its keys, whose LSE the kernel gives as 0, not -inf: (None, None) for a whole span.
        Built once per plan and shared by every layer and the backward."""
        visible = self.groups[group_index][1][span_index][1]
        if visible is None:
            return None, None
        key = (group_index, span_index, dtype, query_group)
        if key not in self._masks:
            mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
            self._masks[key] = (mask.masked_fill(~visible, float("-inf")).repeat(query_group, 1),
                                ~visible.any(1).repeat(query_group) if self.blind_rows else None)
        return self._masks[key]

    @property
    def pairs(self) -> int:
        """Query-key pairs the plan computes (per head and sample), counting the tile padding."""
        return sum(_size(rows) * _size(keys) for rows, spans in self.groups for keys, _ in spans)

    def work(self) -> tuple[int, int]:
        """(real, computed) query-key pairs per head and sample, read off the plan's spans and masks."""
        real = sum(_size(rows) * _size(keys) if visible is None else int(visible.sum())
                   for rows, spans in self.groups for keys, visible in spans)
        return real, self.pairs


class PrefixPlan(_TilePlan):
    """Which query rows attend to which key tiles; built once per layout and shared by every layer and the
    backward, with the masks of the partly visible tiles. A group's spans: its last tile, masked, then the
    whole tiles below it in one span."""

    def __init__(self, query_limits, key_positions, tile):
        visible = torch.searchsorted(key_positions, query_limits)  # keys with position < limit
        last_tile = torch.div(visible - 1, tile, rounding_mode="floor")
        groups = []
        for j in torch.unique(last_tile[visible > 0]).tolist():
            rows = torch.nonzero(last_tile == j).flatten().to(query_limits.device)
            lo, hi = j * tile, min((j + 1) * tile, key_positions.numel())
            visible_in_tile = key_positions[lo:hi].unsqueeze(0) < query_limits[rows].unsqueeze(1)
            below = [(slice(0, lo), None)] if lo else []
            for start in range(0, rows.numel(), tile):  # query tiles: one call's temporaries stay bounded
                chunk = rows[start:start + tile]
                groups.append((chunk, [(slice(lo, hi), visible_in_tile[start:start + tile])] + below))
        super().__init__(groups)


class RangePlan(_TilePlan):
    """Packed documents: row `i` attends to the keys whose position lies in `[query_starts[i], query_limits[i])`
    (its document's clean keys below its limit). Rows are grouped by the key tiles their range begins and
    ends in: those two tiles are masked, the tiles between them are whole, the tiles outside (other
    documents) are never computed. Rows that see no key are left out (zero output, LSE -inf)."""

    def __init__(self, query_starts, query_limits, key_positions, tile):
        first = torch.searchsorted(key_positions, query_starts)
        stop = torch.searchsorted(key_positions, query_limits)
        seen = stop > first
        first_tile = torch.div(first, tile, rounding_mode="floor")
        last_tile = torch.div(stop - 1, tile, rounding_mode="floor")
        n_keys = key_positions.numel()
        groups = []
        pairs = torch.stack([first_tile[seen], last_tile[seen]], dim=1)
        for f, j in torch.unique(pairs, dim=0).tolist() if pairs.numel() else []:
            rows = torch.nonzero(seen & (first_tile == f) & (last_tile == j)).flatten().to(query_limits.device)
            edges = [(f * tile, min((f + 1) * tile, n_keys))]
            if j > f + 1:
                edges.append(((f + 1) * tile, j * tile))
            if j > f:
                edges.append((j * tile, min((j + 1) * tile, n_keys)))
            for start in range(0, rows.numel(), tile):  # query tiles: one call's temporaries stay bounded
                chunk = rows[start:start + tile]
                spans = []
                for lo, hi in edges:
                    index = torch.arange(lo, hi, device=chunk.device).unsqueeze(0)
                    visible = (index >= first[chunk].unsqueeze(1)) & (index < stop[chunk].unsqueeze(1))
                    spans.append((slice(lo, hi), None if bool(visible.all()) else visible))
                groups.append((chunk, spans))
        super().__init__(groups)


class MaskedPlan(_TilePlan):
    """Flex attention's semantics on the CPU: rows and keys cut into `tile`-sized tiles; per query tile, key
    tiles the mask hides entirely are skipped, wholly visible ones are computed unmasked (contiguous runs of
    them, one kernel call each) and partly visible ones are computed together with their mask.

    Built once per (rows, keys) from the BDLM mask (`mask.bdlm_visible`, in the layer's `window`), one query tile at
    a time, so no `[rows, keys]` table is ever held; it keeps only the partial tiles' masks. Packed documents (each
    row's and key's document index): the mask is intersected with "same document". Every query tile is a group
    (its row groups, as `PrefixPlan` calls them), those that see nothing with no span.
    """

    blind_rows = True  # a partial span's keys may all be hidden from some rows of the query tile

    def __init__(self, query_positions, query_clean, key_positions, key_clean, block_size, tile,
                 query_documents=None, key_documents=None, clean_attention=BLOCK_CAUSAL, window=GLOBAL):
        n, m = query_positions.numel(), key_positions.numel()
        starts = torch.arange(0, m, tile)
        widths, key_tile = torch.clamp(m - starts, max=tile), torch.arange(m) // tile
        groups = []
        for lo in range(0, n, tile):
            hi = min(lo + tile, n)
            visible = bdlm_visible(query_positions[lo:hi, None], query_clean[lo:hi, None],
                                   key_positions[None], key_clean[None], block_size, clean_attention, window)
            if query_documents is not None:
                visible = visible & (query_documents[lo:hi, None] == key_documents[None])
            per_tile = torch.zeros(starts.numel(), dtype=torch.long).index_add_(0, key_tile, visible.sum(0).cpu())
            full = per_tile == widths * (hi - lo)
            partial = (per_tile > 0) & ~full
            spans = [(slice(first * tile, min((last + 1) * tile, m)), None)
                     for first, last in _runs(torch.nonzero(full).flatten().tolist())]
            partial_tiles = torch.nonzero(partial).flatten().tolist()
            if partial_tiles:  # one span, one masked call
                keys = torch.cat([torch.arange(j * tile, min((j + 1) * tile, m)) for j in partial_tiles])
                spans.append((keys.to(query_positions.device), visible[:, keys.to(visible.device)]))
            groups.append((slice(lo, hi), spans))
        super().__init__(groups)


def _runs(indices):
    """Sorted integers -> [(first, last)] of their runs of consecutive values."""
    runs = []
    for i in indices:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return [tuple(run) for run in runs]


def _tiles_forward(q, k, v, plan, scale):
    """Each group's spans, one kernel call each, merged by LSE into the group's rows (the first span's fresh
    output is the running result, summed into in place); rows no span reaches keep a zero output and LSE -inf."""
    b, h, g, n, d = q.shape
    out = q.new_zeros(q.shape)
    lse = q.new_full(q.shape[:-1], float("-inf"), dtype=accumulation_dtype(q.dtype))
    for index, (rows, spans) in enumerate(plan.groups):
        q_rows, running = _fold(_take(q, 3, rows)), None
        for span_index, (keys, _) in enumerate(spans):
            mask, unseen = plan.additive_mask(index, span_index, q.dtype, g)
            part = _flash_forward(q_rows, _take(k, 2, keys), _take(v, 2, keys), scale=scale, attn_mask=mask)[:2]
            if unseen is not None:
                part = (part[0], part[1].masked_fill(unseen, float("-inf")))
            running = running_merge(part) if running is None else merge_into(running, part)
        if running is not None:
            out[:, :, :, rows] = running[0].view(b, h, g, _size(rows), d).to(out.dtype)
            lse[:, :, :, rows] = running[1].view(b, h, g, _size(rows))
    return out, lse


def _tiles_backward(dout, q, k, v, out, lse, plan, scale):
    """Each span's gradient against the FINAL output and LSE (the flash identity), so spans and groups add."""
    b, h, g, n, d = q.shape
    acc = accumulation_dtype(q.dtype)
    dq, dk, dv = (torch.zeros_like(x, dtype=acc) for x in (q, k, v))
    for index, (rows, spans) in enumerate(plan.groups):
        if not spans:
            continue
        picked = [_fold(_take(x, 3, rows)) for x in (dout, q, out)]
        rows_lse = finite_lse(_take(lse, 3, rows)).reshape(b, h, -1)
        rows_dq = 0
        for span_index, (keys, _) in enumerate(spans):
            mask, _ = plan.additive_mask(index, span_index, q.dtype, g)
            part_dq, part_dk, part_dv = _flash_backward(picked[0], picked[1], _take(k, 2, keys), _take(v, 2, keys),
                                                        picked[2], rows_lse, 0.0, False, attn_mask=mask, scale=scale)
            rows_dq = rows_dq + part_dq
            _add_at(dk, 2, keys, part_dk)
            _add_at(dv, 2, keys, part_dv)
        _add_at(dq, 3, rows, rows_dq.view(b, h, g, _size(rows), d))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class CPUKernels:
    """Torch's CPU flash-attention kernel, used tile by tile."""

    def __init__(self, tile: int = DEFAULT_TILE, masked_tile: int = MASKED_TILE):
        self.tile, self.masked_tile = tile, masked_tile

    def block_diagonal_forward(self, q, k, v, block_size, scale, documents=None):
        mask = (None if documents is None
                else block_diagonal_mask(documents, block_size, q.shape[2], q.shape[0], q.dtype))
        out, lse = _flash_forward(_queries_by_block(q, block_size), _keys_by_block(k, block_size),
                                  _keys_by_block(v, block_size), scale=scale, attn_mask=mask)
        return _queries_from_blocks(out, q.shape), _queries_from_blocks(lse.unsqueeze(-1), q.shape[:-1] + (1,))[..., 0]

    def block_diagonal_backward(self, dout, q, k, v, out, lse, block_size, scale, documents=None):
        mask = (None if documents is None
                else block_diagonal_mask(documents, block_size, q.shape[2], q.shape[0], q.dtype))
        lse_blocks = _queries_by_block(lse.unsqueeze(-1), block_size)[..., 0]
        dq, dk, dv = _flash_backward(_queries_by_block(dout, block_size), _queries_by_block(q, block_size),
                                     _keys_by_block(k, block_size), _keys_by_block(v, block_size),
                                     _queries_by_block(out, block_size), lse_blocks, 0.0, False, attn_mask=mask,
                                     scale=scale)
        return _queries_from_blocks(dq, q.shape), _keys_from_blocks(dk, k.shape), _keys_from_blocks(dv, k.shape)

    def plan(self, query_limits, key_positions, query_starts=None):
        """The prefix plan; with `query_starts` (packed documents) a `RangePlan` of keys in `[start, limit)`."""
        if query_starts is not None:
            return RangePlan(query_starts, query_limits, key_positions, self.tile)
        return PrefixPlan(query_limits, key_positions, self.tile)

    def masked_plan(self, query_positions, query_clean, key_positions, key_clean, block_size,
                    query_documents=None, key_documents=None, clean_attention=BLOCK_CAUSAL, window=GLOBAL):
        return MaskedPlan(query_positions, query_clean, key_positions, key_clean, block_size, self.masked_tile,
                          query_documents, key_documents, clean_attention, window)

    def masked_forward(self, q, k, v, plan, scale):
        return _tiles_forward(q, k, v, plan, scale)

    def masked_backward(self, dout, q, k, v, out, lse, plan, scale):
        return _tiles_backward(dout, q, k, v, out, lse, plan, scale)

    def prefix_forward(self, q, k, v, plan, scale):
        return _tiles_forward(q, *_prefix_keys(k, v, plan), plan, scale)

    def prefix_backward(self, dout, q, k, v, out, lse, plan, scale):
        return _tiles_backward(dout, q, *_prefix_keys(k, v, plan), out, lse, plan, scale)


def _prefix_keys(k, v, plan):
    """K/V for a `PrefixPlan`'s calls with their rows adjacent: its tiles read ~7% faster (docs/performance.md)."""
    return (k.contiguous(), v.contiguous()) if isinstance(plan, PrefixPlan) else (k, v)


def block_diagonal_mask(documents, block_size, query_group, batch, dtype):
    """Additive mask of the block-diagonal part when blocks straddle documents: a noisy row sees the noisy rows
    of its block in its own document. `documents.ids`: the document of each noisy row; cached on it."""
    key = ("cpu", block_size, query_group, batch, dtype)
    if key not in documents.masks:
        ids = documents.ids.view(-1, block_size)
        same = ids.unsqueeze(2) == ids.unsqueeze(1)  # [nb, B, B]
        mask = torch.zeros(same.shape, dtype=dtype, device=same.device).masked_fill(~same, float("-inf"))
        mask = mask.repeat(1, query_group, 1).unsqueeze(1).repeat(batch, 1, 1, 1)  # [b·nb, 1, g·B, B]
        documents.masks[key] = mask
    return documents.masks[key]
