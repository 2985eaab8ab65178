"""DeepSpeed 0.2's P_os (ZeRO stage 1, paper §5.1) as the allocation sequence it performed: its
sub-partition layout and gradient path, for the ``paper2020`` stack of the dry run (switch
``stage1_interval_layout``). Sources, DeepSpeed@f2ac7eafd ``deepspeed/pt/zero_optimizer_stage1.py``
(the same at DeepSpeed@e67a3def0, the squashed dev-zero branch, up to logging and a static loss
scale), lines cited in the methods.

Layout (``flatten_dense_tensors_sub_partition_aligned`` L13-93, ``get_data_parallel_sub_partitions``
L294-349), with I = max_elements_per_comm = 5e8 (``reduce_bucket_size`` of the harness) and N_d
the DP degree:

    sub  = min(I, Ψ) // N_d                       sub-partition (elements)
    n    = ceil(ceil(Ψ / sub) / N_d)              comm intervals
    Ψ'   = n · N_d · sub  >= Ψ                    the flat fp16 buffer, padded with zeros

so up to one interval (I elements, 1 GB in fp16) of padding, which every rank also carries in its
fp32 sub-partitions and Adam state (12·(Ψ' - Ψ)/N_d). Rank r owns sub-partition k·N_d + r of every
interval k: n separate fp32 tensors of ``sub`` elements, Adam's moments made by the optimizer at
its first step (no ``initialize_optimizer_states`` in stage 1).

Per step, with the per-parameter fp16 gradients (2Ψ) kept by autograd:
  backward end (``reduce_scatter_gradients`` L521-602): every rank's sub-partitions flattened,
    one ``sub``-element tensor per (rank, interval) (2Ψ' in N_d·n tensors, L536-547), one
    ``dist.reduce_scatter`` per interval (L571-577) -- PyTorch 1.x NCCL copies the list into a
    flattened I-element staging tensor per call --, the own parameters' gradients rebuilt with a
    ``torch.cat`` each (L585-602); everything freed at return.
  step (L604-699): overflow check and gradient norm per parameter (``x.float()``, an fp32 copy
    each, and an ``.item()``: deepspeed_utils.py L59, L89, L158-162), the other ranks' gradients
    freed (L630), this rank's gradients cast to fp32 piece by piece and flattened per interval
    (``get_flat_sub_partitions``, 4Ψ'/N_d kept, L642-649), the fp16 gradients freed (L659),
    Adam, the fp32 gradients freed (L671-673), fp32 -> fp16 copy, one list ``dist.all_gather``
    per interval (an I-element flattened output each, L686-690).
"""
from __future__ import annotations

import torch

from zero_repro.runtime.comm import comm
from zero_repro.scale.dryrun.stack import streams
from zero_repro.scale.dryrun.stack import switches as S
from zero_repro.scale.dryrun.stack.categories import category


def interval_layout(numel: int, n_d: int, max_elements_per_comm: int) -> tuple[int, int, int]:
    """(sub-partition elements, comm intervals, padded elements Ψ') of ``numel`` parameters
    over ``n_d`` ranks (zero_optimizer_stage1.py@f2ac7eafd L13-93: the padding rules as
    written, including the extra interval when the sub-partitions do not fill whole ones)."""
    max_comm = min(int(max_elements_per_comm), numel)
    sub = max_comm // n_d
    remaining = numel % sub
    add = sub - remaining if remaining else 0
    n_partitions = (numel + add) // sub
    n_int = n_partitions // n_d
    if n_partitions % n_d:
        n_int += 1
        add = n_int * sub * n_d - numel
    return sub, n_int, numel + add


