"""DeepSpeed 0.2's ZeRO-DP build and gradient path (ZeRO-100B, paper §5 P_os / P_os+g, §6.2 C_B,
§6.3 M_D) as the allocation sequence it performed, for the ``paper2020`` stack of the dry run.

Not a formula: ``DeepSpeed02`` runs the same sequence of tensor allocations and frees on the
model's (fake) parameters that DeepSpeed@f2ac7eafd ran on the GPU, so the caching-allocator
replay of ``dryrun.allocator`` sees the real order (which blocks are cached when what is
requested). Sources, DeepSpeed@f2ac7eafd:deepspeed/pt/:

build (``deepspeed_light.py`` _configure_distributed_model L452-468: every parameter broadcast
  over DP; ``deepspeed_zero_optimizer.py`` __init__, stage 2):
  per-parameter fp16 tensors exist (Megatron: model.half() then .cuda(), DSE@405ce794
  pretrain_gpt2.py; the fp32-first build of DSE@07d1ce0d is the dry run's model builder's,
  switch ``fp32_model_on_gpu_before_half``) -> every fp16 parameter moved to the host (a
  blocking copy; its device block is freed and stays cached) -> one flat fp16 buffer, padded to
  N_d, copied back to the device -> the fp32 master partition as clone().float() of this rank's
  fp16 partition (a 2Ψ/N_d fp16 transient) -> initialize_optimizer_states: a zero gradient
  partition (f2ac7eafd L349-363: fp32, 4Ψ/N_d; e67a3def0 L352-366: fp16, 2Ψ/N_d), Adam's
  exp_avg and exp_avg_sq (8Ψ/N_d), the gradient freed.
  Stage 1 (``zero_optimizer_stage1.py``) flattens on the device while the per-parameter
  tensors are still alive (peak 4Ψ during the build), then frees them; with
  ``stage1_interval_layout`` its whole path is ``deepspeed02_stage1.Stage1Intervals``.
backward (stage 2, contiguous_gradients=True, overlap_comm=False, reduce_scatter=True):
  one ipg bucket of ``reduce_bucket_size`` fp16 elements allocated at ``backward()``; every
  autograd gradient (a fresh per-parameter tensor) is copied into it and freed; a full bucket
  is reduced (one dist.reduce per destination rank, in place) and the gradients of this
  rank's parameters are copied into ``grads_in_partition`` (allocated at the first copy of
  each backward: whole parameters overlapping the partition, ~2Ψ/N_d); the bucket is
  released at the end of backward (cached).
step (stage 2, ``stage2_step``): the overflow check and the norm read every gradient of the
  partition (an fp32 / fp64 copy each, then ``.item()``); 'e67a3def0': an fp16 flat copy of the
  gradient partition (2Ψ/N_d), the partition released, a fused Adam writing the fp16
  parameters, the flat copy alive until the step returns; 'f2ac7eafd': the flat copy cast to
  fp32 (4Ψ/N_d) while the fp16 partition still lives (8Ψ/N_d at that moment), the partition
  released, Adam, fp32 -> fp16 copy, the fp32 copy alive until the step returns; then
  all_gather per ``allgather_bucket_size`` shard with PyTorch 1.x NCCL's flattened list output.
backward/step (stage 1): per-parameter gradients (2Ψ) stay; after backward every rank's
  sub-partitions are flattened (2Ψ) and reduce-scattered per 5e8-element interval (an input
  flatten of one interval per call); the step flattens this rank's sub-partitions to fp32.

Host tensors (the parameters moved to the CPU) are reported in ``host_tensors`` so the dry run
excludes them from device numbers, as it does for P_a+cpu. Synchronisation points
(``streams.sync``) mark where the 2020 code blocked the host (switch
``collective_stream_reuse``).
"""
from __future__ import annotations

import math

import torch

from zero_repro.runtime.comm import comm
from zero_repro.runtime.zero.ledger import MemoryLedger
from zero_repro.scale.dryrun.stack import streams
from zero_repro.scale.dryrun.stack import switches as S
from zero_repro.scale.dryrun.stack.categories import category
from zero_repro.scale.dryrun.stack.deepspeed02_stage1 import Stage1Intervals


