"""The CPU kernels: torch's flash kernel (`_scaled_dot_product_flash_attention_for_cpu`, tiled, returns LSE).

The masked part (the field's conventional CP: one call over a rank's rows against any keys under the BDLM
mask) has flex attention's semantics: `MaskedPlan` cuts rows and keys into `masked_tile` tiles (flex's 128
by default), skips the key tiles a query tile cannot see, computes wholly visible ones unmasked and partly
visible ones with their mask, so its computed pairs are what flex with a block mask computes.

The prefix part is cut into key tiles: rows whose visible keys end in tile `j` attend to tiles `< j`
unmasked and to tile `j` with a mask, so no hidden tile is ever computed and no fully hidden row is
passed to the kernel. `PrefixPlan` holds that cut, once per (rows, keys). The block-diagonal part runs
every block as a separate batch entry of one kernel call.
"""

import torch

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


class PrefixPlan:
    """Which query rows attend to which key tiles; built once per layout and shared by every layer and the
    backward, with the masks of the partly visible tiles."""

    def __init__(self, query_limits, key_positions, tile):
        visible = torch.searchsorted(key_positions, query_limits)  # keys with position < limit
        last_tile = torch.div(visible - 1, tile, rounding_mode="floor")
        self.groups = []
        for j in torch.unique(last_tile[visible > 0]).tolist():
            rows = torch.nonzero(last_tile == j).flatten().to(query_limits.device)
            lo, hi = j * tile, min((j + 1) * tile, key_positions.numel())
            visible_in_tile = key_positions[lo:hi].unsqueeze(0) < query_limits[rows].unsqueeze(1)
            for start in range(0, rows.numel(), tile):  # query tiles: one call's temporaries stay bounded
                self.groups.append((rows[start:start + tile], lo, hi, visible_in_tile[start:start + tile]))
        self._masks = {}

    def additive_mask(self, group_index, dtype, query_group):
        """Group `group_index`'s mask for its last key tile, as the flash kernel takes it; built once per plan."""
        key = (group_index, dtype, query_group)
        if key not in self._masks:
            visible = self.groups[group_index][3]
            mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
            self._masks[key] = mask.masked_fill(~visible, float("-inf")).repeat(query_group, 1)
        return self._masks[key]

    @property
    def pairs(self) -> int:
        """Query-key pairs the plan computes (per head and sample), counting the tile padding."""
        return sum(rows.numel() * hi for rows, lo, hi, _ in self.groups)

    def work(self) -> tuple[int, int]:
        """(real, computed) query-key pairs per head and sample, read off the plan's row groups and masks."""
        return sum(rows.numel() * lo + int(visible.sum()) for rows, lo, hi, visible in self.groups), self.pairs


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
                    query_documents=None, key_documents=None):
        return MaskedPlan(query_positions, query_clean, key_positions, key_clean, block_size, self.masked_tile,
                          query_documents, key_documents)

    def masked_forward(self, q, k, v, plan, scale):
        return _masked_forward(q, k, v, plan, scale)

    def masked_backward(self, dout, q, k, v, out, lse, plan, scale):
        return _masked_backward(dout, q, k, v, out, lse, plan, scale)

    def prefix_forward(self, q, k, v, plan, scale):
        if isinstance(plan, RangePlan):
            return range_forward(q, k, v, plan, scale)
        b, h, g, n, d = q.shape
        k, v = k.contiguous(), v.contiguous()  # key rows adjacent: the kernel's tiles read ~7% faster (docs/performance.md)
        out = q.new_zeros(q.shape)
        lse = q.new_full(q.shape[:-1], float("-inf"), dtype=accumulation_dtype(q.dtype))
        for index, (rows, lo, hi, _) in enumerate(plan.groups):
            q_rows = _fold(q.index_select(3, rows))
            tile_part = _flash_forward(q_rows, k[:, :, lo:hi], v[:, :, lo:hi], scale=scale,
                                       attn_mask=plan.additive_mask(index, q.dtype, g))[:2]
            rows_out, rows_lse = running_merge(tile_part)  # the kernel's fresh output, summed into in place
            if lo:
                unmasked = _flash_forward(q_rows, k[:, :, :lo], v[:, :, :lo], scale=scale)
                merge_into((rows_out, rows_lse), unmasked[:2])
            out[:, :, :, rows] = rows_out.view(b, h, g, rows.numel(), d).to(out.dtype)
            lse[:, :, :, rows] = rows_lse.view(b, h, g, rows.numel())
        return out, lse

    def prefix_backward(self, dout, q, k, v, out, lse, plan, scale):
        if isinstance(plan, RangePlan):
            return range_backward(dout, q, k, v, out, lse, plan, scale)
        b, h, g, n, d = q.shape
        k, v = k.contiguous(), v.contiguous()
        acc = accumulation_dtype(q.dtype)
        dq, dk, dv = (torch.zeros_like(x, dtype=acc) for x in (q, k, v))
        for index, (rows, lo, hi, _) in enumerate(plan.groups):
            picked = [_fold(x.index_select(3, rows)) for x in (dout, q, out)]
            rows_lse = lse.index_select(3, rows).reshape(b, h, -1)
            rows_dq = 0
            spans = ([(0, lo, None)] if lo else []) + [(lo, hi, plan.additive_mask(index, q.dtype, g))]
            for start, stop, mask in spans:
                part_dq, part_dk, part_dv = _flash_backward(
                    picked[0], picked[1], k[:, :, start:stop], v[:, :, start:stop], picked[2], rows_lse,
                    0.0, False, attn_mask=mask, scale=scale)
                rows_dq = rows_dq + part_dq
                dk[:, :, start:stop] += part_dk
                dv[:, :, start:stop] += part_dv
            dq.index_add_(3, rows, rows_dq.view(b, h, g, rows.numel(), d).to(acc))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class MaskedPlan:
    """Flex attention's semantics on the CPU: rows and keys cut into `tile`-sized tiles; per query tile, key
    tiles the mask hides entirely are skipped, wholly visible ones are computed unmasked (contiguous runs of
    them, one kernel call each) and partly visible ones are computed together with their mask.

    Built once per (rows, keys) from the BDLM mask (`mask.bdlm_visible`), one query tile at a time, so no
    `[rows, keys]` table is ever held; it keeps only the partial tiles' masks. Packed documents (each row's
    and key's document index): the mask is intersected with "same document".
    """

    def __init__(self, query_positions, query_clean, key_positions, key_clean, block_size, tile,
                 query_documents=None, key_documents=None):
        self.tile, n, m = tile, query_positions.numel(), key_positions.numel()
        starts = torch.arange(0, m, tile)
        widths, key_tile = torch.clamp(m - starts, max=tile), torch.arange(m) // tile
        self.tiles = []  # per query tile: (row start, row stop, full key runs, partial key indices, partial mask)
        for lo in range(0, n, tile):
            hi = min(lo + tile, n)
            visible = bdlm_visible(query_positions[lo:hi, None], query_clean[lo:hi, None],
                                   key_positions[None], key_clean[None], block_size)
            if query_documents is not None:
                visible = visible & (query_documents[lo:hi, None] == key_documents[None])
            per_tile = torch.zeros(starts.numel(), dtype=torch.long).index_add_(0, key_tile, visible.sum(0).cpu())
            full = per_tile == widths * (hi - lo)
            partial = (per_tile > 0) & ~full
            runs = _runs(torch.nonzero(full).flatten().tolist())
            full_runs = [(first * tile, min((last + 1) * tile, m)) for first, last in runs]
            keys = torch.cat([torch.arange(j * tile, min((j + 1) * tile, m))
                              for j in torch.nonzero(partial).flatten().tolist()] or [torch.empty(0, dtype=torch.long)])
            self.tiles.append((lo, hi, full_runs, keys.to(query_positions.device),
                               visible[:, keys.to(visible.device)] if keys.numel() else None))
        self._masks = {}

    @property
    def groups(self):
        """The plan's query tiles (its row groups, as `PrefixPlan` calls them)."""
        return self.tiles

    def additive_mask(self, index, dtype, query_group):
        """Query tile `index`'s mask over its partial key tiles, as the flash kernel takes it; built once per plan."""
        key = (index, dtype, query_group)
        if key not in self._masks:
            visible = self.tiles[index][4]
            mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
            self._masks[key] = mask.masked_fill(~visible, float("-inf")).repeat(query_group, 1)
        return self._masks[key]

    def work(self) -> tuple[int, int]:
        """(real, computed) query-key pairs per head and sample, read off the plan's tiles and masks."""
        real = computed = 0
        for lo, hi, full_runs, keys, visible in self.tiles:
            full = sum(stop - start for start, stop in full_runs)
            computed += (hi - lo) * (full + keys.numel())
            real += (hi - lo) * full + (int(visible.sum()) if visible is not None else 0)
        return real, computed


