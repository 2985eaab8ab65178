"""ZeRO-Offload's optimizer (Ren et al., 2021, "ZeRO-Offload: Democratizing Billion-Scale Model
Training", §4: the optimizer states and the update on the host, the forward and backward on the
device), ``HostAdamW``: the strategy's optimizer when ``zero.offload_optimizer=cpu``, with the
duck interface of ``adam.ShardAdamW`` (``step``, ``master_chunk``, ``nbytes``, ``exp_avg``,
``exp_avg_sq``, ``step_count``), so stages 0-3, the state dict and the checkpoint take it as
they are.

Memory per rank (lp bytes per training-dtype element, Ψ_s = this rank's shard: Ψ/N_d for
stages 1-3, Ψ at stage 0), host: fp32 master 4Ψ_s + m 4Ψ_s + v 4Ψ_s + the gradient/parameter
staging lp·Ψ_s = (12 + lp)Ψ_s (14Ψ/N_d at fp16/bf16; ledger ``master_fp32_host``,
``adam_m_host``, ``adam_v_host``, ``grads_host``) + one block of fp32 scratch
(``optim_step_host``, ``BLOCK`` elements); device: none of it, and no gradient store either
(``HostGradShards``: every stage reduces through fused buckets whose reduced chunks come here as
they land), so the device keeps the stage's lp parameters only -- lp·Ψ at stages 0-2, lp·Ψ/N_d
at stage 3, nothing with ``zero.offload_param`` -- plus the fused buffers (Table 1's offload
column, ``scale.paper.table1.offload_bytes``; §4.1: "only the fp16 parameters on the GPU"). The
master is kept also in fp32 training (the device holds the parameters, the host the copy it
updates). Only the staging is pinned (where CUDA is): it is the one buffer the copy engines read
and write.

Data flow per step (PCIe: lp·Ψ_s bytes each way):
  * device -> host: ``HostGradShards`` calls ``grad_ready(i, chunk)`` as soon as chunk i's
    reduction has landed (during backward, as the fused buffers are recycled; the last two
    at the step's start); the copy goes on a side stream into the staging and the compute
    stream waits for it before the buffer is filled again; a later micro-batch's chunk is
    added on the host (``grad_add``). The norm, the overflow check and the clip read the
    staged chunks (``staged_chunks``: two scalars go back to the device to be agreed).
  * host: per chunk, in blocks of ``BLOCK`` elements, the lp gradient upcast into the scratch
    and multiplied by unscale x clip, then torch's fused CPU AdamW (``torch._fused_adamw_``, the
    kernel ``AdamW(fused=True)`` runs on CPU tensors; elementwise: blocks of a multiple of the
    vector width change nothing, a block boundary elsewhere moves the kernel's scalar tail);
    the updated master cast into the staging chunk (the gradient there is consumed).
  * host -> device: the staging chunk onto the training-dtype chunk on a second side stream
    (the other direction's copy engine), the compute stream made to wait for it; then
    ``on_chunk(i)``, so the stage publishes chunk i (stages 1-2 all-gather it, stage 3
    prefetches) while chunk i+1 is updated on the host.
The same arithmetic as ``ShardAdamW``'s fused path (upcast, multiply, the same kernel, cast):
on one host bit-identical; on a GPU the CPU and CUDA kernels of AdamW may differ by rounding.
Without CUDA (this project's CPU ranks, the dry run's meta tensors) the copies are plain
copies. ``step_delayed`` is ZeRO-Offload's one-step delayed parameter update (§4.2,
``zero.offload_dpu``): the host step of step t overlaps step t+1's forward and backward, which
run on parameters one update old (it changes the arithmetic on purpose).
"""
from __future__ import annotations

import threading
from typing import Callable, Sequence

import torch

# host elements per fused-AdamW call and intra-op thread (a multiple of every vector width: the
# same values as one call per chunk): each thread's share of the fp32 scratch and of the block
# stays in cache (measured: results/offload/notes.md); the block is BLOCK x torch's threads
BLOCK = 1 << 20
HOST = torch.device("cpu")