class DeepSpeed02:
    """The 2020 ZeRO-DP allocation sequence over ``params`` for DP group ``dp`` (stage 1 or 2).

    Call ``build()`` once, then per step ``backward_begin()``, ``grad_ready(i, grad)`` for each
    parameter's autograd gradient (e.g. from a post-accumulate-grad hook, in backward order),
    ``backward_end()``, ``step()``."""

    def __init__(self, params: list[torch.Tensor], dp: comm.Group, stage: int, stack: S.Stack):
        if stage not in (1, 2):
            raise ValueError(f"DeepSpeed 0.2 path models ZeRO stage 1 or 2, got {stage}")
        self.params, self.dp, self.stage, self.stack = list(params), dp, stage, stack
        self.n_d = dp.size
        self.numel = sum(p.numel() for p in self.params)
        self.padded = self.n_d * math.ceil(self.numel / self.n_d)
        self.part = self.padded // self.n_d
        self.lo = dp.rank * self.part
        self.host_tensors: list[torch.Tensor] = []
        self.flat = self.master = None
        self.adam: list[torch.Tensor] = []
        self.bucket = self.grads_in_partition = None
        self._buckets: list[torch.Tensor] = []
        self._which = 0
        self.grads: dict[int, torch.Tensor] = {}  # stage 1: per-parameter gradients
        self._fill = self._gip_fill = 0
        self._pending: list[tuple[int, int, int]] = []  # (parameter, bucket offset, numel)
        offs, o = [], 0
        for p in self.params:
            offs.append(o)
            o += p.numel()
        self.offsets = offs
        self.mine = [i for i, p in enumerate(self.params)
                     if offs[i] < self.lo + self.part and offs[i] + p.numel() > self.lo]

    # ------------------------------------------------------------------ build
    def build(self) -> None:
        with category(S.BUILD):
            if self.stage == 2 and self.stack.build_sequence:
                self._to_host()
        with category(S.FP16_PARAMS):
            self.flat = torch.empty(self.padded, dtype=self.params[0].dtype,
                                    device=self.params[0].device)
            for p, o in zip(self.params, self.offsets):
                self.flat[o:o + p.numel()].copy_(p.reshape(-1))
            if self.stage == 2 and self.stack.build_sequence:
                streams.sync("flat buffer .cuda(): a copy from pageable host memory")
            for p, o in zip(self.params, self.offsets):
                p.data = self.flat[o:o + p.numel()].view(p.shape)
        with category(S.MASTER_ADAM):
            half = self.flat[self.lo:self.lo + self.part].clone()
            self.master = half.float()
            del half
            # initialize_optimizer_states: one step on a zero gradient (fp16 at e67a3def0,
            # fp32 otherwise), then freed
            dtype = self.flat.dtype if self.stack.stage2_step == "e67a3def0" else torch.float32
            grad = torch.zeros(self.part, dtype=dtype, device=self.master.device)
            self.adam = [torch.zeros_like(self.master), torch.zeros_like(self.master)]
            del grad

    def release_host(self) -> None:
        """Drop the host copies of the fp16 parameters (kept after ``build`` only so that the
        dry run can mark their storages as host memory)."""
        self.host_tensors.clear()

    def _to_host(self) -> None:
        for p in self.params:  # move_to_cpu: the device block is freed (and stays cached)
            host = torch.empty_like(p)
            host.copy_(p)
            streams.sync("move_to_cpu: .cpu() blocks the host")
            self.host_tensors.append(host)
            p.data = host

    # ------------------------------------------------------------------ backward
    def backward_begin(self) -> None:
        if self.stage == 2:
            # one ipg bucket; with the switch off, DeepSpeed's other mode (overlap_comm): two,
            # filled alternately
            n = 1 if self.stack.stage2_single_ipg_bucket else 2
            with category(S.BUCKETS):
                self._buckets = [torch.empty(self.stack.stage2_reduce_bucket_size,
                                             dtype=self.flat.dtype, device=self.flat.device)
                                 for _ in range(n)]
            self._which = 0
            self.bucket = self._buckets[0]
            self._fill, self._pending = 0, []

    def grad_ready(self, i: int, grad: torch.Tensor) -> None:
        """Parameter ``i``'s autograd gradient exists (it is freed by the caller afterwards
        unless this path keeps it)."""
        if self.stage == 1:
            self.grads[i] = grad  # stage 1 keeps every per-parameter gradient
            return
        n = grad.numel()
        if self._fill + n > self.bucket.numel():
            self._reduce_bucket()
        self.bucket[self._fill:self._fill + n].copy_(grad.reshape(-1))
        self._pending.append((i, self._fill, n))
        self._fill += n

    def _reduce_bucket(self) -> None:
        pending = self._pending
        if self._fill:
            comm.reduce(self.bucket[:self._fill], 0, self.dp)  # per destination rank, in place
        for i, start, n in pending:
            if i in self.mine:
                if self.grads_in_partition is None:
                    with category(S.GRAD_PARTITION):
                        total = sum(self.params[j].numel() for j in self.mine)
                        self.grads_in_partition = torch.empty(total, dtype=self.flat.dtype,
                                                              device=self.flat.device)
                    self._gip_fill = 0
                dst = self.grads_in_partition[self._gip_fill:self._gip_fill + n]
                dst.copy_(self.bucket[start:start + n])
                self._gip_fill += n
        self._pending, self._fill = [], 0
        self._which = (self._which + 1) % len(self._buckets)
        self.bucket = self._buckets[self._which]

    def backward_end(self) -> None:
        if self.stage == 2:
            self._reduce_bucket()
            self.bucket, self._buckets = None, []  # _release_ipg_buffers
            return
        self._stage1_reduce_scatter()

    def _stage1_reduce_scatter(self) -> None:
        with category(S.BUCKETS):
            if self.stack.stage1_flatten_reduce_scatter:
                flat = torch.empty(self.padded, dtype=self.flat.dtype, device=self.flat.device)
                for i, o in enumerate(self.offsets):
                    g = self.grads.get(i)
                    if g is not None:
                        flat[o:o + g.numel()].copy_(g.reshape(-1))
            else:  # switch off: the intervals are staged from the flat parameter geometry only
                flat = self.flat
            step = max(1, self.stack.stage1_max_elements_per_comm)
            out = torch.empty(math.ceil(min(step, self.padded) / self.n_d), dtype=flat.dtype,
                              device=flat.device)
            for lo in range(0, self.padded, step):
                chunk = flat[lo:min(lo + step, self.padded)]
                if chunk.numel() % self.n_d:
                    continue  # the tail interval is padded in DeepSpeed; bytes negligible
                staged = chunk.clone()  # PyTorch 1.x NCCL: list inputs flattened per call
                comm.reduce_scatter_into(out[:chunk.numel() // self.n_d], staged, self.dp)
                del staged
            del flat, out

    # ------------------------------------------------------------------ step
    def _adam(self, lo: int, g32: torch.Tensor) -> None:
        """Adam's tensor traffic on master[lo:lo+len(g32)], in place (fake tensors: values do
        not matter, only that nothing is allocated)."""
        n = min(g32.numel(), self.part - lo)  # whole parameters may overhang the partition
        g32 = g32[:n]
        m, v = (t[lo:lo + n] for t in self.adam)
        master = self.master[lo:lo + n]
        m.mul_(0.9).add_(g32, alpha=0.1)
        v.mul_(0.999).addcmul_(g32, g32, value=0.001)
        # DeepSpeed 0.2 ran apex's FusedAdam (one multi-tensor kernel): no temporaries
        master.addcdiv_(m, v, value=-1e-4)

    def _per_tensor(self, dtype: torch.dtype) -> None:
        """The overflow check (``_has_inf_or_nan``: ``x.float()``, f2ac7eafd L1229) or the
        gradient norm (``g.double().norm(2)``, L952) of each gradient in the partition, one
        tensor at a time, each read back with ``.item()`` (L953, L1229)."""
        src = self.grads_in_partition
        if src is None:
            return
        at = 0
        for i in self.mine:
            n = self.params[i].numel()
            x = src[at:at + n].to(dtype)
            s = x.sum()
            del x, s
            streams.sync("ZeRO step .item()")
            at += n

    def step(self) -> None:
        commit = self.stack.stage2_step if self.stage == 2 else "none"
        with category(S.STEP_TEMP):
            if commit != "none":
                self._per_tensor(torch.float32)  # has_overflow (L1034, L1197-1220)
                self._per_tensor(torch.float64)  # get_grad_norm_direct (L1062-1064)
            if self.stage == 2:
                src = self.grads_in_partition
                self.grads_in_partition = None
            else:
                src = torch.cat([self.grads[i].reshape(-1) for i in self.mine])
                self.grads.clear()
            if commit == "e67a3def0":
                kept = src.clone()  # _flatten_dense_tensors(averaged_gradients) (L1350)
                del src  # L1406-1408: the gradients freed
                streams.sync("optimizer_step timer start")
                self._adam(0, kept)  # fused Adam: fp16 grads in, fp16 params out
                streams.sync("optimizer_step timer stop")
            elif commit == "f2ac7eafd":
                flat16 = src.clone()  # _flatten_dense_tensors(averaged_gradients) (L1078)
                kept = flat16.float()  # .to(fp32) while the fp16 partition lives
                del flat16, src  # L1086-1088: the fp16 partition freed
                streams.sync("optimizer_step timer start")
                self._adam(0, kept)
                self.flat[self.lo:self.lo + self.part].copy_(self.master)  # L1100-1102
                streams.sync("optimizer_step timer stop")
            else:
                kept = None
                if self.stage == 1:  # the legacy stage-1 path (stage1_interval_layout off)
                    flat16 = src.clone()
                    del src
                    g32 = flat16.float()
                    del flat16
                    self._adam(0, g32)
                    del g32
                else:  # modern: the update upcasts one all-gather shard at a time
                    step = self.stack.allgather_bucket_size or int(5e8)
                    for lo in range(0, min(src.numel(), self.part), step):
                        g32 = src[lo:lo + step].float()
                        self._adam(lo, g32)
                        del g32
                    del src
                self.flat[self.lo:self.lo + self.part].copy_(self.master)
        with category(S.GATHER):
            if self.stage == 2:
                streams.sync("optimizer_allgather timer start")
            shard = self.stack.allgather_bucket_size or int(5e8)
            n_shards = max(1, self.part * self.n_d // shard)
            size = math.ceil(self.part / n_shards)
            for k in range(n_shards):
                lo = k * size
                n = min(size, self.part - lo)
                if n <= 0:
                    break
                staged = torch.empty(n * self.n_d, dtype=self.flat.dtype,
                                     device=self.flat.device)  # NCCL list-output flatten
                comm.all_gather_into(staged, self.flat[self.lo + lo:self.lo + lo + n], self.dp)
                del staged
            if self.stage == 2:
                streams.sync("optimizer_allgather timer stop")
        del kept  # the step's local list of gradient partitions, freed at its return

    def ledger_sizes(self) -> dict:
        """Bytes of the model states as this path holds them between steps."""
        elt = self.flat.element_size()
        return {"params_lp": self.flat.numel() * elt,
                "grads": (self.part if self.stage == 2 else self.numel) * elt,
                "master_fp32": self.master.numel() * 4, "adam_m": self.adam[0].numel() * 4,
                "adam_v": self.adam[1].numel() * 4,
                "comm_buffers": self.stack.stage2_reduce_bucket_size * elt
                if self.stage == 2 else 0}


class DeepSpeed02Strategy:
    """The ``zero.strategy.Strategy`` interface that ``train.step.train_step`` and the dry run
    drive (``module``, ``backward``, ``step``, ``zero_grad``, ``memory_ledger``), backed by the
    ``DeepSpeed02`` allocation sequence instead of the runtime's stage 1/2 buffers. Built by
    ``train.build.build`` (``make_strategy``) after activation checkpointing, like a stage.

    Gradients: a post-accumulate-grad hook hands each parameter's autograd gradient to
    ``DeepSpeed02.grad_ready`` and drops ``p.grad`` (DeepSpeed's hooks did the same: the
    gradient lives on only inside the path's own tensors). The loss is scaled in fp32 as
    DeepSpeed's FP16 optimizer did (``loss.float() * loss_scale``). Stage 1 with
    ``stage1_interval_layout``: ``deepspeed02_stage1.Stage1Intervals``. The engine's own
    synchronisation points (DeepSpeed's timers, ``streams``) are marked here: forward start and
    end (hooks on the model), backward start, after autograd, after the gradient reduction,
    step start and end."""

    def __init__(self, model: torch.nn.Module, topo, cfg, stack: S.Stack):
        self.module = model
        self.stage = cfg.zero.stage
        self.params = [p for p in model.parameters() if p.requires_grad]
        if stack.build_sequence:  # deepspeed_light.py L466-468: every parameter broadcast
            for p in self.params:
                comm.broadcast(p.detach(), 0, topo.dp_group)
        if self.stage == 1 and stack.stage1_interval_layout:
            self.ds = Stage1Intervals(self.params, topo.dp_group, stack)
        else:
            self.ds = DeepSpeed02(self.params, topo.dp_group, self.stage, stack)
        self.ds.build()
        self.host_tensors = self.ds.host_tensors  # the dry run marks them, then releases them
        self.loss_scale = float(2 ** cfg.zero.initial_scale_power)
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        self._hooks += [model.register_forward_pre_hook(_sync_hook("forward timer start")),
                        model.register_forward_hook(_sync_hook("forward timer stop"))]
        self.groups: list = []  # no runtime flat-buffer groups
        self.psi_padded = self.ds.padded
        if self.stage == 2:
            self.n_buckets = 1
        elif isinstance(self.ds, Stage1Intervals):
            self.n_buckets = self.ds.n_int
        else:
            self.n_buckets = math.ceil(self.ds.padded / max(1, stack.stage1_max_elements_per_comm))

    def release_host(self) -> None:
        self.ds.release_host()

    def _on_grad(self, p: torch.Tensor) -> None:
        self.ds.grad_ready(self._index[id(p)], p.grad)
        p.grad = None

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        streams.sync("backward timer start")
        self.ds.backward_begin()
        (loss.float() * self.loss_scale).backward()
        streams.sync("backward_inner timer stop")
        self.ds.backward_end()
        streams.sync("backward_allreduce timer stop")

    def step(self):
        streams.sync("step timer start")
        self.ds.step()
        streams.sync("step timer stop")
        return None

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def memory_ledger(self) -> MemoryLedger:
        """Model states as DeepSpeed 0.2 holds them between steps (bytes)."""
        led = MemoryLedger()
        for name, nbytes in self.ds.ledger_sizes().items():
            led.add(name, nbytes)
        return led


def _sync_hook(where: str):
    def hook(*_args):
        streams.sync(where)
    return hook


def make_strategy(stack: S.Stack):
    """``train.build.build``'s ``make_strategy`` for ``stack`` (stages 1 and 2)."""
    def _make(model, topo, cfg):
        return DeepSpeed02Strategy(model, topo, cfg, stack)
    return _make


def uses_deepspeed02(stack: S.Stack, stage: int) -> bool:
    """Whether the dry run drives DeepSpeed 0.2's ZeRO-DP path for ``stage`` under ``stack``
    (it models stages 1 and 2 only; ZeRO-100B had no stage 3)."""
    if stage == 1:
        return (stack.build_sequence or stack.stage1_per_param_grads
                or stack.stage1_interval_layout)
    return stage == 2 and (stack.build_sequence or stack.stage2_single_ipg_bucket
                           or stack.stage2_step != "none")
