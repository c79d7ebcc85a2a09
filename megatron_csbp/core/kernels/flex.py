"""The GPU kernels: flex attention, one call per part; backward recomputes each part under autograd (flex has no
CPU backward). The masked parts (clean prefix, the field's CP's BDLM mask) take block masks; the block-diagonal
part, the blocks as a batch of dense problems, takes none: the decomposition leaves nothing there to mask."""

import torch

from megatron_csbp.core.clean_attention import BLOCK_CAUSAL
from megatron_csbp.core.windows import GLOBAL
from megatron_csbp.core.kernels.mask import bdlm_visible
from megatron_csbp.core.kernels.merge import accumulation_dtype, finite_lse

MASKED_TILE = 128  # flex attention's default block size (its BLOCK_SIZE): the masked part's tiles


class FlexKernels:
    """Flex attention (GPU): one call per part, hidden tiles skipped by its block mask, the block-diagonal part
    unmasked (each block of noisy rows its own batch entry; a block mask only where packed documents cut a block).

    Query heads stay grouped under their K/V head (`enable_gqa`), so masks are `n × n_k`, built
    compiled (never a dense bool matrix) and cached: per shape for blocks cut by packed documents, per plan
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

    def _attend(self, q, k, v, scale, block_mask):
        b, h, g, n, d = q.shape
        out, aux = self._flex(q.reshape(b, h * g, n, d), k, v, block_mask=block_mask, scale=scale,
                              enable_gqa=True, return_aux=self._aux)
        return out.view(q.shape), aux.lse.view(q.shape[:-1])

    def _attend_blocks(self, q, k, v, scale, block_size):
        """Each block's rows against its own keys, unmasked: `[b, h, g, nb·B, d]` as `nb·b` problems of `B` rows."""
        b, h, g, n, d = q.shape
        blocks = n // block_size
        q_blocks = q.reshape(b, h, g, blocks, block_size, d).permute(0, 3, 1, 2, 4, 5).reshape(
            b * blocks, h, g, block_size, d)
        k_blocks, v_blocks = (x.reshape(b, h, blocks, block_size, d).transpose(1, 2).reshape(
            b * blocks, h, block_size, d) for x in (k, v))
        out, lse = self._attend(q_blocks, k_blocks, v_blocks, scale, None)
        out = out.reshape(b, blocks, h, g, block_size, d).permute(0, 2, 3, 1, 4, 5).reshape(q.shape)
        lse = lse.reshape(b, blocks, h, g, block_size).permute(0, 2, 3, 1, 4).reshape(q.shape[:-1])
        return out, lse

    def _mask(self, mask_mod, n, n_keys, device, tile=None):
        size = {} if tile is None else {"BLOCK_SIZE": tile}
        return self._create_block_mask(mask_mod, None, None, n, n_keys, device=device, _compile=self._compile_masks,
                                       **size)

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
                    query_documents=None, key_documents=None, clean_attention=BLOCK_CAUSAL, window=GLOBAL):
        return FlexMaskedPlan(query_positions, query_clean, key_positions, key_clean, block_size, self.masked_tile,
                              query_documents, key_documents, clean_attention, window)

    def _bdlm_mask(self, q, k, plan):
        """The BDLM mask of the plan's rows and keys as a block mask of `plan.tile` tiles: flex skips the tiles
        it hides, computes the others and masks the partly hidden ones element by element."""
        if plan.block_mask is None:
            qp, qc, block, rule = plan.query_positions, plan.query_clean, plan.block_size, plan.clean_attention
            kp, kc, window = plan.key_positions, plan.key_clean, plan.window

            def bdlm(b, h, q_idx, kv_idx):
                return bdlm_visible(qp[q_idx], qc[q_idx], kp[kv_idx], kc[kv_idx], block, rule, window)

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
        mask = self._bdlm_mask(q, k, plan)
        return self._recompute_backward(dout, q, k, v, out, lse, lambda *qkv: self._attend(*qkv, scale, mask))

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

    def _block_diagonal(self, q, k, block_size, scale, documents):
        """The block-diagonal part's call: `attend(q, k, v)`, unmasked blocks, or the document mask under packing."""
        if documents is None:
            return lambda *qkv: self._attend_blocks(*qkv, scale, block_size)
        mask = self._document_block_diagonal_mask(q, k, block_size, documents)
        return lambda *qkv: self._attend(*qkv, scale, mask)

    def block_diagonal_forward(self, q, k, v, block_size, scale, documents=None):
        return self._block_diagonal(q, k, block_size, scale, documents)(q, k, v)

    def prefix_forward(self, q, k, v, plan, scale):
        out, lse = self._attend(q, k, v, scale, self._prefix_mask(q, k, plan))
        hidden = torch.isinf(lse)
        return out.masked_fill(hidden.unsqueeze(-1), 0.0), lse

    def _recompute_backward(self, dout, q, k, v, out, lse, attend):
        """Gradient of one part of a merged result, its forward `attend(q, k, v)` recomputed: upstream `w·dO` on
        its output and `w·(dO·(o−O))` on its LSE."""
        with torch.enable_grad():
            q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
            part_out, part_lse = attend(q, k, v)
            acc = accumulation_dtype(q.dtype)
            visible_lse = part_lse.detach().to(acc)
            weight = torch.exp(visible_lse - finite_lse(lse).to(acc))
            weight = torch.where(torch.isinf(visible_lse), torch.zeros_like(weight), weight)
            grad_out = (weight.unsqueeze(-1) * dout.to(acc)).to(part_out.dtype)
            grad_lse = (weight * (dout.to(acc) * (part_out.detach().to(acc) - out.to(acc))).sum(-1)).to(part_lse.dtype)
            return torch.autograd.grad((part_out, part_lse), (q, k, v), (grad_out, grad_lse))

    def block_diagonal_backward(self, dout, q, k, v, out, lse, block_size, scale, documents=None):
        return self._recompute_backward(dout, q, k, v, out, lse, self._block_diagonal(q, k, block_size, scale,
                                                                                      documents))

    def prefix_backward(self, dout, q, k, v, out, lse, plan, scale):
        mask = self._prefix_mask(q, k, plan)
        return self._recompute_backward(dout, q, k, v, out, lse, lambda *qkv: self._attend(*qkv, scale, mask))


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
                 query_documents=None, key_documents=None, clean_attention=BLOCK_CAUSAL, window=GLOBAL):
        self.query_positions, self.query_clean = query_positions, query_clean
        self.query_documents, self.key_documents = query_documents, key_documents
        self.key_positions, self.key_clean = key_positions, key_clean
        self.block_size, self.tile, self.block_mask = block_size, tile, None
        self.clean_attention, self.window = clean_attention, window
