"""The LM head and its per-token cross-entropy in tiles of rows (`--cross-entropy-loss-fusion`): no `[rows x vocab]`
logits tensor is ever held whole, in the forward or the backward.

The head's logits are the larger part of a long-context step's activations (a 151,936-id vocabulary makes each row's
logits 600 KB in fp32), and the loss needs only three numbers of each row: its max, its sum of exponentials and its
target's logit. So the forward computes the logits one tile of rows at a time (this TP rank's vocabulary columns,
the unpredictable ones -inf as the model's head sets them), reduces them over the TP group as megatron-core's
vocab-parallel cross-entropy does (the max, then the sum of exponentials and the target logit, which one rank
holds), and keeps only each row's log-sum-exp. The backward recomputes each tile's logits, turns them into
`softmax - onehot(target)` scaled by the row's gradient, and from that tile gives the rows' input gradient (summed
over TP, as the head's column-parallel linear does) and adds the tile's share of the weight gradient (in fp32,
then the weight's dtype). The price is the head's forward matmul once more in the backward.

The maths is the unfused head's (logits in the input's dtype, the loss in fp32), so the loss and gradients match it
to rounding.
"""

import torch


def tiled_linear_cross_entropy(hidden, weight, labels, tile_rows: int, unpredictable=None, group=None,
                               softcap: float | None = None):
    """Per-row cross-entropy `[rows]` (fp32; fp64 for fp64 inputs) of the logits `hidden [rows, h] @ weight.T`, over
    the vocabulary split by columns over `group` (this rank's `weight [V/tp, h]` holds columns `rank * V/tp ...`),
    against `labels [rows]` (global ids), computed `tile_rows` rows at a time. `unpredictable [V/tp]` (bool):
    columns whose logits are -inf (None: none). `softcap`: the logits are `softcap · tanh(logits / softcap)` (Gemma's
    final-logit softcapping; None: as they are)."""
    if tile_rows < 1:
        raise ValueError(f"tile_rows={tile_rows} must be >= 1")
    return _TiledLinearCrossEntropy.apply(hidden, weight, labels, tile_rows, unpredictable, group, softcap)


def _tiles(rows: int, tile_rows: int):
    for start in range(0, rows, tile_rows):
        yield slice(start, min(start + tile_rows, rows))


def _loss_dtype(dtype):
    """The dtype of the logits' reductions and the loss: fp32, or the input's where wider (fp64)."""
    return torch.promote_types(dtype, torch.float32)


def softcapped(logits, softcap: float | None):
    """`softcap · tanh(logits / softcap)`, or the logits where `softcap` is None (differentiable: not in place)."""
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


def _logits(hidden, weight, unpredictable, softcap=None):
    """One tile's logits in `_loss_dtype` (the matmul in the input's dtype, as the unfused head runs it)."""
    logits = softcapped((hidden @ weight.t()).to(_loss_dtype(hidden.dtype)), softcap)
    return logits if unpredictable is None else logits.masked_fill_(unpredictable, float("-inf"))


def _all_reduce(tensor, op, group):
    if group is not None and group.size() > 1:
        torch.distributed.all_reduce(tensor, op=op, group=group)
    return tensor


