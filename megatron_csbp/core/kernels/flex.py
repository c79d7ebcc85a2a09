"""The GPU kernels: flex attention with block masks, one call per part; backward recomputes each part under
autograd (flex has no CPU backward)."""

import torch

from megatron_csbp.core.kernels.mask import bdlm_visible
from megatron_csbp.core.kernels.merge import accumulation_dtype, finite_lse

MASKED_TILE = 128  # flex attention's default block size (its BLOCK_SIZE): the masked part's tiles


class FlexKernels:
    """Flex attention (GPU): one call per part, hidden tiles skipped by its block mask.

    Query heads stay grouped under their K/V head (`enable_gqa`), so masks are `n × n_k`, built
    compiled (never a dense bool matrix) and cached: per shape for the block-diagonal part, per plan
    (one per layout, reused by every layer and the backward) for the prefix part and for the field's CP's
    masked call (the BDLM `mask_mod` of its rows and keys, tiles of `masked_tile`, flex's 128 by default).
    """

    RECOMPILE_LIMIT = 64  # forward and recompute graphs per part, shape and dtype

    def __init__(self, compile: bool = True, masked_tile: int = MASKED_TILE):
        self.masked_tile = masked_tile
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

    def _mask(self, mask_mod, n, n_keys, device, tile=None):
        size = {} if tile is None else {"BLOCK_SIZE": tile}
        return self._create_block_mask(mask_mod, None, None, n, n_keys, device=device, _compile=self._compile_masks,
                                       **size)

    def _block_diagonal_mask(self, q, k, block_size):
        key = (q.shape[3], k.shape[2], block_size, q.device)
        if key not in self._block_masks:
            def same_block(b, h, q_idx, kv_idx):
                return q_idx // block_size == kv_idx // block_size

            self._block_masks[key] = self._mask(same_block, q.shape[3], k.shape[2], q.device)
        return self._block_masks[key]

    def plan(self, query_limits, key_positions, query_starts=None):
        return FlexPrefixPlan(query_limits, key_positions, query_starts)

    def _prefix_mask(self, q, k, plan):
        if plan.block_mask is None:
            query_limits, key_positions = plan.query_limits, plan.key_positions

            def below_limit(b, h, q_idx, kv_idx):
                return key_positions[kv_idx] < query_limits[q_idx]

            mask_mod = below_limit
            if plan.query_starts is not None:
                query_starts = plan.query_starts

                def in_document_below_limit(b, h, q_idx, kv_idx):  # packed documents: [start, limit)
                    key = key_positions[kv_idx]
                    return (key < query_limits[q_idx]) & (key >= query_starts[q_idx])

                mask_mod = in_document_below_limit
            plan.block_mask = self._mask(mask_mod, q.shape[3], k.shape[2], q.device)
        return plan.block_mask

    def masked_plan(self, query_positions, query_clean, key_positions, key_clean, block_size,
                    query_documents=None, key_documents=None):
        return FlexMaskedPlan(query_positions, query_clean, key_positions, key_clean, block_size, self.masked_tile,
                              query_documents, key_documents)

    def _bdlm_mask(self, q, k, plan):
        """The BDLM mask of the plan's rows and keys as a block mask of `plan.tile` tiles: flex skips the tiles
        it hides, computes the others and masks the partly hidden ones element by element."""
        if plan.block_mask is None:
            qp, qc, block = plan.query_positions, plan.query_clean, plan.block_size
            kp, kc = plan.key_positions, plan.key_clean

            def bdlm(b, h, q_idx, kv_idx):
                return bdlm_visible(qp[q_idx], qc[q_idx], kp[kv_idx], kc[kv_idx], block)

            mask_mod = bdlm
            if plan.query_documents is not None:  # packed documents: and the same document
                qd, kd = plan.query_documents, plan.key_documents

                def bdlm_in_document(b, h, q_idx, kv_idx):
                    return bdlm(b, h, q_idx, kv_idx) & (qd[q_idx] == kd[kv_idx])

                mask_mod = bdlm_in_document
            plan.block_mask = self._mask(mask_mod, q.shape[3], k.shape[2], q.device, plan.tile)
        return plan.block_mask

    def masked_forward(self, q, k, v, plan, scale):
        out, lse = self._attend(q, k, v, scale, self._bdlm_mask(q, k, plan))
        return out.masked_fill(torch.isinf(lse).unsqueeze(-1), 0.0), lse

    def masked_backward(self, dout, q, k, v, out, lse, plan, scale):
        return self._recompute_backward(dout, q, k, v, out, lse, scale, self._bdlm_mask(q, k, plan))

    def _document_block_diagonal_mask(self, q, k, block_size, documents):
        """Blocks straddling documents: a noisy row sees its block's noisy rows of its own document (cached on
        `documents`, which the run's plan for these documents holds)."""
        key = ("flex", q.shape[3], k.shape[2], block_size, q.device)
        if key not in documents.masks:
            ids = documents.ids

            def same_block_and_document(b, h, q_idx, kv_idx):
                return (q_idx // block_size == kv_idx // block_size) & (ids[q_idx] == ids[kv_idx])

            documents.masks[key] = self._mask(same_block_and_document, q.shape[3], k.shape[2], q.device)
        return documents.masks[key]

    def block_diagonal_forward(self, q, k, v, block_size, scale, documents=None):
        if documents is not None:
            return self._attend(q, k, v, scale, self._document_block_diagonal_mask(q, k, block_size, documents))
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
            weight = torch.exp(visible_lse - finite_lse(lse).to(acc))
            weight = torch.where(torch.isinf(visible_lse), torch.zeros_like(weight), weight)
            grad_out = (weight.unsqueeze(-1) * dout.to(acc)).to(part_out.dtype)
            grad_lse = (weight * (dout.to(acc) * (part_out.detach().to(acc) - out.to(acc))).sum(-1)).to(part_lse.dtype)
            return torch.autograd.grad((part_out, part_lse), (q, k, v), (grad_out, grad_lse))

    def block_diagonal_backward(self, dout, q, k, v, out, lse, block_size, scale, documents=None):
        mask = (self._block_diagonal_mask(q, k, block_size) if documents is None
                else self._document_block_diagonal_mask(q, k, block_size, documents))
        return self._recompute_backward(dout, q, k, v, out, lse, scale, mask)

    def prefix_backward(self, dout, q, k, v, out, lse, plan, scale):
        return self._recompute_backward(dout, q, k, v, out, lse, scale, self._prefix_mask(q, k, plan))


class FlexPrefixPlan:
    """Flex's prefix plan: the limits and positions (and the document starts under packing), and the block mask
    once built for them."""

    def __init__(self, query_limits, key_positions, query_starts=None):
        self.query_limits, self.key_positions, self.block_mask = query_limits, key_positions, None
        self.query_starts = query_starts


class FlexMaskedPlan:
    """Flex's masked plan: the rows' and keys' positions and copies, the block size and tile, and the block mask
    once built for them."""

    def __init__(self, query_positions, query_clean, key_positions, key_clean, block_size, tile,
                 query_documents=None, key_documents=None):
        self.query_positions, self.query_clean = query_positions, query_clean
        self.query_documents, self.key_documents = query_documents, key_documents
        self.key_positions, self.key_clean = key_positions, key_clean
        self.block_size, self.tile, self.block_mask = block_size, tile, None
