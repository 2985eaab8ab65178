"""The one interface every ZeRO-DP stage implements (paper §5); the stages side by side and
``build_strategy`` are in ``zero_repro.runtime.zero``.

A ``Strategy`` wraps an ``nn.Module`` the way DDP does: ``strategy.module(...)`` (or
``forward``), ``backward(loss)``, ``step()`` -> ``StepInfo``, ``zero_grad()``.
  backward(loss)  scales the loss (loss scale / grad_accum) and runs autograd; gradient hooks
                  move each gradient into the stage's storage and launch bucketed async
                  collectives while backward goes on.
  step()          waits for the collectives; unscales; agrees the overflow flag and the norm
                  over the world (DP × TP) in one all-reduce; skips on overflow (every rank),
                  else clips by the global norm, runs AdamW on this rank's fp32 shard, casts it
                  into the training dtype and publishes the parameters (stage-specific).
Gradient accumulation: k = ``train.grad_accum`` forward/backward pairs, then ``step()``; stages
0-1 reduce on the last micro-batch only (DDP's no_sync), stages 2-3 reduce-scatter every
micro-batch into the shard; k micro-batches equal one batch k times larger
(``backward(loss, is_last_micro_batch=...)`` overrides the micro-batch count).

Invariants: communication per step (§7) 2Ψ for stages 0-2, 3Ψ for stage 3 (less what stage 3
keeps gathered across the turn); memory per rank Table 1's
(``zero_repro.scale.paper.table1.model_state_bytes``). The overlap knobs
(``zero.overlap_param_gather``, ``prefetch_next_step``, ``keep_gathered_turn``) are bit-identical
on or off: whatever reads parameters outside forward waits first (``wait_params``), whatever
writes shards first settles what still reads them. Not overlapped, because it cannot be exact:
Adam per bucket as its reduction lands (the clip and the overflow skip need every bucket), and,
by default, the tied embedding's head gradient (autograd sums head and lookup first;
``zero.split_tied_grad`` splits them at a rounding difference, hence opt-in).
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from zero_repro.config import TrainConfig, ZeroConfig, ZeroRConfig
from zero_repro.runtime.comm import comm
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.zero.ledger import MemoryLedger
from zero_repro.runtime.zero import clip, precision
from zero_repro.runtime.zero.adam import ShardAdamW
from zero_repro.runtime.zero.flat_buffer import FlatParams
from zero_repro.runtime.zero.partition import counted_subranges

log = logging.getLogger(__name__)


@dataclass
class StepInfo:
    skipped: bool
    grad_norm: float
    loss_scale: float  # the scale used for this step's gradients


class Strategy:
    """Base class: shared step logic. Subclasses provide storage and communication."""

    stage: int = -1

    def __init__(self, model: nn.Module, topo: Topology, zero: ZeroConfig, train: TrainConfig,
                 zero_r: ZeroRConfig | None = None):
        """The parts every stage shares; a stage's own ``__init__`` then builds its storage
        and finishes with ``_attach``."""
        self.module = model
        self.topo, self.zero, self.train = topo, zero, train
        # None = the C_B and M_D behaviour ZeRO recommends (constant buffers, contiguous grads)
        self.zero_r = zero_r or ZeroRConfig(constant_buffers=True, contiguous_memory=True)
        self.dp_group = topo.dp_group
        self.n_d, self.dp_rank = self.dp_group.size, self.dp_group.rank
        self.dtype = precision.lp_dtype(zero.dtype)
        self.scaler = precision.build_scaler(zero)
        # the global gradient norm (and its non-finite check) each step: needed to clip and to
        # scale dynamically, logged otherwise; a caller that logs nothing (the peers race, whose
        # DDP / FSDP2 compute none) may turn it off where neither needs it
        self.measure_grad_norm = True
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in self.named]
        # the ranks' device (every buffer the strategy makes goes there: GPU runs, meta dry runs)
        self.device = self.named[0][1].device if self.named else torch.device("cpu")
        self._micro = 0
        self._is_last = True
        self._no_sync = False

    def _attach(self, groups: list[FlatParams], shard_rank: int, counts_norm: bool) -> None:
        """Shared end of every stage's ``__init__``: the fp32 optimizer state over the owned
        chunks (one per bucket, ``_param_chunks``), the gradient-norm ranges, the gradient hooks.

        ``shard_rank``: which chunk of each bucket this rank owns (0 when nothing is sharded);
        ``counts_norm``: whether this DP rank's gradient elements enter the global norm."""
        self.groups = groups
        self.shard_rank = shard_rank
        self._counted = self._counted_ranges(self.module, counts_norm)
        chunks, base = [], 0
        for g in self.groups:
            chunks += [(base + b.shard_offset, b.chunk) for b in g.partition.buckets]
            base += g.partition.shard_numel
        self.opt = ShardAdamW(chunks, self._param_chunks(),
                              precision.needs_master(self.zero.dtype))
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for _, p in self.named]

    def _tied_weight(self, flat) -> torch.nn.Parameter | None:
        """The model's tied embedding weight, when the model can hand its gradient over in
        two parts (``GPT.tied_grad_sink``, used under ``zero.split_tied_grad``) and it lies in
        ``flat``: this strategy becomes the sink (``takes_tied_grad``, ``head``, ``lookup``)."""
        w = getattr(getattr(self.module, "wte", None), "weight", None)
        if not hasattr(self.module, "tied_grad_sink") or w is None or id(w) not in flat.slot_of:
            return None
        self.module.tied_grad_sink = self
        return w

    def takes_tied_grad(self) -> bool:
        """Read by the model at every forward: the tied gradient in two parts this step."""
        return self.zero.split_tied_grad

    # ------------------------------------------------------------------ stage interface
    def _bucket_capacity(self) -> int:
        """C_B: constant fused-buffer elements, or the whole model (paper's baseline)."""
        if self.zero_r.constant_buffers:
            return min(self.zero.reduce_bucket_size, self.zero.allgather_bucket_size)
        return 1 << 62  # one bucket per group: the fused buffer grows with the model

    def _param_chunks(self) -> list[torch.Tensor]:
        """Training-dtype tensors holding this rank's owned elements, one per bucket."""
        raise NotImplementedError

    def _grad_chunks(self) -> list[torch.Tensor | None]:
        """Reduced (summed/N_d, still loss-scaled) gradients of the owned elements."""
        raise NotImplementedError

    def _on_grad(self, p: torch.Tensor) -> None:
        raise NotImplementedError

    def _begin_backward(self) -> None:
        return None

    def _finish_backward(self) -> None:
        return None

    def _wait_reductions(self) -> None:
        raise NotImplementedError

    def _publish(self) -> None:
        """Make updated shards visible in the module's parameters (complete on return)."""
        return None

    def _chunk_publisher(self) -> Callable[[int], None] | None:
        """Called with chunk i as soon as Adam finished it, instead of ``_publish`` after the
        whole step (``zero.overlap_param_gather``); None: publish after the step."""
        return None

    def wait_params(self) -> None:
        """Block until the module's parameters hold the current values (an overlapped
        all-gather launched by the last step has landed). Forward waits by itself."""
        return None

    def _before_update(self) -> None:
        """Before the shards are written (step, load): nothing may still read or hold them."""
        self.wait_params()

    def _after_step(self) -> None:
        """After the step (taken or skipped): e.g. start the next step's first gather."""
        return None

    def _zero_grads(self) -> None:
        raise NotImplementedError

    def _ledger(self, ledger: MemoryLedger) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ public API
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    __call__ = forward

    @contextlib.contextmanager
    def no_sync(self):
        """Within this context backward never counts as the last micro-batch."""
        old, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = old

    def backward(self, loss: torch.Tensor, is_last_micro_batch: bool | None = None) -> None:
        self.wait_params()  # forward waited already, unless parameters were read outside it
        self._micro += 1
        if is_last_micro_batch is None:
            is_last_micro_batch = self._micro >= self.train.grad_accum and not self._no_sync
        self._is_last = is_last_micro_batch
        self._begin_backward()
        # fp32 product: an fp16 loss times 2^16 would overflow before backward even starts
        (loss.float() * (self.scaler.scale / self.train.grad_accum)).backward()
        self._finish_backward()

    def step(self) -> StepInfo:
        self._before_update()
        self._wait_reductions()
        scale = self.scaler.scale
        grads = self._grad_chunks()
        if self.measure_grad_norm or self.zero.grad_clip > 0 or \
                isinstance(self.scaler, precision.DynamicLossScaler):
            stats = clip.local_stats(grads, self._counted, 1.0 / scale, self.device)
            norm, overflow = clip.agree(stats, self.topo.world)
        else:
            norm, overflow = float("nan"), False
        self.scaler.update(overflow)
        if overflow and isinstance(self.scaler, precision.DynamicLossScaler):
            log.info("stage %d: gradient overflow, step skipped, loss scale %g -> %g",
                     self.stage, scale, self.scaler.scale)
        elif overflow:  # fp32/bf16: no loss scale to speak of
            log.info("stage %d: non-finite gradient, step skipped", self.stage)
        else:
            coef = clip.clip_coef(norm, self.zero.grad_clip)
            t = self.train
            publish_chunk = self._chunk_publisher()
            self.opt.step(self._param_chunks(), grads, coef / scale, t.lr, (t.beta1, t.beta2),
                          t.eps, t.weight_decay, on_chunk=publish_chunk)
            if publish_chunk is None:
                self._publish()
        self._after_step()
        self._micro = 0
        return StepInfo(skipped=overflow, grad_norm=norm, loss_scale=scale)

    def zero_grad(self) -> None:
        self._zero_grads()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if getattr(self.module, "tied_grad_sink", None) is self:
            self.module.tied_grad_sink = None

    def memory_ledger(self) -> MemoryLedger:
        ledger = MemoryLedger()
        for k, v in self.opt.nbytes().items():
            ledger.add(k, v)
        self._ledger(ledger)
        return ledger

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """This TP rank's parameters, unsharded over DP, in fp32 (from the master shard)."""
        self.wait_params()  # the gathers below are issued after the step's, in the same order
        out, i = {}, 0
        lp_chunks = self._param_chunks()
        enabled, self.topo.ledger.enabled = self.topo.ledger.enabled, False
        try:
            for g in self.groups:
                full = torch.zeros(g.partition.padded_numel, dtype=torch.float32,
                                   device=g.flat.device)
                for b in g.partition.buckets:
                    mine = self.opt.master_chunk(i, lp_chunks[i]).float()
                    if g.partition.world == 1:
                        full[b.start:b.end].copy_(mine)
                    else:
                        comm.all_gather_into(full[b.start:b.end], mine.contiguous(),
                                             self.dp_group)
                    i += 1
                for s in g.slots:
                    out[s.name] = full[s.offset:s.end].view(s.shape).clone()
        finally:
            self.topo.ledger.enabled = enabled
        return {n: out[n] for n in self.names}

    def state_dict(self) -> dict:
        """Sharded optimizer state: per group the fp32 master/m/v shard and the flat ranges it
        covers (``shard_ranges``: (flat_start, shard_start, length)), enough to reshard."""
        self.wait_params()  # a checkpoint never races the step's all-gather
        groups, base, i = [], 0, 0
        lp_chunks = self._param_chunks()
        for g in self.groups:
            n = g.partition.shard_numel
            nb = len(g.partition.buckets)
            master = torch.cat([self.opt.master_chunk(i + k, lp_chunks[i + k]).float()
                                for k in range(nb)]) if nb else torch.zeros(0)
            groups.append({
                "name": g.name, "slots": [(s.name, s.offset, s.numel, s.shape) for s in g.slots],
                "partition": g.partition.describe(),
                "shard_ranges": g.partition.shard_ranges(self.shard_rank),
                "master": master.clone(), "exp_avg": self.opt.exp_avg[base:base + n].clone(),
                "exp_avg_sq": self.opt.exp_avg_sq[base:base + n].clone()})
            base += n
            i += nb
        return {"stage": self.stage, "dtype": self.zero.dtype, "dp_world": self.n_d,
                "dp_rank": self.dp_rank, "step": self.opt.step_count,
                "scaler": self.scaler.state_dict(), "groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Load a state from ``state_dict`` of the same stage, layout and DP size."""
        if len(state["groups"]) != len(self.groups):
            raise ValueError("state_dict has a different number of flat groups; reshard first")
        self._before_update()
        base, i = 0, 0
        lp_chunks = self._param_chunks()
        for g, gs in zip(self.groups, state["groups"]):
            n = g.partition.shard_numel
            if gs["master"].numel() != n:
                raise ValueError(f"group {g.name}: shard of {gs['master'].numel()} elements, "
                                 f"expected {n}; reshard for dp={self.n_d} first")
            self.opt.exp_avg[base:base + n].copy_(gs["exp_avg"])
            self.opt.exp_avg_sq[base:base + n].copy_(gs["exp_avg_sq"])
            for b in g.partition.buckets:
                src = gs["master"][b.shard_offset:b.shard_offset + b.chunk]
                self.opt.master_chunk(i, lp_chunks[i]).copy_(src)
                lp_chunks[i].copy_(src)
                i += 1
            base += n
        self.opt.step_count = int(state["step"])
        self.scaler.load_state_dict(state["scaler"])
        self._publish()

    # ------------------------------------------------------------------ helpers
    def _counted_ranges(self, model: nn.Module,
                        counts_norm: bool) -> list[list[tuple[int, int]]]:
        """Per owned chunk, the sub-ranges that enter the global grad norm on this rank."""
        dims_fn = getattr(model, "tp_partition_dims", None)
        dims = dims_fn() if callable(dims_fn) else {}
        tp_rank = self.topo.tp_group.rank if self.topo.tp_group is not None else 0
        counted = {n for n in self.names
                   if dims.get(n) is not None or tp_rank == 0} if counts_norm else set()
        out, rank = [], self.shard_rank
        for g in self.groups:
            for b in g.partition.buckets:
                lo, hi = b.owned(rank)
                out.append(counted_subranges(g.slots, counted, lo, hi))
        return out