class _TiledLinearCrossEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, hidden, weight, labels, tile_rows, unpredictable, group, softcap):
        columns = weight.shape[0]
        first = 0 if group is None else group.rank() * columns
        local = labels - first
        held = (local >= 0) & (local < columns)  # the target's column is on this rank
        local = torch.where(held, local, 0)
        lse = torch.empty(hidden.shape[0], dtype=_loss_dtype(hidden.dtype), device=hidden.device)
        target = torch.empty_like(lse)
        for rows in _tiles(hidden.shape[0], tile_rows):
            logits = _logits(hidden[rows], weight, unpredictable, softcap)
            picked = logits.gather(1, local[rows, None]).squeeze(1)
            row_max = _all_reduce(logits.max(dim=1).values, torch.distributed.ReduceOp.MAX, group)
            sums = torch.stack([logits.sub_(row_max[:, None]).exp_().sum(dim=1),
                                torch.where(held[rows], picked, 0.0)])
            del logits
            sums = _all_reduce(sums, torch.distributed.ReduceOp.SUM, group)
            lse[rows] = sums[0].log() + row_max
            target[rows] = sums[1]
        ctx.save_for_backward(hidden, weight, local, held, lse)
        ctx.tile_rows, ctx.unpredictable, ctx.group, ctx.softcap = tile_rows, unpredictable, group, softcap
        return lse - target

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, local, held, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=_loss_dtype(weight.dtype), device=weight.device)
        for rows in _tiles(hidden.shape[0], ctx.tile_rows):
            grad_logits = _logits(hidden[rows], weight, ctx.unpredictable, ctx.softcap)
            capped = None if ctx.softcap is None else grad_logits.clone()
            grad_logits = grad_logits.sub_(lse[rows, None]).exp_()
            grad_logits.scatter_add_(1, local[rows, None], -held[rows, None].to(grad_logits.dtype))
            grad_logits = grad_logits.mul_(grad_loss[rows, None])
            if capped is not None:  # through the cap: d(c·tanh(z/c))/dz = 1 - (capped/c)², 0 where -inf
                slope = capped.div_(ctx.softcap).square_().neg_().add_(1)
                grad_logits = grad_logits.mul_(slope.nan_to_num_(nan=0.0, neginf=0.0))
            grad_logits = grad_logits.to(hidden.dtype)
            torch.matmul(grad_logits, weight, out=grad_hidden[rows])
            if grad_weight.dtype == grad_logits.dtype:
                grad_weight.addmm_(grad_logits.t(), hidden[rows])
            else:
                grad_weight += grad_logits.t() @ hidden[rows]
            del grad_logits
        _all_reduce(grad_hidden, torch.distributed.ReduceOp.SUM, ctx.group)
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None, None


@torch.no_grad()
def tiled_soft_embeddings(hidden, weight, embedding, tile_rows: int, unpredictable=None, group=None,
                          softcap: float | None = None, tile_columns: int | None = None):
    """`softmax(hidden @ weight.T) @ embedding` per row `[rows, h]`: the expected input embedding under the head's
    predicted distribution (a self-conditioning signal), never differentiated, `tile_rows` rows at a time and, with
    `tile_columns`, that many vocabulary columns at a time (a first sweep for each row's max and sum, a second for
    the probabilities, the logits recomputed): no tile holds more than `tile_rows x tile_columns` logits.
    `weight [V/tp, h]` (the head) and `embedding [V/tp, h]` (the input embedding) hold this TP rank's columns of
    the vocabulary split over `group`; `unpredictable [V/tp]` (bool): columns whose logits are -inf; `softcap`: the
    logits capped as `tiled_linear_cross_entropy` caps them. The softmax runs in fp32 (or wider), its
    probabilities then in the embedding's dtype, as the reference's self-conditioning takes them."""
    columns = weight.shape[0]
    tile_columns = tile_columns or columns
    if tile_rows < 1 or tile_columns < 1:
        raise ValueError(f"tile_rows={tile_rows} and tile_columns={tile_columns} must be >= 1")
    pieces = list(_tiles(columns, tile_columns))
    logits_of = (lambda rows, cols: _logits(hidden[rows], weight[cols], None if unpredictable is None
                                            else unpredictable[cols], softcap))
    out = torch.empty(hidden.shape[0], embedding.shape[1], dtype=embedding.dtype, device=hidden.device)
    for rows in _tiles(hidden.shape[0], tile_rows):
        logits = logits_of(rows, pieces[0]) if len(pieces) == 1 else None  # one sweep when one tile holds them
        if logits is None:
            row_max = torch.stack([logits_of(rows, cols).max(dim=1).values for cols in pieces]).max(dim=0).values
        else:
            row_max = logits.max(dim=1).values
        row_max = _all_reduce(row_max, torch.distributed.ReduceOp.MAX, group)
        if logits is None:
            total = sum(logits_of(rows, cols).sub_(row_max[:, None]).exp_().sum(dim=1) for cols in pieces)
        else:
            logits = logits.sub_(row_max[:, None]).exp_()
            total = logits.sum(dim=1)
        total = _all_reduce(total, torch.distributed.ReduceOp.SUM, group)
        signal = None
        for cols in pieces:
            probabilities = logits if logits is not None else logits_of(rows, cols).sub_(row_max[:, None]).exp_()
            part = probabilities.div_(total[:, None]).to(embedding.dtype) @ embedding[cols]
            signal = part if signal is None else signal + part
            del probabilities
        out[rows] = _all_reduce(signal, torch.distributed.ReduceOp.SUM, group)
        del logits
    return out
