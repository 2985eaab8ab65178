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
(``backward(loss, is_last_micro_batch=...)`` or ``with strategy.no_sync():`` override the
micro-batch count). Torch's own way works too: several ``backward`` calls before ``step()``
with ``grad_accum=1`` (each then the "last") sum their gradients, as DDP does: a backward after
a reduced one carries the reduced sum into the next reduction (``grads.FullGrads``).

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

With ``zero.offload_optimizer=cpu`` the optimizer is ``offload.HostAdamW`` (host memory, host
step) and every stage's gradient store is the fused-bucket one (``_fused_grads``) whose reduced
chunks are copied into the host's staging as they land (``offload.HostGradShards``): the device
keeps the parameters and the fused buffers only; the norm, the overflow check and the clip read
the host's chunks; the step is the same sequence.

Hierarchical sharding (``zero.shard_size`` = G, FSDP2's HSDP; ``Topology.dp_mesh``): stages
1-3 partition, gather and reduce-scatter over the mesh's shard group (G ranks) and the gradient
store sums the owned chunks over its replicate group (N_d/G ranks) in ``finish_grad_sync``; the
mean still divides by N_d, the norm counts the first replica's shard only, and the stores never
see N_d but through the mesh. G = N_d (default) is plain ZeRO, unchanged.

Invariants: communication per step (§7) 2Ψ for stages 0-2, 3Ψ for stage 3 (less what stage 3
keeps gathered across the turn); memory per rank Table 1's
(``zero_repro.scale.paper.table1.model_state_bytes``). The overlap knobs
(``zero.overlap_param_gather``, ``prefetch_next_step``, ``keep_gathered_turn``) are bit-identical
on or off: whatever reads parameters outside forward waits first (``wait_params``), whatever
writes shards first settles what still reads them. Not overlapped, because it cannot be exact:
Adam per bucket as its reduction lands (the clip and the overflow skip need every bucket).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Callable, Protocol

import torch
from torch import nn

from zero_repro.config import TrainConfig, ZeroConfig, ZeroRConfig
from zero_repro.runtime.comm.topology import Topology
from zero_repro.runtime.comm.transport import bucket_transport
from zero_repro.runtime.model.tp import reads_row_source
from zero_repro.runtime.zero.ledger import MODEL_STATE_CATEGORIES, MemoryLedger
from zero_repro.runtime.zero import clip, full_params, precision
from zero_repro.runtime.zero import units as U
from zero_repro.runtime.zero.adam import ShardAdamW
from zero_repro.runtime.zero.build_init import Init, materialize_buffers, resolve_init
from zero_repro.runtime.zero.flat_buffer import FlatParams
from zero_repro.runtime.zero.guard import ParamGuard, unguarded
from zero_repro.runtime.zero.grads import FusedGrads
from zero_repro.runtime.zero.offload import HostAdamW, HostGradShards
from zero_repro.runtime.zero.optim import OptimizerArg, TorchShardOptimizer
from zero_repro.runtime.zero.partition import counted_subranges, intersect

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
    offload = False  # ZeRO-Offload: the optimizer on the host (``zero.offload_optimizer``)
    grads: GradStore
    params: ParamStore

    def __init__(self, model: nn.Module, topo: Topology, zero: ZeroConfig, train: TrainConfig,
                 zero_r: ZeroRConfig | None = None, *, units: U.Units = None,
                 optimizer: OptimizerArg | None = None, device: torch.device | str | None = None,
                 init: Init | None = None):
        """The parts every stage shares; a stage's own ``__init__`` then builds its stores
        and finishes with ``_compose``. Keywords: ``build_strategy``'s."""
        self.module = model
        self.topo, self.zero, self.train = topo, zero, train
        # None = the C_B and M_D behaviour ZeRO recommends (constant buffers, contiguous grads)
        self.zero_r = zero_r or ZeroRConfig(constant_buffers=True, contiguous_memory=True)
        self.dp_group = topo.dp_group
        # N_d (all DP ranks: the gradient mean's divisor) and this rank among them
        self.n_d, self.dp_rank = self.dp_group.size, self.dp_group.rank
        # the DP mesh (``zero.shard_size``, HSDP): the states are sharded over mesh.shard (G
        # ranks) and kept by each of mesh.replicate's R = N_d / G ranks; plain ZeRO: G = N_d
        # (hpZ, ``zero.hpz``: plain ZeRO's mesh; stage 3 adds its secondary over G)
        self.mesh = topo.dp_mesh("all" if zero.hpz else zero.shard_size)
        self.dtype = precision.lp_dtype(zero.dtype)
        self.scaler = precision.build_scaler(zero)
        # the global gradient norm (and its non-finite check) each step: needed to clip and to
        # scale dynamically, logged otherwise; a caller that logs nothing (the peers race, whose
        # DDP / FSDP2 compute none) may turn it off where neither needs it
        self.measure_grad_norm = True
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
        self.names = [n for n, _ in self.named]
        self.units_spec, self.make_optimizer = units, optimizer
        # the ranks' device (every buffer the strategy makes goes there: GPU runs, meta dry
        # runs); a model built on the meta device is materialised there (partitioned
        # construction: ``init`` fills each group as it is placed)
        first = next(iter(model.parameters()), None)
        self.device = torch.device(device) if device is not None else \
            first.device if first is not None else torch.device("cpu")
        self.init = resolve_init(model, init, self.device)
        self.transport = bucket_transport(self.mesh.shard, self.device)
        # the replicas' all-reduce of each owned gradient chunk (none without replicas)
        self.replicas = bucket_transport(self.mesh.replicate, self.device) \
            if self.mesh.replicas > 1 else None
        # C_B (§6.3): (R, A) elements per gradient / gather bucket; off: one bucket per group
        # (the fused buffer grows with the model, the parameters gathered un-bucketed)
        self.buckets = ((zero.reduce_bucket_size, zero.allgather_bucket_size)
                        if self.zero_r.constant_buffers else (1 << 62, 1 << 62))
        # fused gradient buffers a stage keeps: one filling + one on the wire (C_B off: one)
        self.fused_depth = 2 if self.zero_r.constant_buffers else 1
        self._micro = 0
        self._is_last = True
        self._no_sync = False  # inside no_sync(): no backward is the last micro-batch

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
        # stage 3 with its parameter shard on the host (zero.offload_param) and the optimizer
        # on the device: an fp32 master on the device also in fp32 training
        keep_master = precision.needs_master(self.zero.dtype) or bool(getattr(params, "host", 0))
        self.offload = self.zero.offload_optimizer == "cpu"
        if self.offload:
            self._check_offload()
            self.opt = HostAdamW(chunks, params.chunks(), self.dtype)
            # each gradient chunk leaves for the host as soon as its reduction lands
            grads.shards.bind(self.opt)
        elif self.make_optimizer is None:
            self.opt = ShardAdamW(chunks, params.chunks(), keep_master, device=self.device)
        else:
            self.opt = TorchShardOptimizer(self.make_optimizer, chunks, params.chunks(),
                                           keep_master, self._parts(chunks), self.named,
                                           self.frozen, device=self.device)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for _, p in self.named]
        if self.init is not None:
            materialize_buffers(self.module, self.device, self.init)
        self.guard = ParamGuard(self.stage, {id(p): n for n, p in self.named + self.frozen},
                                freed=getattr(params, "freed", None),
                                passes=reads_row_source)
        self.guard.install(p for _, p in self.named + self.frozen)

    def _check_offload(self) -> None:
        """ZeRO-Offload runs the built-in AdamW on the host shard (``offload``), at stages
        1-3 and at stage 0 on one DP rank."""
        if self.make_optimizer is not None:
            raise ValueError("zero.offload_optimizer=cpu steps the built-in AdamW on the host "
                             "(train.lr, beta1/beta2, eps, weight_decay); build_strategy("
                             "optimizer=...) is not supported with it: drop optimizer= or set "
                             "zero.offload_optimizer=none")
        if self.replicas is not None:
            raise ValueError(f"zero.offload_optimizer=cpu with zero.shard_size="
                             f"{self.zero.shard_size} (replicated shards) is not supported: "
                             f"drop zero.shard_size or zero.offload_optimizer")
        if self.stage == 0 and self.n_d > 1:
            raise ValueError(f"zero.offload_optimizer=cpu at zero.stage=0 with DP {self.n_d} "
                             f"keeps the whole optimizer on every rank's host: use zero.stage=1 "
                             f"or 2 (each rank's host then holds 1/{self.n_d} of it)")

    def _fused_grads(self, groups: list[FlatParams],
                     on_filled: Callable[[int], None] | None = None) -> FusedGrads:
        """The fused-bucket gradient store over ``groups`` (stages 2-3; every stage with
        ZeRO-Offload, whose reduced chunks go to the host as they land and whose device keeps
        no gradient store: ``offload.HostGradShards``)."""
        host = HostGradShards() if self.zero.offload_optimizer == "cpu" else None
        return FusedGrads(groups, self.n_d, self.mesh.shard.rank, self.transport,
                          self.fused_depth, self.zero_r.contiguous_memory, self.device,
                          on_filled=on_filled, shards=host, replicas=self.replicas)

    def _place_frozen(self) -> FlatParams | None:
        """Stages 0-2: the frozen parameters, whole on every rank in the training dtype, in
        one flat buffer of their own (no gradient, no optimizer state)."""
        if not self.frozen:
            return None
        return FlatParams("frozen", self.frozen, self.dtype, 1, (1 << 62, 1 << 62),
                          device=self.device, copy=self.init is None)

    def _parts(self, chunks: list[tuple[int, int]]) -> list[tuple[str, int, int]]:
        """(parameter name, shard offset, length) of every run of the shard that holds one
        parameter's elements within one bucket, in shard order (``optim``)."""
        out, i = [], 0
        for g in self.groups:
            for b in g.partition.buckets:
                lo, hi = b.owned(self.shard_rank)
                at = chunks[i][0]
                for sl in g.slots:
                    r = intersect(sl.offset, sl.end, lo, hi)
                    if r is not None:
                        out.append((sl.name, at + r[0] - lo, r[1] - r[0]))
                i += 1
        return out

    def _on_grad(self, p: torch.Tensor) -> None:
        with unguarded():  # the runtime's own read of p.grad
            self.grads.add(p, self._is_last)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer ``build_strategy(optimizer=...)`` made (attach an LR scheduler
        to it); the built-in AdamW has none."""
        if not isinstance(self.opt, TorchShardOptimizer):
            raise AttributeError(
                "strategy.optimizer: this strategy steps the built-in sharded AdamW "
                "(train.lr, beta1/beta2, eps, weight_decay), not a torch.optim.Optimizer; for a "
                "scheduler or param groups pass build_strategy(..., optimizer=lambda params: "
                "torch.optim.AdamW(params, ...))")
        return self.opt.optimizer

    def _ledger(self, ledger: MemoryLedger) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ the lifecycle
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    __call__ = forward

    def backward(self, loss: torch.Tensor, is_last_micro_batch: bool | None = None) -> None:
        self._micro += 1
        if is_last_micro_batch is None:
            is_last_micro_batch = not self._no_sync and self._micro >= self.train.grad_accum
        self._is_last = is_last_micro_batch
        self.params.pre_backward()
        # fp32 product: an fp16 loss times 2^16 would overflow before backward even starts
        (loss.float() * (self.scaler.scale / self.train.grad_accum)).backward()
        self.grads.start_grad_sync(self._is_last)
        self.params.post_backward()
        self.guard.grads_elsewhere = True

    def step(self) -> StepInfo:
        if getattr(self.params, "pinned", 0):
            raise RuntimeError("strategy.step() inside 'with strategy.gathered():' would leave "
                               "the gathered copies stale; step after the block")
        self.guard.grads_elsewhere = False
        self.params.finish_param_sync()
        self.grads.finish_grad_sync()
        scale = self.scaler.scale
        grads = self.grads.chunks()
        agreed, mult = None, 1.0 / scale
        if self.measure_grad_norm or self.zero.grad_clip > 0 or \
                isinstance(self.scaler, precision.DynamicLossScaler):
            stats = clip.local_stats(grads, self._counted, 1.0 / scale, self.device)
            stats = stats.to(self.device)  # offload: computed from the host's chunks
            agreed = clip.agree(stats, self.topo.world)  # device values: no host read here
            mult = clip.grad_multiplier(agreed, self.zero.grad_clip, scale)
        # dynamic scaling: decided when the next backward reads the scale
        self.scaler.update(agreed if agreed is not None else False)
        t = self.train
        if self.offload:
            # the host steps on the host: it reads the agreed decision there (one wait, for
            # numbers the host needs before it starts anyway)
            lp, publish = self.params.chunks(), self.params.start_param_sync
            if agreed is not None and agreed.overflow:
                self.opt.settle(lp, publish)  # a delayed update still lands
                self.opt.discard()  # the gradients staged on the host are not used
            else:
                coef = 1.0 if agreed is None else clip.clip_coef(agreed.norm, self.zero.grad_clip)
                delayed = self.zero.offload_dpu and \
                    self.opt.step_count >= self.zero.offload_dpu_warmup
                if not delayed:
                    self.opt.settle(lp, publish)
                (self.opt.step_delayed if delayed else self.opt.step)(
                    lp, grads, coef / scale, t.lr, (t.beta1, t.beta2), t.eps, t.weight_decay,
                    on_chunk=publish)
        else:
            # an overflow (agreed by every rank) skips the update on the device: parameters,
            # Adam state and step count unchanged, the publish below moves the unchanged values
            self.opt.step(self.params.chunks(), grads, mult, t.lr, (t.beta1, t.beta2), t.eps,
                          t.weight_decay, on_chunk=self.params.start_param_sync,
                          found_inf=None if agreed is None else agreed.found_inf)
        self.params.start_param_sync()
        if agreed is not None:
            agreed.forget_device()  # nothing of the step's device scalars outlives it
        self._micro = 0
        return StepInfo(loss_scale=scale, agreed=agreed)

    def zero_grad(self) -> None:
        self.guard.grads_elsewhere = False
        self.grads.zero()
        if self.offload:
            self.opt.discard()

    def wait_params(self) -> None:
        """Block until the module's parameters hold the current values (an overlapped
        all-gather of the last step has landed; ``zero.offload_dpu``: the delayed update in
        flight lands now). Forward waits by itself (for the gathers, not the delayed update)."""
        if self.offload and self.opt.settle(self.params.chunks(),
                                            self.params.start_param_sync):
            self.params.start_param_sync()
        self.params.finish_param_sync()

    def remove_hooks(self) -> None:
        """Detach the strategy from the model: gradient and module hooks, the parameters'
        guard (they are plain ``nn.Parameter``s again)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.params.remove_hooks()
        self.guard.remove()

    def memory_ledger(self) -> MemoryLedger:
        """Bytes this rank holds per category: what is allocated (transient categories: their
        peak), including the transport's own (``comm_buffers``)."""
        ledger = MemoryLedger()
        for k, v in self.opt.nbytes().items():
            if v or k in MODEL_STATE_CATEGORIES:
                ledger.add(k, v)
        self._ledger(ledger)
        ledger.add("comm_buffers", self.transport.held_bytes())
        if self.replicas is not None:
            ledger.add("comm_buffers", self.replicas.held_bytes())
        return ledger

    @contextlib.contextmanager
    def gathered(self, writeback: bool = False):
        """Every parameter whole on every rank inside the block (collective over the DP
        group): stage 3 gathers every unit (its vocabulary table too) and keeps it until the
        block ends, so the model can be inspected or run (``generate()``) as a plain module;
        stages 0-2 hold full parameters anyway. ``step()`` inside raises.

        ``writeback=False``: read-only, a write into a parameter inside raises
        (``guard.ParameterWriteError``). ``writeback=True`` (FSDP's ``summon_full_params(
        writeback=True)``, DeepSpeed's ``safe_set_full_fp32_param``): in-place writes are
        allowed, and when the block ends the written elements reach the fp32 master and the
        training-dtype shard at every stage (``full_params.write_back``), then the parameters
        are published again (stages 1-2 all-gather). Every rank must write the same values
        (as with DDP); a written element is taken in the training dtype; an exception inside
        skips the write-back."""
        self.wait_params()
        pin = getattr(self.params, "pin", None)
        if pin is not None:
            pin()
        was = self.guard.writable
        self.guard.writable = was or writeback
        done = False
        try:
            yield self.module
            done = True
        finally:
            self.guard.writable = was
            try:
                if done and writeback:
                    full_params.write_back(self)
            finally:
                if pin is not None:
                    self.params.unpin()
        if done and writeback:
            self.params.start_param_sync()

    @contextlib.contextmanager
    def no_sync(self):
        """DDP's and FSDP's ``no_sync``: each ``backward`` inside is not the step's last
        micro-batch, so stages 0-1 accumulate it locally without communicating; the first
        ``backward`` after the block reduces the sum. Stages 2-3 reduce-scatter every
        micro-batch into the gradient shard all the same (P_g keeps no full gradient to
        accumulate into locally: DeepSpeed's ZeRO-2 reduces every micro-batch too); the result
        is the same at every stage."""
        was = self._no_sync
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = was

    @torch.no_grad()
    def full_state_dict(self, dtype: torch.dtype | None = torch.float32,
                        rank0_only: bool = True, tp_full: bool = True) -> dict:
        """``full_params.full_state_dict``: the model's own ``state_dict()`` with every
        parameter whole, on the CPU (collective over the world; fp32 from the master by default;
        ``rank0_only``: other ranks get ``{}``)."""
        return full_params.full_state_dict(self, dtype, rank0_only, tp_full)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """This TP rank's parameters, unsharded over DP, in fp32 (``full_params``)."""
        return full_params.full_parameters(self)

    def state_names(self, requested: list[str] | None = None) -> list[str]:
        """The per-element states a ``state_dict`` holds: ``master`` and the optimizer's
        (AdamW: ``exp_avg``, ``exp_avg_sq``; a torch optimizer: what it has created, or
        ``requested``, e.g. a checkpoint's, to be filled by a load)."""
        if isinstance(self.opt, TorchShardOptimizer):
            return ["master", *(requested[1:] if requested else self.opt.state_keys())]
        return ["master", "exp_avg", "exp_avg_sq"]

    def state_dict(self, states: list[str] | None = None) -> dict:
        """Sharded optimizer state: per group the fp32 master and optimizer-state shards
        (``states``: ``state_names``) and the flat ranges they cover (``shard_ranges``:
        (flat_start, shard_start, length)), enough to reshard; a torch optimizer's scalar
        states and param groups under ``optim``."""
        self.wait_params()  # a checkpoint never races the step's all-gather
        names = self.state_names(states)
        custom = isinstance(self.opt, TorchShardOptimizer)
        shard = {k: (self.opt.shard_state(k) if custom else getattr(self.opt, k))
                 for k in names[1:]}
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
                "master": master.clone(),
                **{k: v[base:base + n].clone() for k, v in shard.items()}})
            base += n
            i += nb
        out = {"stage": self.stage, "dtype": self.zero.dtype, "dp_world": self.n_d,
               "dp_rank": self.dp_rank, "replica_rank": self.mesh.replicate.rank,
               "step": self.opt.step_count,
               "scaler": self.scaler.state_dict(), "groups": groups, "states": names}
        if custom:
            out["optim"] = {"scalars": self.opt.scalars(), "groups": self.opt.groups()}
        return out

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Load a state from ``state_dict`` of the same stage, layout and DP size."""
        if len(state["groups"]) != len(self.groups):
            raise ValueError("state_dict has a different number of flat groups; reshard first")
        names = state.get("states", ["master", "exp_avg", "exp_avg_sq"])
        custom = isinstance(self.opt, TorchShardOptimizer)
        if not custom and names != self.state_names():
            raise ValueError(f"the state holds {names[1:]}, the built-in AdamW exp_avg and "
                             f"exp_avg_sq: it was saved with another optimizer")
        self.wait_params()  # a delayed update in flight lands before the state is replaced
        base, i = 0, 0
        lp_chunks = self.params.chunks()
        for g, gs in zip(self.groups, state["groups"]):
            n = g.partition.shard_numel
            if gs["master"].numel() != n:
                raise ValueError(f"group {g.name}: shard of {gs['master'].numel()} elements, "
                                 f"expected {n}; reshard for a shard group of "
                                 f"{self.mesh.shard_size} first")
            if not custom:
                self.opt.exp_avg[base:base + n].copy_(gs["exp_avg"])
                self.opt.exp_avg_sq[base:base + n].copy_(gs["exp_avg_sq"])
            for b in g.partition.buckets:
                src = gs["master"][b.shard_offset:b.shard_offset + b.chunk]
                self.opt.master_chunk(i, lp_chunks[i]).copy_(src)
                lp_chunks[i].copy_(src)
                i += 1
            base += n
        if custom:
            optim = state.get("optim", {"scalars": {}, "groups": self.opt.groups()})
            shard = {k: torch.cat([gs[k] for gs in state["groups"]]).to(self.device)
                     for k in names[1:]}
            self.opt.load(shard, optim["scalars"], optim["groups"])
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

