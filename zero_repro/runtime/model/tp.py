"""Megatron-style tensor (model) parallelism, the layers ZeRO is combined with (paper §8, "ZeRO
with MP"; Shoeybi et al. 2019).

Megatron-LM's two conjugate autograd regions, ``copy_to_tp`` ("f": forward identity, backward
all-reduce) and ``reduce_from_tp`` ("g": forward all-reduce, backward identity), plus
``scatter_to_tp`` / ``gather_from_tp``, and the layers built from them: ``ColumnParallelLinear``,
``RowParallelLinear`` (one all-reduce of the output), ``VocabParallelEmbedding`` (its lookup and
the tied head it serves; with a ``RowSource`` both read the table a row slice at a time, for a
store that keeps it sharded) and ``vocab_parallel_cross_entropy`` (softmax over a vocabulary no
rank holds whole).

Communication it must satisfy: per block and step 4 all-reduces of B·s·h (2 forward, 2
backward), 6 with activation recompute: 6 × 2·s·h = 12·s·h elements per sample and block in the
§7 convention, the paper's §8 "12 × seq × hidden". A TP group of size 1 communicates nothing.
All communication goes through ``zero_repro.runtime.comm.comm``; the split dimension of each
parameter is declared per layer class in ``PARTITION_DIMS`` (a side table).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zero_repro.runtime.comm import comm

# ------------------------------------------------------------------------- f / g regions


class _CopyToTP(torch.autograd.Function):
    """f: the input is replicated on every TP rank; each rank's backward produces a partial
    input gradient (from its slice of the weight), so the gradients are summed."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # clone: autograd may hand the same grad tensor to other consumers
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """g: each rank holds a partial sum (row-parallel matmul); the output is their sum, and the
    gradient of a sum w.r.t. each summand is the identity."""

    @staticmethod
    def forward(ctx, x, group):
        # a copy, not in place: the caller's tensor may still be needed (and autograd would
        # need mark_dirty); the extra B·s·h buffer is transient
        out = x.contiguous().clone()
        comm.all_reduce(out, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _split_last(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    n = x.shape[-1]
    if n % group.size:
        raise ValueError(f"last dimension {n} is not divisible by the TP size {group.size}")
    k = n // group.size
    return x[..., group.rank * k:(group.rank + 1) * k].contiguous()


def _gather_last(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    x = x.contiguous()
    buf = torch.empty((group.size,) + tuple(x.shape), dtype=x.dtype, device=x.device)
    comm.all_gather_into(buf.view(-1), x.view(-1), group)
    return torch.cat(buf.unbind(0), dim=-1)  # (..., size * k)


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


def copy_to_tp(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    return x if group.size == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    return x if group.size == 1 else _ReduceFromTP.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    return x if group.size == 1 else _ScatterToTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    return x if group.size == 1 else _GatherFromTP.apply(x, group)


# ------------------------------------------------------------------------- layers
def _divide(n: int, k: int, what: str) -> int:
    if n % k:
        raise ValueError(f"{what}={n} is not divisible by the TP size {k}")
    return n // k


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A's output rows (and b) split over TP: rank r holds out/tp rows.

    The output stays split (the next RowParallelLinear consumes it) unless ``gather_output``.
    """

    PARTITION_DIMS = {"weight": 0, "bias": 0}

    def __init__(self, in_features: int, out_features: int, group: comm.Group, bias: bool = True,
                 gather_output: bool = False, device=None, dtype=None):
        super().__init__()
        self.group = group
        self.in_features, self.out_features = in_features, out_features
        self.out_local = _divide(out_features, group.size, "out_features")
        self.gather_output = gather_output
        kw = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.empty(self.out_local, in_features, **kw))
        self.bias = nn.Parameter(torch.empty(self.out_local, **kw)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_tp(x, self.group), self.weight, self.bias)  # (..., out/tp)
        return gather_from_tp(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A's input columns split over TP: each rank computes a partial sum,
    all-reduced in the forward pass. The bias is added after the all-reduce, so it is the same
    (replicated) tensor on every TP rank, not split."""

    PARTITION_DIMS = {"weight": 1, "bias": None}

    def __init__(self, in_features: int, out_features: int, group: comm.Group, bias: bool = True,
                 input_is_parallel: bool = True, device=None, dtype=None):
        super().__init__()
        self.group = group
        self.in_features, self.out_features = in_features, out_features
        self.in_local = _divide(in_features, group.size, "in_features")
        self.input_is_parallel = input_is_parallel
        kw = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.empty(out_features, self.in_local, **kw))
        self.bias = nn.Parameter(torch.empty(out_features, **kw)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group)
        y = reduce_from_tp(F.linear(x, self.weight), self.group)  # (..., out)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding whose (padded) vocabulary rows are split over TP: rank r holds rows
    [r·V/tp, (r+1)·V/tp). Ids outside the local range look up row 0 and are zeroed, then the
    partial embeddings are all-reduced (exactly one rank contributes each token)."""

    PARTITION_DIMS = {"weight": 0}

    def __init__(self, num_embeddings: int, embedding_dim: int, group: comm.Group, device=None,
                 dtype=None):
        super().__init__()
        self.group = group
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.local_rows = _divide(num_embeddings, group.size, "num_embeddings (padded vocab)")
        self.vocab_start = group.rank * self.local_rows
        self.weight = nn.Parameter(torch.empty(self.local_rows, embedding_dim, device=device,
                                               dtype=dtype))

    # a parameter store that keeps ``weight`` sharded sets a ``RowSource`` here (ZeRO stage 3):
    # the lookup and the tied head then read the table a row slice at a time
    row_source: "RowSource | None" = None

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.row_source is None:
            return F.embedding(ids, self.weight)
        return _SlicedLookup.apply(ids, self.weight, self.row_source)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return self._lookup(ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.local_rows)
        out = self._lookup(local.masked_fill(outside, 0))  # (..., h)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.group)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The tied LM head, column-parallel over this rank's vocabulary rows:
        ``x @ weight^T`` (..., h) -> (..., V/tp); ``x`` already passed ``copy_to_tp``."""
        if self.row_source is None:
            return F.linear(x, self.weight)
        return _SlicedHead.apply(x, self.weight, self.row_source)


# ------------------------------------------------------------- a table read in row slices
class RowSource:
    """What a vocabulary table's rows come from when its ``weight`` holds no data (ZeRO stage 3
    keeps the table sharded and gathers it a slice at a time, ``zero.slice_vocab_gather``).

    ``slices(reverse)`` yields ``(r0, r1, rows)``: the table's rows [r0, r1) as a (r1 - r0, h)
    tensor, valid until the next slice is asked for; the slices cover every row once, in order
    (``reverse``: last first)."""

    def slices(self, reverse: bool = False):
        raise NotImplementedError


def reads_row_source(func) -> bool:
    """Whether torch function ``func`` is a read of a table through its ``RowSource`` (the
    lookup or the head of ``VocabParallelEmbedding``): it takes the table's ``weight`` for its
    shape only, the rows come from the source."""
    return getattr(func, "__self__", None) in (_SlicedLookup, _SlicedHead)


class _SlicedLookup(torch.autograd.Function):
    """``F.embedding(ids, W)`` with W read a row slice at a time; no slice is kept for
    backward: dW is the embedding backward of the ids alone (the same op as ``F.embedding``'s,
    so the same values)."""

    @staticmethod
    def forward(ctx, ids, weight, source):
        out = weight.new_zeros(*ids.shape, weight.shape[1])
        for r0, r1, rows in source.slices():
            inside = ((ids >= r0) & (ids < r1)).unsqueeze(-1)
            out = torch.where(inside, F.embedding((ids - r0).clamp(0, r1 - r0 - 1), rows), out)
        ctx.save_for_backward(ids)
        ctx.rows = weight.shape[0]
        return out

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        dw = torch.ops.aten.embedding_dense_backward(grad.contiguous(), ids, ctx.rows, -1, False)
        return None, dw, None


class _SlicedHead(torch.autograd.Function):
    """logits = x W^T with W (V, h) read a row slice at a time, in forward and again (last
    slice first) in backward: dx = Σ_k g_k W_k, dW_k = g_k^T x. Only x is kept for backward."""

    @staticmethod
    def forward(ctx, x, weight, source):
        out = x.new_empty(*x.shape[:-1], weight.shape[0])
        for r0, r1, rows in source.slices():
            out[..., r0:r1] = F.linear(x, rows)
        ctx.save_for_backward(x)
        ctx.source, ctx.shape = source, weight.shape
        return out

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        dx = torch.zeros_like(x2) if ctx.needs_input_grad[0] else None
        dw = g.new_empty(ctx.shape) if ctx.needs_input_grad[1] else None
        for r0, r1, rows in ctx.source.slices(reverse=True):
            gk = g[:, r0:r1]
            if dx is not None:
                dx.addmm_(gk, rows)
            if dw is not None:
                torch.mm(gk.t(), x2, out=dw[r0:r1])
        return None if dx is None else dx.view_as(x), dw, None


# ------------------------------------------------------------------------- cross entropy
class _VocabParallelCE(torch.autograd.Function):
    """Mean cross entropy over N tokens of logits split over TP along the vocabulary.

    loss_i = log Σ_v exp(z_iv - m_i) - (z_{i,t_i} - m_i), with m_i the global max; the three
    global quantities (max, Σexp, target logit) are each one all-reduce of N elements.
    d loss / d z_iv = (softmax_iv - [v == t_i]) / N.
    """

    @staticmethod
    def forward(ctx, logits, targets, group, vocab_start, n_valid):
        n, v_local = logits.shape
        z = logits.float()
        if z is logits:
            z = z.clone()  # the in-place ops below must not touch the caller's logits
        if n_valid < v_local:  # vocabulary padding: never predicted, never contributes
            z[:, max(n_valid, 0):] = float("-inf")
        zmax = z.max(dim=-1).values  # (N,)
        comm.all_reduce(zmax, group, op="max")
        z.sub_(zmax.unsqueeze(-1))
        local_t = targets - vocab_start
        outside = (local_t < 0) | (local_t >= v_local)
        local_t = local_t.masked_fill(outside, 0)
        rows = torch.arange(n, device=logits.device)
        target_z = z[rows, local_t].masked_fill(outside, 0.0)  # (N,)
        comm.all_reduce(target_z, group)
        z.exp_()  # z is now exp(z - max)
        sum_exp = z.sum(dim=-1)
        comm.all_reduce(sum_exp, group)
        loss = (sum_exp.log() - target_z).mean()
        z.div_(sum_exp.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(z, local_t, outside)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, local_t, outside = ctx.saved_tensors
        n = softmax.shape[0]
        g = softmax.clone()
        rows = torch.arange(n, device=g.device)
        g[rows, local_t] -= (~outside).to(g.dtype)
        g.mul_(grad / n)
        return g.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits_local: torch.Tensor, targets: torch.Tensor,
                                 tp_group: comm.Group, vocab_size: int | None = None
                                 ) -> torch.Tensor:
    """Mean token cross entropy; ``logits_local`` (N, V_pad/tp) is this rank's vocabulary
    slice (rank r holds global columns [r·V_pad/tp, (r+1)·V_pad/tp)), ``targets`` (N,) global ids.

    Columns with global index >= ``vocab_size`` are vocabulary padding: they are excluded from
    the softmax (as if their logit were -inf), so the loss does not depend on how much padding a
    TP degree needs. With a TP group of size 1 this is ``F.cross_entropy`` on the unpadded columns.
    Computed in fp32 whatever the logits' dtype; the gradient has the logits' dtype.
    """
    n_local = logits_local.shape[-1]
    vocab_size = n_local * tp_group.size if vocab_size is None else vocab_size
    if tp_group.size == 1:
        return F.cross_entropy(logits_local[:, :vocab_size].float(), targets)
    vocab_start = tp_group.rank * n_local
    return _VocabParallelCE.apply(logits_local, targets, tp_group, vocab_start,
                                  vocab_size - vocab_start)