def _runs(indices):
    """Sorted integers -> [(first, last)] of their runs of consecutive values."""
    runs = []
    for i in indices:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return [tuple(run) for run in runs]


def _masked_forward(q, k, v, plan, scale):
    b, h, g, n, d = q.shape
    out = q.new_zeros(q.shape)
    lse = q.new_full(q.shape[:-1], float("-inf"), dtype=accumulation_dtype(q.dtype))
    for index, (lo, hi, full_runs, keys, visible) in enumerate(plan.tiles):
        q_rows, running = _fold(q[:, :, :, lo:hi]), None
        parts = [(start, stop, None) for start, stop in full_runs] + ([(None, None, index)] if keys.numel() else [])
        for start, stop, masked in parts:
            if masked is None:
                part = _flash_forward(q_rows, k[:, :, start:stop], v[:, :, start:stop], scale=scale)[:2]
            else:
                part = _flash_forward(q_rows, k.index_select(2, keys), v.index_select(2, keys), scale=scale,
                                      attn_mask=plan.additive_mask(index, q.dtype, g))[:2]
                seen = visible.any(1).repeat(g)  # the kernel gives rows it sees nothing of LSE 0: make it -inf
                part = (part[0], part[1].masked_fill(~seen, float("-inf")))
            running = running_merge(part) if running is None else merge_into(running, part)
        if running is not None:
            out[:, :, :, lo:hi] = running[0].view(b, h, g, hi - lo, d).to(out.dtype)
            lse[:, :, :, lo:hi] = running[1].view(b, h, g, hi - lo)
    return out, lse