def _pinned(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()


# where a rank without CUDA takes its host memory from: ``torch.zeros`` unless a measurement
# gives the host tier a memory of its own, one a counter can tell from the device's
# (``lab.live_peak.measure_tiers``)
HOST_ALLOCATOR: Callable[[int, torch.dtype], torch.Tensor] | None = None


def host_zeros(numel: int, dtype: torch.dtype, device: torch.device,
               pinned: bool = False) -> torch.Tensor:
    """Zeroed host memory for what the offload keeps off ``device`` (the optimizer's states,
    the staging, stage 3's offloaded parameter shard): page-locked where ``pinned`` and the
    device is CUDA (the copy engines read it); on a rank without CUDA from ``HOST_ALLOCATOR``
    when one is set, else plain host memory."""
    if HOST_ALLOCATOR is not None and device.type != "cuda":
        return HOST_ALLOCATOR(numel, dtype)
    return torch.zeros(numel, dtype=dtype, device=HOST, pin_memory=pinned and _pinned(device))


class HostAdamW:
    """AdamW state of a shard made of ``chunks`` = [(offset, length), ...] in host memory,
    updated on the host (module docstring); ``lp_chunks`` the stage's training-dtype chunks on
    the device, copied into the master once here."""

    def __init__(self, chunks: Sequence[tuple[int, int]], lp_chunks: Sequence[torch.Tensor],
                 lp_dtype: torch.dtype, block: int | None = None):
        if not hasattr(torch, "_fused_adamw_"):
            raise RuntimeError("zero.offload_optimizer=cpu steps with torch's fused CPU AdamW "
                               "(torch._fused_adamw_): use torch 2.4 or newer")
        self.chunks = list(chunks)
        self.numel = sum(n for _, n in self.chunks)
        self.device = lp_chunks[0].device if len(lp_chunks) else HOST
        self.cuda = _pinned(self.device)
        zeros = dict(dtype=torch.float32, device=self.device)
        self.master = host_zeros(self.numel, **zeros)
        self.exp_avg = host_zeros(self.numel, **zeros)
        self.exp_avg_sq = host_zeros(self.numel, **zeros)
        # gradients in, updated parameters out: one lp shard, the copy engines' buffer
        self.staging = host_zeros(self.numel, lp_dtype, self.device, pinned=True)
        block = BLOCK * torch.get_num_threads() if block is None else block
        if block % 64:
            raise ValueError(f"block={block}: use a multiple of 64 elements (the kernel's "
                             f"vector width)")
        self.block = min(block, max((n for _, n in self.chunks), default=64))
        self.scratch = host_zeros(self.block, **zeros)  # one block's fp32 gradient
        self._step_t = torch.zeros((), dtype=torch.float32, device=HOST)  # the kernel's step
        with torch.no_grad():
            for (off, n), p in zip(self.chunks, lp_chunks):
                self.master[off:off + n].copy_(p)
        self.step_count = 0
        self.copied = {"d2h": 0, "h2d": 0}  # bytes over PCIe (host <-> device) so far
        self._staged = [False] * len(self.chunks)
        self.spare: torch.Tensor | None = None  # the delayed update's second staging buffer
        self._pending: tuple | None = None  # (its buffer, its thread, its error box)
        self._d2h: list = [None] * len(self.chunks)  # CUDA events: gradient chunk i on the host
        self._h2d: list = [None] * len(self.chunks)  # ... parameter chunk i on the device
        if self.cuda:
            self._d2h_stream = torch.cuda.Stream(self.device)
            self._h2d_stream = torch.cuda.Stream(self.device)

    def master_chunk(self, i: int, lp_chunk: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 values of chunk i: the host master (also in fp32 training)."""
        off, n = self.chunks[i]
        return self.master[off:off + n]

    def host_tensors(self) -> list[torch.Tensor]:
        """Every storage this optimizer keeps in host memory (the dry run tells them apart
        from the device's)."""
        spare = [] if self.spare is None else [self.spare]
        return [self.master, self.exp_avg, self.exp_avg_sq, self.staging, self.scratch,
                self._step_t, *spare]

    # ------------------------------------------------------------------ device -> host
    @torch.no_grad()
    def grad_ready(self, i: int, grad: torch.Tensor | None) -> None:
        """Chunk i's gradient is final for this step (reduced, on the last micro-batch): start
        its copy into the host staging (None: zeros)."""
        off, n = self.chunks[i]
        dst = self.staging[off:off + n]
        if grad is None:
            if self._h2d[i] is not None:  # the last step's parameters have left the staging
                self._h2d[i].synchronize()
            dst.zero_()
        elif self.cuda:
            s = self._d2h_stream
            s.wait_stream(torch.cuda.current_stream(self.device))  # the reduction is in
            if self._h2d[i] is not None:  # the last step's parameters have left the staging
                s.wait_event(self._h2d[i])
            with torch.cuda.stream(s):
                dst.copy_(grad.reshape(-1), non_blocking=True)
                self._d2h[i] = torch.cuda.Event()
                self._d2h[i].record(s)
        else:
            dst.copy_(grad.reshape(-1))
        if grad is not None:
            self.copied["d2h"] += n * self.staging.element_size()
        self._staged[i] = True

    @torch.no_grad()
    def grad_add(self, i: int, grad: torch.Tensor) -> None:
        """A later micro-batch's reduced chunk i added onto the staged one (on the host: its
        earlier copy waited for, this one copied synchronously)."""
        off, n = self.chunks[i]
        if self._d2h[i] is not None:
            self._d2h[i].synchronize()
            self._d2h[i] = None
        self.staging[off:off + n].add_(grad.reshape(-1).to(HOST))
        self.copied["d2h"] += n * self.staging.element_size()

    def source_reusable(self, i: int) -> None:
        """The device tensor chunk i was staged from may be written again once its copy is
        done: the compute stream waits for it (on the device, no host wait)."""
        if self.cuda and self._d2h[i] is not None:
            torch.cuda.current_stream(self.device).wait_event(self._d2h[i])

    @torch.no_grad()
    def staged_chunks(self) -> list[torch.Tensor]:
        """The step's gradient chunks as the host holds them (every copy landed; a chunk no
        gradient reached is zeros): what the overflow check, the norm and the clip read."""
        for i in range(len(self.chunks)):
            if self._d2h[i] is not None:
                self._d2h[i].synchronize()
                self._d2h[i] = None
            if not self._staged[i]:
                self.grad_ready(i, None)
        return [self.staging[off:off + n] for off, n in self.chunks]

    def discard(self) -> None:
        """Forget the gradients staged for a step that does not happen (skipped on overflow,
        or ``zero_grad`` before it)."""
        self._staged = [False] * len(self._staged)


    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, lp_chunks: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
             grad_mult: float, lr: float, betas: tuple[float, float], eps: float,
             weight_decay: float, on_chunk: Callable[[int], None] | None = None) -> None:
        """One AdamW step on the host (module docstring); gradients multiplied by
        ``grad_mult`` (unscale x clip); ``on_chunk(i)`` once chunk i of ``lp_chunks`` holds
        its updated value (its copy to the device ordered before whatever the compute stream
        does next)."""
        self.step_count += 1
        self._step_t.fill_(self.step_count)
        for i, g in enumerate(grads):
            if not self._staged[i]:
                self.grad_ready(i, g)
        if self.cuda:  # nothing on the device still reads the parameters being replaced
            self._h2d_stream.wait_stream(torch.cuda.current_stream(self.device))
        kw = dict(lr=lr, beta1=betas[0], beta2=betas[1], weight_decay=weight_decay, eps=eps,
                  amsgrad=False, maximize=False)
        for i, lp in enumerate(lp_chunks):
            if self._d2h[i] is not None:
                self._d2h[i].synchronize()
                self._d2h[i] = None
            self.update_chunk(i, grad_mult, kw)
            off, n = self.chunks[i]
            self._to_device(i, lp, self.staging[off:off + n])
            if on_chunk is not None:
                on_chunk(i)
        self.discard()

    def update_chunk(self, i: int, grad_mult: float, kw: dict,
                     staging: torch.Tensor | None = None) -> None:
        """The host's work on chunk i (what ``lab.host_adam`` times): AdamW over its elements,
        ``block`` at a time, from the staged gradient; the updated master cast into the
        staging (``staging``: default the current one). ``kw``: ``torch._fused_adamw_``'s
        hyperparameters."""
        off, n = self.chunks[i]
        staging = self.staging if staging is None else staging
        for a in range(off, off + n, self.block):
            b = min(a + self.block, off + n)
            g = self.scratch[:b - a]
            g.copy_(staging[a:b])
            if grad_mult != 1.0:
                g.mul_(grad_mult)
            torch._fused_adamw_([self.master[a:b]], [g], [self.exp_avg[a:b]],
                                [self.exp_avg_sq[a:b]], [], [self._step_t], **kw)
            # cast to the training dtype while the block is in cache (the gradient there is
            # consumed)
            staging[a:b].copy_(self.master[a:b])

    # ------------------------------------------------------------------ delayed update
    @torch.no_grad()
    def step_delayed(self, lp_chunks: Sequence[torch.Tensor],
                     grads: Sequence[torch.Tensor | None], grad_mult: float, lr: float,
                     betas: tuple[float, float], eps: float, weight_decay: float,
                     on_chunk: Callable[[int], None] | None = None) -> None:
        """ZeRO-Offload's delayed parameter update (Ren et al. 2021, §4.2): the update of the
        step before lands first (``settle``: copied to the device, ``on_chunk(i)``), then this
        step's update starts on a host thread from the staged gradients and returns at once;
        the next step's gradients arrive in a second staging buffer meanwhile (``spare``:
        + lp·Ψ_s host bytes). The device computes step t+1 on parameters one update old."""
        for i, g in enumerate(grads):
            if not self._staged[i]:
                self.grad_ready(i, g)
        for i, ev in enumerate(self._d2h):
            if ev is not None:
                ev.synchronize()
                self._d2h[i] = None
        self.settle(lp_chunks, on_chunk)
        if self.spare is None:
            self.spare = host_zeros(self.numel, self.staging.dtype, self.device, pinned=True)
        self.step_count += 1
        kw = dict(lr=lr, beta1=betas[0], beta2=betas[1], weight_decay=weight_decay, eps=eps,
                  amsgrad=False, maximize=False)
        buf, box = self.staging, []
        self.staging, self.spare = self.spare, buf
        self.discard()
        thread = threading.Thread(target=self._update_all, daemon=True,
                                  args=(buf, grad_mult, kw, self.step_count, box))
        thread.start()
        self._pending = (buf, thread, box)

    def _update_all(self, buf: torch.Tensor, grad_mult: float, kw: dict, step: int,
                    box: list) -> None:
        try:
            with torch.no_grad():
                self._step_t.fill_(step)
                for i in range(len(self.chunks)):
                    self.update_chunk(i, grad_mult, kw, buf)
        except BaseException as e:  # noqa: BLE001 - handed to the thread that settles
            box.append(e)

    @torch.no_grad()
    def settle(self, lp_chunks: Sequence[torch.Tensor],
               on_chunk: Callable[[int], None] | None = None) -> bool:
        """The delayed update in flight, if any, finished and copied onto ``lp_chunks``
        (``on_chunk(i)`` after each); whether there was one. Whatever reads the optimizer's
        state or the parameters outside the step settles first."""
        if self._pending is None:
            return False
        buf, thread, box = self._pending
        thread.join()
        self._pending = None
        if box:
            raise RuntimeError("the delayed host update failed") from box[0]
        if self.cuda:  # nothing on the device still reads the parameters being replaced
            self._h2d_stream.wait_stream(torch.cuda.current_stream(self.device))
        for i, lp in enumerate(lp_chunks):
            off, n = self.chunks[i]
            self._to_device(i, lp, buf[off:off + n])
            if on_chunk is not None:
                on_chunk(i)
        return True

    def _to_device(self, i: int, lp: torch.Tensor, stage: torch.Tensor) -> None:
        self.copied["h2d"] += stage.numel() * stage.element_size()
        if not self.cuda:
            lp.copy_(stage)
            return
        s = self._h2d_stream
        with torch.cuda.stream(s):
            lp.copy_(stage, non_blocking=True)
            self._h2d[i] = torch.cuda.Event()
            self._h2d[i].record(s)
        torch.cuda.current_stream(self.device).wait_event(self._h2d[i])

    def nbytes(self) -> dict[str, int]:
        """Host bytes by ledger category (the device holds none of this optimizer's)."""
        return {"master_fp32_host": self.master.numel() * 4,
                "adam_m_host": self.exp_avg.numel() * 4,
                "adam_v_host": self.exp_avg_sq.numel() * 4,
                "grads_host": self.staging.numel() * self.staging.element_size()
                * (1 if self.spare is None else 2),
                "optim_step_host": self.scratch.numel() * 4}


class HostGradShards:
    """ZeRO-Offload's gradient shard (Ren et al. 2021, §4.1: only the fp16 parameters stay on
    the GPU): ``grads.FusedGrads`` reduces each bucket into the bucket's own chunk of its fused
    device buffer and hands it here as the reduction lands (``accumulate``); the chunk is
    copied into ``HostAdamW``'s staging (later micro-batches: added there) and the device
    buffer is reused. The device keeps no gradient store (``device_bytes`` 0): at any stage its
    gradient memory is the fused buffers alone. The interface of ``flat_buffer.GradShards``."""

    device_bytes = 0

    def __init__(self) -> None:
        self.opt: HostAdamW | None = None
        self._written: set[int] = set()

    def bind(self, opt: HostAdamW) -> None:
        self.opt = opt

    def claim(self, index: int) -> None:
        return None  # reduced into the fused buffer's own chunk, staged as it lands

    def accumulate(self, index: int, reduced: torch.Tensor) -> None:
        if index in self._written:
            self.opt.grad_add(index, reduced)
        else:
            self.opt.grad_ready(index, reduced)
            self._written.add(index)
        self.opt.source_reusable(index)

    def chunks(self) -> list[torch.Tensor]:
        return self.opt.staged_chunks()

    @property
    def parts(self) -> list[torch.Tensor]:
        return [self.opt.staging[off:off + n] for off, n in self.opt.chunks]

    def zero(self) -> None:
        self._written.clear()
