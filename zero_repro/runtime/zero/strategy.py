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
                  into the training dtype and publishes the parameters (stage-specific). The
                  skip and the clip are decided on the device (``clip.Agreed``): no host read
                  in the step; ``StepInfo`` reads the flag and the norm when asked.
Gradient accumulation: k = ``train.grad_accum`` forward/backward pairs, then ``step()``; stages
0-1 reduce on the last micro-batch only (DDP's no_sync), stages 2-3 reduce-scatter every
micro-batch into the shard; k micro-batches equal one batch k times larger
(``backward(loss, is_last_micro_batch=...)`` overrides the micro-batch count).

The lifecycle, the same for every stage (``backward`` and ``step`` below), over the two stores a
stage composes: a gradient store (``grads.FullGrads`` or ``grads.FusedGrads``) and a parameter
store (``params.ReplicatedParams``, ``params.GatheredParams`` or ``stage3_p.Units``), with
Megatron-LM's start/finish pairs:

    backward  params.pre_backward()        stage 3: the root gathered, the last blocks prefetched
              loss.backward()              hooks: grads.add(p); a complete bucket's sync starts
              grads.start_grad_sync(last)  the buckets backward left incomplete
              params.post_backward()       stage 3: every unit back to its shard
    step      params.finish_param_sync()   the last update's gathers landed
              grads.finish_grad_sync()     every bucket reduced: the owned gradients final
              norm, overflow, clip; AdamW  chunk by chunk, params.start_param_sync(i)
              params.start_param_sync()    what the update did not start (stages 1-2: the
                                           gathers, waited here unless overlap_param_gather)

Invariants: communication per step (§7) 2Ψ for stages 0-2, 3Ψ for stage 3 (less what stage 3
keeps gathered across the turn); memory per rank Table 1's
(``zero_repro.scale.paper.table1.model_state_bytes``). The overlap knobs
(``zero.overlap_param_gather``, ``prefetch_next_step``, ``keep_gathered_turn``) are bit-identical
on or off: whatever reads parameters outside forward waits first (``wait_params``), whatever
writes shards first settles what still reads them. Not overlapped, because it cannot be exact:
Adam per bucket as its reduction lands (the clip and the overflow skip need every bucket).
"""
from __future__ import annotations

import logging
from typing import Protocol

import torch
from torch import nn

from zero_repro.config import TrainConfig, ZeroConfig, ZeroRConfig
from zero_repro.runtime.comm import comm
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.comm.transport import bucket_transport
from zero_repro.runtime.zero.ledger import MemoryLedger
from zero_repro.runtime.zero import clip, precision
from zero_repro.runtime.zero.adam import ShardAdamW
from zero_repro.runtime.zero.flat_buffer import FlatParams
from zero_repro.runtime.zero.partition import counted_subranges

log = logging.getLogger(__name__)


class StepInfo:
    """What a step did: ``skipped`` (by every rank: a non-finite gradient somewhere),
    ``grad_norm`` (global, unscaled; inf on overflow, nan when not measured), ``loss_scale``
    (the scale this step's gradients carried). With ``agreed`` (the step's ``clip.Agreed``)
    the first two are read from the device when first asked: a caller that reads them once per
    window of steps lets the host run ahead of the GPU."""

    def __init__(self, skipped: bool = False, grad_norm: float = float("nan"),
                 loss_scale: float = 1.0, agreed: clip.Agreed | None = None):
        self._skipped, self._grad_norm, self.loss_scale = skipped, grad_norm, loss_scale
        self.agreed = agreed

    @property
    def skipped(self) -> bool:
        return self.agreed.overflow if self.agreed is not None else self._skipped

    @property
    def grad_norm(self) -> float:
        return self.agreed.norm if self.agreed is not None else self._grad_norm

    def __repr__(self) -> str:
        return (f"StepInfo(skipped={self.skipped}, grad_norm={self.grad_norm}, "
                f"loss_scale={self.loss_scale})")


class GradStore(Protocol):
    def add(self, p: nn.Parameter, last: bool) -> None: ...

    def start_grad_sync(self, last: bool) -> None: ...

    def finish_grad_sync(self) -> None: ...

    def chunks(self) -> list[torch.Tensor | None]: ...

    def zero(self) -> None: ...


class ParamStore(Protocol):
    def chunks(self) -> list[torch.Tensor]: ...

    def pre_backward(self) -> None: ...

    def post_backward(self) -> None: ...

    def start_param_sync(self, chunk: int | None = None) -> None: ...

    def finish_param_sync(self) -> None: ...

    def remove_hooks(self) -> None: ...


class Strategy:
    """What every stage shares: the step's lifecycle over the stage's two stores."""

    stage: int = -1
    grads: GradStore
    params: ParamStore

    def __init__(self, model: nn.Module, topo: Topology, zero: ZeroConfig, train: TrainConfig,
                 zero_r: ZeroRConfig | None = None):
        """The parts every stage shares; a stage's own ``__init__`` then builds its stores
        and finishes with ``_compose``."""
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
        self.transport = bucket_transport(self.dp_group, self.device)
        # C_B (§6.3): (R, A) elements per gradient / gather bucket; off: one bucket per group
        # (the fused buffer grows with the model, the parameters gathered un-bucketed)
        self.buckets = ((zero.reduce_bucket_size, zero.allgather_bucket_size)
                        if self.zero_r.constant_buffers else (1 << 62, 1 << 62))
        # fused gradient buffers a stage keeps: one filling + one on the wire (C_B off: one)
        self.fused_depth = 2 if self.zero_r.constant_buffers else 1
        self._micro = 0
        self._is_last = True

    def _compose(self, params: ParamStore, grads: GradStore, groups: list[FlatParams],
                 shard_rank: int, counts_norm: bool) -> None:
        """Shared end of every stage's ``__init__``: its two stores, the fp32 optimizer state
        over the owned chunks (one per bucket), the gradient-norm ranges, the gradient hooks.

        ``shard_rank``: which chunk of each bucket this rank owns (0 when nothing is sharded);
        ``counts_norm``: whether this DP rank's gradient elements enter the global norm."""
        self.params, self.grads, self.groups = params, grads, groups
        self.shard_rank = shard_rank
        self._counted = self._counted_ranges(self.module, counts_norm)
        chunks, base = [], 0
        for g in self.groups:
            chunks += [(base + b.shard_offset, b.chunk) for b in g.partition.buckets]
            base += g.partition.shard_numel
        self.opt = ShardAdamW(chunks, params.chunks(), precision.needs_master(self.zero.dtype))
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for _, p in self.named]

    def _on_grad(self, p: torch.Tensor) -> None:
        self.grads.add(p, self._is_last)

    def _ledger(self, ledger: MemoryLedger) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ the lifecycle
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    __call__ = forward

    def backward(self, loss: torch.Tensor, is_last_micro_batch: bool | None = None) -> None:
        self._micro += 1
        if is_last_micro_batch is None:
            is_last_micro_batch = self._micro >= self.train.grad_accum
        self._is_last = is_last_micro_batch
        self.params.pre_backward()
        # fp32 product: an fp16 loss times 2^16 would overflow before backward even starts
        (loss.float() * (self.scaler.scale / self.train.grad_accum)).backward()
        self.grads.start_grad_sync(self._is_last)
        self.params.post_backward()

    def step(self) -> StepInfo:
        self.params.finish_param_sync()
        self.grads.finish_grad_sync()
        scale = self.scaler.scale
        grads = self.grads.chunks()
        agreed, mult = None, 1.0 / scale
        if self.measure_grad_norm or self.zero.grad_clip > 0 or \
                isinstance(self.scaler, precision.DynamicLossScaler):
            stats = clip.local_stats(grads, self._counted, 1.0 / scale, self.device)
            agreed = clip.agree(stats, self.topo.world)  # device values: no host read here
            mult = clip.grad_multiplier(agreed, self.zero.grad_clip, scale)
        # dynamic scaling: decided when the next backward reads the scale
        self.scaler.update(agreed if agreed is not None else False)
        t = self.train
        # an overflow (agreed by every rank) skips the update on the device: parameters, Adam
        # state and step count unchanged, the publish below moves the unchanged values
        self.opt.step(self.params.chunks(), grads, mult, t.lr, (t.beta1, t.beta2), t.eps,
                      t.weight_decay, on_chunk=self.params.start_param_sync,
                      found_inf=None if agreed is None else agreed.found_inf)
        self.params.start_param_sync()
        if agreed is not None:
            agreed.forget_device()  # nothing of the step's device scalars outlives it
        self._micro = 0
        return StepInfo(loss_scale=scale, agreed=agreed)

    def zero_grad(self) -> None:
        self.grads.zero()

    def wait_params(self) -> None:
        """Block until the module's parameters hold the current values (an overlapped
        all-gather of the last step has landed). Forward waits by itself."""
        self.params.finish_param_sync()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.params.remove_hooks()

    def memory_ledger(self) -> MemoryLedger:
        """Bytes this rank holds per category: what is allocated (transient categories: their
        peak), including the transport's own (``comm_buffers``)."""
        ledger = MemoryLedger()
        for k, v in self.opt.nbytes().items():
            ledger.add(k, v)
        self._ledger(ledger)
        ledger.add("comm_buffers", self.transport.held_bytes())
        return ledger

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """This TP rank's parameters, unsharded over DP, in fp32 (from the master shard)."""
        self.wait_params()  # the gathers below are issued after the step's, in the same order
        out, i = {}, 0
        lp_chunks = self.params.chunks()
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
        lp_chunks = self.params.chunks()
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
        self.params.finish_param_sync()
        base, i = 0, 0
        lp_chunks = self.params.chunks()
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
        self.params.start_param_sync()

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

