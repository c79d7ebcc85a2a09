"""The two attention shapes a rank computes locally, on the CPU and on the GPU, with their LSE.

BDLM attention, seen from one rank, is a sum of two parts merged by log-sum-exp:
* block-diagonal: noisy rows attend to the noisy rows of their own block (all of them);
* prefix: any row attends to clean keys whose position is below the row's limit (`qb·B` for a noisy
  row of block `qb`, `(qb+1)·B` for a clean one). With keys sorted by position that is a prefix.

Tensors are `q [b, kv_heads, group, n, d]` (GQA query heads grouped under their K/V head, never
expanding K/V) and `k, v [b, kv_heads, n_k, d]`; outputs `o` like `q`, `lse [b, kv_heads, group, n]`.
Backward takes the FINAL merged output and LSE (the flash-attention identity), so each part's gradient
is exact on its own and the parts add.

CPU: torch's flash kernel (`_scaled_dot_product_flash_attention_for_cpu`, tiled, returns LSE).
The prefix part is cut into key tiles: rows whose visible keys end in tile `j` attend to tiles `< j`
unmasked and to tile `j` with a mask, so no hidden tile is ever computed and no fully hidden row is
passed to the kernel. GPU: flex attention with block masks; backward recomputes each part under
autograd (flex has no CPU backward).
"""

import math

import torch

_flash_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
DEFAULT_TILE = 512


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """LSEs and sums over parts are kept in at least fp32, whatever the inputs' precision."""
    return torch.promote_types(dtype, torch.float32)


def merge_partials(parts):
    """Online-softmax merge of partial `(o, lse)` results over disjoint key sets; rows nobody sees stay 0/-inf.

    The sum runs in at least fp32; the output keeps the parts' dtype, the LSE stays in fp32 (or fp64).
    """
    if len(parts) == 1:
        return parts[0]
    out_dtype, acc = parts[0][0].dtype, accumulation_dtype(parts[0][0].dtype)
    lse = torch.logsumexp(torch.stack([part_lse.to(acc) for _, part_lse in parts]), dim=0)
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    out = sum(part_out.to(acc) * torch.exp(part_lse.to(acc) - finite).unsqueeze(-1) for part_out, part_lse in parts)
    return out.to(out_dtype), lse


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
            self.groups.append((rows, lo, hi, visible_in_tile))
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


class CPUKernels:
    """Torch's CPU flash-attention kernel, used tile by tile."""

    def __init__(self, tile: int = DEFAULT_TILE):
        self.tile = tile

    def block_diagonal_forward(self, q, k, v, block_size, scale):
        out, lse = _flash_forward(_queries_by_block(q, block_size), _keys_by_block(k, block_size),
                                  _keys_by_block(v, block_size), scale=scale)
        return _queries_from_blocks(out, q.shape), _queries_from_blocks(lse.unsqueeze(-1), q.shape[:-1] + (1,))[..., 0]

    def block_diagonal_backward(self, dout, q, k, v, out, lse, block_size, scale):
        lse_blocks = _queries_by_block(lse.unsqueeze(-1), block_size)[..., 0]
        dq, dk, dv = _flash_backward(_queries_by_block(dout, block_size), _queries_by_block(q, block_size),
                                     _keys_by_block(k, block_size), _keys_by_block(v, block_size),
                                     _queries_by_block(out, block_size), lse_blocks, 0.0, False, scale=scale)
        return _queries_from_blocks(dq, q.shape), _keys_from_blocks(dk, k.shape), _keys_from_blocks(dv, k.shape)

    def plan(self, query_limits, key_positions):
        return PrefixPlan(query_limits, key_positions, self.tile)

    def prefix_forward(self, q, k, v, plan, scale):
        b, h, g, n, d = q.shape
        out = q.new_zeros(q.shape)
        lse = q.new_full(q.shape[:-1], float("-inf"), dtype=accumulation_dtype(q.dtype))
        for index, (rows, lo, hi, _) in enumerate(plan.groups):
            q_rows = _fold(q.index_select(3, rows))
            parts = [_flash_forward(q_rows, k[:, :, :lo], v[:, :, :lo], scale=scale)] if lo else []
            parts.append(_flash_forward(q_rows, k[:, :, lo:hi], v[:, :, lo:hi], scale=scale,
                                        attn_mask=plan.additive_mask(index, q.dtype, g)))
            rows_out, rows_lse = merge_partials(parts)
            out[:, :, :, rows] = rows_out.view(b, h, g, rows.numel(), d)
            lse[:, :, :, rows] = rows_lse.view(b, h, g, rows.numel())
        return out, lse

    def prefix_backward(self, dout, q, k, v, out, lse, plan, scale):
        b, h, g, n, d = q.shape
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