class Stage1Intervals:
    """The stage-1 allocation sequence over ``params`` for DP group ``dp`` (module docstring).
    Same calls as ``deepspeed02.DeepSpeed02``: ``build``, ``backward_begin``, ``grad_ready``,
    ``backward_end``, ``step``."""

    stage = 1

    def __init__(self, params: list[torch.Tensor], dp: comm.Group, stack: S.Stack):
        self.params, self.dp, self.stack = list(params), dp, stack
        self.n_d, self.rank = dp.size, dp.rank
        self.numel = sum(p.numel() for p in self.params)
        self.sub, self.n_int, self.padded = interval_layout(
            self.numel, self.n_d, stack.stage1_max_elements_per_comm)
        self.part = self.padded // self.n_d  # this rank's elements (n_int sub-partitions)
        offs, o = [], 0
        for p in self.params:
            offs.append(o)
            o += p.numel()
        self.offsets = offs
        self.host_tensors: list[torch.Tensor] = []
        self.flat = None
        self.master: list[torch.Tensor] = []  # fp32 sub-partitions, one per interval
        self.adam: list[torch.Tensor] = []  # made at the first step
        self.grads: dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------------ geometry
    def _sub_range(self, rank: int, k: int) -> tuple[int, int]:
        lo = (k * self.n_d + rank) * self.sub
        return lo, lo + self.sub

    def _pieces(self, rank: int, k: int) -> list[tuple[int, int, int]]:
        """(parameter, first element, elements) of the parameters overlapping sub-partition
        (``rank``, ``k``), in flat order."""
        lo, hi = self._sub_range(rank, k)
        out = []
        for i, (p, o) in enumerate(zip(self.params, self.offsets)):
            a, b = max(lo, o), min(hi, o + p.numel())
            if a < b:
                out.append((i, a - o, b - a))
        return out

    def _own_params(self) -> list[int]:
        return sorted({i for k in range(self.n_int) for i, _, _ in self._pieces(self.rank, k)})

    # ------------------------------------------------------------------ build
    def build(self) -> None:
        dev, dt = self.params[0].device, self.params[0].dtype
        with category(S.FP16_PARAMS):
            pad = self.padded - self.numel  # L68-71 / L79-82: a zeros tensor in the list
            pad_t = torch.zeros(pad, dtype=dt, device=dev) if pad else None
            self.flat = torch.empty(self.padded, dtype=dt, device=dev)  # L93
            for p, o in zip(self.params, self.offsets):
                self.flat[o:o + p.numel()].copy_(p.reshape(-1))
            del pad_t
            for p, o in zip(self.params, self.offsets):  # L218-221
                p.data = self.flat[o:o + p.numel()].view(p.shape)
        with category(S.MASTER_ADAM):
            for k in range(self.n_int):  # L246-250: clone().float() per own sub-partition
                lo, hi = self._sub_range(self.rank, k)
                half = self.flat[lo:hi].clone()
                self.master.append(half.float())
                del half

    def release_host(self) -> None:
        self.host_tensors.clear()

    # ------------------------------------------------------------------ backward
    def backward_begin(self) -> None:
        pass

    def grad_ready(self, i: int, grad: torch.Tensor) -> None:
        self.grads[i] = grad  # autograd's per-parameter gradient, kept until the step

    def backward_end(self) -> None:
        """``reduce_scatter_gradients`` (L521-602)."""
        dev, dt = self.flat.device, self.flat.dtype
        with category(S.BUCKETS):
            subs = [[self._flat_sub(r, k, dt) for k in range(self.n_int)]
                    for r in range(self.n_d)]  # L536-547: rank by rank, interval by interval
            for k in range(self.n_int):  # L571-577
                staged = torch.empty(self.sub * self.n_d, dtype=dt, device=dev)
                for r in range(self.n_d):  # PyTorch 1.x: the list copied into one flat input
                    staged[r * self.sub:(r + 1) * self.sub].copy_(subs[r][k])
                    streams.record(subs[r][k])
                comm.reduce_scatter_into(subs[self.rank][k], staged, self.dp)
                del staged
                for r in range(self.n_d):  # L579-581: gradient averaging, in place
                    subs[r][k].mul_(1.0 / self.n_d)
            for i in self._own_params():  # L585-602: torch.cat of the parameter's parts
                n = sum(m for k in range(self.n_int)
                        for j, _, m in self._pieces(self.rank, k) if j == i)
                joined = torch.empty(n, dtype=dt, device=dev)
                g = self.grads.get(i)
                if g is not None and n == g.numel():
                    g.reshape(-1).copy_(joined)
                del joined
            del subs

    def _flat_sub(self, rank: int, k: int, dtype: torch.dtype) -> torch.Tensor:
        """``get_flat_sub_partitions`` for one (rank, interval): the parameters' gradient
        pieces (views) and a zero tail flattened into one ``sub``-element tensor (L416-479),
        or a zero tensor for an interval with no parameter (L480-488)."""
        dev = self.flat.device
        pieces = self._pieces(rank, k)
        tail = self.sub - sum(n for _, _, n in pieces)
        if not pieces:
            return torch.zeros(self.sub, dtype=dtype, device=dev)
        pad = torch.zeros(tail, dtype=dtype, device=dev) if tail else None
        out = torch.empty(self.sub, dtype=dtype, device=dev)
        at = 0
        for i, first, n in pieces:
            g = self.grads.get(i)
            if g is not None:
                out[at:at + n].copy_(g.reshape(-1)[first:first + n])
            at += n
        del pad
        return out

    # ------------------------------------------------------------------ step
    def _per_param_fp32(self, indices) -> None:
        """``x.float()`` (overflow check, deepspeed_utils.py L89) or ``.float().norm()`` (the
        norm, L158-162) of each gradient, one at a time, each read back with ``.item()``."""
        for i in indices:
            g = self.grads.get(i)
            if g is None:
                continue
            x = g.float()
            s = x.sum()
            del x, s
            streams.sync("stage 1 overflow / norm .item()")

    def step(self) -> None:
        dev = self.flat.device
        with category(S.STEP_TEMP):
            every = sorted(self.grads)
            self._per_param_fp32(every)  # overflow_checker.check() (L607)
            self._per_param_fp32(every)  # get_grad_norm (L626)
            own = set(self._own_params())
            for i in every:  # L630: the other ranks' gradients
                if i not in own:
                    self.grads.pop(i)
            g32 = []
            for k in range(self.n_int):  # L642-649: get_flat_sub_partitions in fp32
                pieces = self._pieces(self.rank, k)
                if not pieces:
                    g32.append(torch.zeros(self.sub, dtype=torch.float32, device=dev))
                    continue
                parts = [self.grads[i].reshape(-1)[a:a + n].to(torch.float32)
                         for i, a, n in pieces if i in self.grads]
                tail = self.sub - sum(n for _, _, n in pieces)
                if tail:
                    parts.append(torch.zeros(tail, dtype=torch.float32, device=dev))
                g32.append(torch.cat(parts))
                del parts
            self.grads.clear()  # L659-660
            if not self.adam:  # apex FusedAdam: its state at the first step
                with category(S.MASTER_ADAM):
                    for m in self.master:
                        self.adam += [torch.zeros_like(m), torch.zeros_like(m)]
            for k, g in enumerate(g32):  # unscale (in place) + FusedAdam (L665-667)
                m, v = self.adam[2 * k], self.adam[2 * k + 1]
                g.mul_(1.0)
                m.mul_(0.9).add_(g, alpha=0.1)
                v.mul_(0.999).addcmul_(g, g, value=0.001)
                self.master[k].addcdiv_(m, v, value=-1e-4)
            del g32  # L671-673
            for k in range(self.n_int):  # L679-682
                lo, hi = self._sub_range(self.rank, k)
                self.flat[lo:hi].copy_(self.master[k])
        with category(S.GATHER):
            for k in range(self.n_int):  # L686-690: list all_gather, flattened output
                lo, hi = self._sub_range(self.rank, k)
                staged = torch.empty(self.sub * self.n_d, dtype=self.flat.dtype, device=dev)
                comm.all_gather_into(staged, self.flat[lo:hi], self.dp)
                del staged

    def ledger_sizes(self) -> dict:
        """Bytes of the model states as this path holds them between steps."""
        elt = self.flat.element_size()
        return {"params_lp": self.padded * elt, "grads": self.numel * elt,
                "master_fp32": self.part * 4, "adam_m": self.part * 4, "adam_v": self.part * 4,
                "comm_buffers": 0}