def _masked_backward(dout, q, k, v, out, lse, plan, scale):
    """Each tile's gradient against the FINAL output and LSE (the flash identity), so parts and tiles add."""
    b, h, g, n, d = q.shape
    acc = accumulation_dtype(q.dtype)
    dq, dk, dv = (torch.zeros_like(x, dtype=acc) for x in (q, k, v))
    for index, (lo, hi, full_runs, keys, _) in enumerate(plan.tiles):
        picked = [_fold(x[:, :, :, lo:hi]) for x in (dout, q, out)]
        rows_lse = finite_lse(lse[:, :, :, lo:hi]).reshape(b, h, -1)
        rows_dq = 0
        for start, stop in full_runs:
            part_dq, part_dk, part_dv = _flash_backward(picked[0], picked[1], k[:, :, start:stop], v[:, :, start:stop],
                                                        picked[2], rows_lse, 0.0, False, scale=scale)
            rows_dq = rows_dq + part_dq
            dk[:, :, start:stop] += part_dk
            dv[:, :, start:stop] += part_dv
        if keys.numel():
            part_dq, part_dk, part_dv = _flash_backward(
                picked[0], picked[1], k.index_select(2, keys), v.index_select(2, keys), picked[2], rows_lse, 0.0,
                False, attn_mask=plan.additive_mask(index, q.dtype, g), scale=scale)
            rows_dq = rows_dq + part_dq
            dk.index_add_(2, keys, part_dk.to(acc))
            dv.index_add_(2, keys, part_dv.to(acc))
        if torch.is_tensor(rows_dq):
            dq[:, :, :, lo:hi] += rows_dq.view(b, h, g, hi - lo, d).to(acc)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class RangePlan:
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
        self.groups = []  # (rows, ((lo, hi, visible [rows, hi-lo] or None), ...))
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
                    index = torch.arange(lo, hi, device=chunk.device)
                    index = index.unsqueeze(0)
                    visible = (index >= first[chunk].unsqueeze(1)) & (index < stop[chunk].unsqueeze(1))
                    spans.append((lo, hi, None if bool(visible.all()) else visible))
                self.groups.append((chunk, tuple(spans)))
        self._masks = {}

    def additive_mask(self, group_index, span_index, dtype, query_group):
        """The flash kernel's mask of one span of a group (None where the span is wholly visible); built once."""
        visible = self.groups[group_index][1][span_index][2]
        if visible is None:
            return None
        key = (group_index, span_index, dtype, query_group)
        if key not in self._masks:
            mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
            self._masks[key] = mask.masked_fill(~visible, float("-inf")).repeat(query_group, 1)
        return self._masks[key]

    @property
    def pairs(self) -> int:
        """Query-key pairs the plan computes (per head and sample), counting the tile padding."""
        return sum(rows.numel() * (hi - lo) for rows, spans in self.groups for lo, hi, _ in spans)

    def work(self) -> tuple[int, int]:
        """(real, computed) query-key pairs per head and sample, read off the plan's spans and masks."""
        real = sum(rows.numel() * (hi - lo) if visible is None else int(visible.sum())
                   for rows, spans in self.groups for lo, hi, visible in spans)
        return real, self.pairs