class FlexKernels:
    """Flex attention (GPU): one call per part, hidden tiles skipped by its block mask.

    Query heads stay grouped under their K/V head (`enable_gqa`), so masks are `n × n_k`, built
    compiled (never a dense bool matrix) and cached: per shape for the block-diagonal part, per plan
    (one per layout, reused by every layer and the backward) for the prefix part.
    """

    RECOMPILE_LIMIT = 64  # forward and recompute graphs per part, shape and dtype

    def __init__(self, compile: bool = True):
        from torch.nn.attention import flex_attention as flex

        if compile:
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, self.RECOMPILE_LIMIT)
        self._flex = torch.compile(flex.flex_attention, dynamic=False) if compile else flex.flex_attention
        self._create_block_mask = flex.create_block_mask
        self._compile_masks = compile
        self._aux = flex.AuxRequest(lse=True)
        self._block_masks = {}

    def _attend(self, q, k, v, scale, block_mask):
        b, h, g, n, d = q.shape
        out, aux = self._flex(q.reshape(b, h * g, n, d), k, v, block_mask=block_mask, scale=scale,
                              enable_gqa=True, return_aux=self._aux)
        return out.view(q.shape), aux.lse.view(q.shape[:-1])

    def _mask(self, mask_mod, n, n_keys, device):
        return self._create_block_mask(mask_mod, None, None, n, n_keys, device=device, _compile=self._compile_masks)

    def _block_diagonal_mask(self, q, k, block_size):
        key = (q.shape[3], k.shape[2], block_size, q.device)
        if key not in self._block_masks:
            def same_block(b, h, q_idx, kv_idx):
                return q_idx // block_size == kv_idx // block_size

            self._block_masks[key] = self._mask(same_block, q.shape[3], k.shape[2], q.device)
        return self._block_masks[key]

    def plan(self, query_limits, key_positions):
        return FlexPrefixPlan(query_limits, key_positions)

    def _prefix_mask(self, q, k, plan):
        if plan.block_mask is None:
            query_limits, key_positions = plan.query_limits, plan.key_positions

            def below_limit(b, h, q_idx, kv_idx):
                return key_positions[kv_idx] < query_limits[q_idx]

            plan.block_mask = self._mask(below_limit, q.shape[3], k.shape[2], q.device)
        return plan.block_mask

    def block_diagonal_forward(self, q, k, v, block_size, scale):
        return self._attend(q, k, v, scale, self._block_diagonal_mask(q, k, block_size))

    def prefix_forward(self, q, k, v, plan, scale):
        out, lse = self._attend(q, k, v, scale, self._prefix_mask(q, k, plan))
        hidden = torch.isinf(lse)
        return out.masked_fill(hidden.unsqueeze(-1), 0.0), lse

    def _recompute_backward(self, dout, q, k, v, out, lse, scale, block_mask):
        """Gradient of one part of a merged result: upstream `w·dO` on its output and `w·(dO·(o−O))` on its LSE."""
        with torch.enable_grad():
            q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
            part_out, part_lse = self._attend(q, k, v, scale, block_mask)
            acc = accumulation_dtype(q.dtype)
            visible_lse = part_lse.detach().to(acc)
            weight = torch.exp(visible_lse - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).to(acc))
            weight = torch.where(torch.isinf(visible_lse), torch.zeros_like(weight), weight)
            grad_out = (weight.unsqueeze(-1) * dout.to(acc)).to(part_out.dtype)
            grad_lse = (weight * (dout.to(acc) * (part_out.detach().to(acc) - out.to(acc))).sum(-1)).to(part_lse.dtype)
            return torch.autograd.grad((part_out, part_lse), (q, k, v), (grad_out, grad_lse))

    def block_diagonal_backward(self, dout, q, k, v, out, lse, block_size, scale):
        return self._recompute_backward(dout, q, k, v, out, lse, scale, self._block_diagonal_mask(q, k, block_size))

    def prefix_backward(self, dout, q, k, v, out, lse, plan, scale):
        return self._recompute_backward(dout, q, k, v, out, lse, scale, self._prefix_mask(q, k, plan))


class FlexPrefixPlan:
    """Flex's prefix plan: the limits and positions, and the block mask once built for them."""

    def __init__(self, query_limits, key_positions):
        self.query_limits, self.key_positions, self.block_mask = query_limits, key_positions, None


_kernels = {}


def default_kernels(device: torch.device):
    """Flex attention on an accelerator, the tiled CPU flash kernel on the CPU; one instance per kind."""
    kind = "cpu" if device.type == "cpu" else "flex"
    if kind not in _kernels:
        _kernels[kind] = CPUKernels() if kind == "cpu" else FlexKernels()
    return _kernels[kind]


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