def range_forward(q, k, v, plan, scale):
    """`prefix_forward` for a `RangePlan`: each group's spans merged by LSE."""
    b, h, g, n, d = q.shape
    out = q.new_zeros(q.shape)
    lse = q.new_full(q.shape[:-1], float("-inf"), dtype=accumulation_dtype(q.dtype))
    for index, (rows, spans) in enumerate(plan.groups):
        q_rows = _fold(q.index_select(3, rows))
        running = None
        for span_index, (lo, hi, _) in enumerate(spans):
            part = _flash_forward(q_rows, k[:, :, lo:hi], v[:, :, lo:hi], scale=scale,
                                  attn_mask=plan.additive_mask(index, span_index, q.dtype, g))[:2]
            running = running_merge(part) if running is None else merge_into(running, part)
        rows_out, rows_lse = running
        out[:, :, :, rows] = rows_out.view(b, h, g, rows.numel(), d).to(out.dtype)
        lse[:, :, :, rows] = rows_lse.view(b, h, g, rows.numel())
    return out, lse


def range_backward(dout, q, k, v, out, lse, plan, scale):
    """`prefix_backward` for a `RangePlan` (final merged `out` and `lse`: each span's gradient is exact alone)."""
    b, h, g, n, d = q.shape
    acc = accumulation_dtype(q.dtype)
    dq, dk, dv = (torch.zeros_like(x, dtype=acc) for x in (q, k, v))
    for index, (rows, spans) in enumerate(plan.groups):
        picked = [_fold(x.index_select(3, rows)) for x in (dout, q, out)]
        rows_lse = lse.index_select(3, rows).reshape(b, h, -1)
        rows_dq = 0
        for span_index, (lo, hi, _) in enumerate(spans):
            part_dq, part_dk, part_dv = _flash_backward(
                picked[0], picked[1], k[:, :, lo:hi], v[:, :, lo:hi], picked[2], rows_lse, 0.0, False,
                attn_mask=plan.additive_mask(index, span_index, q.dtype, g), scale=scale)
            rows_dq = rows_dq + part_dq
            dk[:, :, lo:hi] += part_dk
            dv[:, :, lo:hi] += part_dv
        dq.index_add_(3, rows, rows_dq.view(b, h, g, rows.numel(), d).to(acc))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


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
