"""Bucket bookkeeping shared by the ZeRO-DP stages (paper §5; buckets of C_B elements, §6.3).

A bucket is a consecutive range of a group's flat layout (``partition.Bucket``): its parameters'
gradients become ready together. ``bucket_pieces`` / ``slot_pieces`` place parameters in buckets;
``Arrivals`` launches a bucket the moment its last real gradient element arrives; ``FullGrads``
is stages 0-1's full gradient, reduced in place per bucket on the last micro-batch (all-reduce /
reduce-scatter); ``reduce_to_shard`` reduce-scatters a bucket into a gradient shard (stages 2-3);
``ParamGather`` all-gathers the updated chunks into the flat parameters after the step (stages
1-2, Ψ elements), completed in ``step()`` or waited module by module by the next forward
(``zero.overlap_param_gather``). Communication: the group's transport (``runtime.comm.transport``).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from zero_repro.runtime.comm.buffers import BufferPool, InFlight, NoBuffers
from zero_repro.runtime.comm.transport import Transport
from zero_repro.runtime.zero.flat_buffer import FlatParams, GradShards
from zero_repro.runtime.zero.partition import Bucket, Partition, Slot, intersect


def bucket_pieces(part: Partition, s: Slot) -> Iterator[tuple[Bucket, int, int]]:
    """(bucket, flat lo, flat hi) of every piece of slot ``s``, in bucket order."""
    for b in part.buckets_of(s.offset, s.numel):
        lo, hi = intersect(b.start, b.end, s.offset, s.end)
        yield b, lo, hi


def slot_pieces(g: FlatParams) -> list[list[tuple[int, int, int]]]:
    """Per bucket: (slot index, flat lo, flat hi) of every slot piece inside it."""
    pieces: list[list[tuple[int, int, int]]] = [[] for _ in g.partition.buckets]
    for i, s in enumerate(g.slots):
        for b, lo, hi in bucket_pieces(g.partition, s):
            pieces[b.index].append((i, lo, hi))
    return pieces


def scale_into(dst: torch.Tensor, grad: torch.Tensor, n_d: int) -> None:
    """``dst = grad / n_d`` in one pass (the values of ``copy_`` then ``div_``: the same op on
    the same dtype); a plain copy when ``n_d`` is 1."""
    if n_d > 1 and grad.dtype == dst.dtype:
        torch.div(grad, n_d, out=dst)
    else:
        dst.copy_(grad)
        if n_d > 1:
            dst.div_(n_d)


def matmul_flat_into(dst: torch.Tensor, a: torch.Tensor, x: torch.Tensor, e0: int, e1: int,
                     alpha: float) -> None:
    """``dst = alpha · (a.T @ x).flatten()[e0:e1]`` without forming the whole product: the
    rows wholly inside [e0, e1) in one GEMM written straight into ``dst``, a partial row at
    either end as one vector-matrix product (a bucket boundary may cut a row)."""
    d = x.shape[1]
    ra, rb = -(-e0 // d), e1 // d  # the whole rows
    if ra > rb:  # [e0, e1) inside one row
        r = e0 // d
        dst.copy_((a[:, r] @ x)[e0 - r * d:e1 - r * d].mul_(alpha))
        return
    off = ra * d - e0
    if off:  # the end of row ra - 1
        dst[:off].copy_((a[:, ra - 1] @ x)[d - off:].mul_(alpha))
    if rb > ra:
        full = dst[off:off + (rb - ra) * d].view(rb - ra, d)
        torch.addmm(full, a[:, ra:rb].t(), x, beta=0, alpha=alpha, out=full)
    tail = e1 - rb * d
    if tail:  # the start of row rb
        dst[off + (rb - ra) * d:].copy_((a[:, rb] @ x)[:tail].mul_(alpha))


class Arrivals:
    """Real gradient elements arrived per bucket since the last reset."""

    def __init__(self, part: Partition):
        self.part = part
        self.count = [0] * len(part.buckets)

    def add(self, b: Bucket, n: int) -> bool:
        """Count ``n`` more elements of ``b``; True when the bucket is now complete."""
        self.count[b.index] += n
        return self.count[b.index] == self.part.real_in_bucket(b)

    def complete(self, b: Bucket) -> bool:
        return self.count[b.index] >= self.part.real_in_bucket(b)

    def reset(self, b: Bucket | None = None) -> None:
        if b is None:
            self.count = [0] * len(self.count)
        else:
            self.count[b.index] = 0


def reduce_to_shard(t: Transport, grads: GradShards, index: int, inp: torch.Tensor,
                    scratch: torch.Tensor) -> tuple[list, Callable[[], None]]:
    """Async reduce-scatter of bucket ``inp`` into gradient-shard piece ``index`` (stages 2-3):
    straight into the piece when the transport can write there (``reduces_into``) and the piece
    holds nothing yet this step, else into the transport's own view. Returns (works, what to run
    once they complete: nothing, or the accumulation of that view into the piece)."""
    into = grads.claim(index) if t.reduces_into else None
    if into is not None:
        return t.reduce_scatter(inp, scratch, into=into)[0], _nothing_left
    works, out = t.reduce_scatter(inp, scratch)
    return works, lambda: grads.accumulate(index, out)


def _nothing_left() -> None:
    return None


class FullGrads:
    """Full local gradients of one flat group, reduced in place bucket by bucket (stages 0, 1).

    ``zero`` does not write the buffer: it marks every slot as empty; the first gradient of a
    slot after it is copied in (instead of added to zeros), and the slots that got no gradient
    at all are zeroed when their bucket is launched. Same result as zeroing, one pass over Ψ
    less per step. ``reduce(bucket, buf)`` launches the collective on the bucket's range ``buf``
    (already divided by N_d, so the sum is the mean over DP ranks). A gradient that is the
    slot's only one (one micro-batch) is divided by N_d while it is copied in (``scale_into``),
    as torch DDP's reducer does (``mul_out`` into the bucket view: "to save one scan over all
    the input parameters", torch/csrc/distributed/c10d/reducer.cpp); accumulated slots are
    divided when their bucket is launched. The same values either way, one pass over Ψ less.
    """

    def __init__(self, g: FlatParams, n_d: int, reduce: Callable[[Bucket, torch.Tensor], None],
                 transport: Transport | None = None):
        self.group, self.n_d, self.reduce = g, n_d, reduce
        # (padded,) persistent full gradients; where the DP transport offers memory its peers
        # read in place (CPU ranks on one host), there: the reductions copy nothing into its
        # slots, and each step's first write waits until the peers have read the last one's
        shared = None if transport is None else transport.shared_buffer(g.flat.numel(),
                                                                         g.flat.dtype)
        self.buffer = torch.zeros_like(g.flat) if shared is None else shared
        self._fence = None if shared is None else transport.fence
        self._fenced = False
        self.arrivals = Arrivals(g.partition)
        self.launched = [False] * len(g.partition.buckets)
        self.slot_idx = {id(p): i for i, p in enumerate(g.params)}
        self.written = [False] * len(g.slots)  # slot got a gradient since zero()
        self.scaled = [False] * len(g.slots)  # ... and was divided by N_d as it was copied in
        self.pieces = slot_pieces(g)

    @torch.no_grad()
    def add(self, p: nn.Parameter, launch: bool) -> None:
        """Accumulate ``p.grad`` (then drop it); ``launch``: last micro-batch, reduce the
        buckets this completes."""
        self._before_write()
        s = self.group.slot_of[id(p)]
        i = self.slot_idx[id(p)]
        dst, grad = self.buffer[s.offset:s.end], p.grad.reshape(-1)
        if self.written[i]:
            dst.add_(grad)
        elif launch:  # the slot's only gradient this step: divided on the way in
            scale_into(dst, grad, self.n_d)
            self.written[i] = self.scaled[i] = True
        else:
            dst.copy_(grad)
            self.written[i] = True
        p.grad = None  # the flat buffer is the only persistent gradient storage
        if not launch:
            return  # accumulate locally; reduce on the last micro-batch only
        for b, lo, hi in bucket_pieces(self.group.partition, s):
            if self.arrivals.add(b, hi - lo):
                self.launch(b)

    @torch.no_grad()
    def add_head(self, p: nn.Parameter, grad_logits: torch.Tensor, x: torch.Tensor,
                 launch: bool) -> None:
        """A tied weight's head part (``grad_logits.T @ x``, ``zero.split_tied_grad``) computed
        straight into its slot (written, or added to earlier micro-batches'); its buckets wait
        for ``add_lookup``."""
        self._before_write()
        s, i = self.group.slot_of[id(p)], self.slot_idx[id(p)]
        dst = self.buffer[s.offset:s.end].view(s.shape)
        if self.written[i]:
            dst.addmm_(grad_logits.t(), x)
        else:
            alpha = 1.0 / self.n_d if launch else 1.0  # the only gradient: divided on the way
            torch.addmm(dst, grad_logits.t(), x, beta=0, alpha=alpha, out=dst)
            self.written[i], self.scaled[i] = True, launch and self.n_d > 1

    @torch.no_grad()
    def add_lookup(self, p: nn.Parameter, rows: torch.Tensor, grads: torch.Tensor,
                   launch: bool) -> None:
        """The tied weight's lookup part (``grads[k]`` into row ``rows[k]``) after its head
        part; ``launch``: last micro-batch, reduce the buckets this completes."""
        s, i = self.group.slot_of[id(p)], self.slot_idx[id(p)]
        assert self.written[i], "the head's part of a tied gradient comes first"
        self.buffer[s.offset:s.end].view(s.shape).index_add_(
            0, rows, grads, alpha=1.0 / self.n_d if self.scaled[i] else 1.0)
        if launch:
            for b, lo, hi in bucket_pieces(self.group.partition, s):
                if self.arrivals.add(b, hi - lo):
                    self.launch(b)

    def launch_remaining(self) -> None:
        for b in self.group.partition.buckets:
            if not self.launched[b.index]:
                self.launch(b)

    def _before_write(self) -> None:
        if not self._fenced:
            if self._fence is not None:
                self._fence(self.buffer)
            self._fenced = True

    def launch(self, b: Bucket) -> None:
        self._before_write()
        self.launched[b.index] = True
        for i, lo, hi in self.pieces[b.index]:
            if not self.written[i]:  # no gradient since zero(): reduce zeros
                self.buffer[lo:hi].zero_()
            elif not self.scaled[i] and self.n_d > 1:
                # mean over DP ranks; dividing first keeps fp16 sums in range
                self.buffer[lo:hi].div_(self.n_d)
        numel = self.group.partition.numel
        if b.end > numel:  # padding: a reduce may leave it undefined on non-owners
            self.buffer[max(b.start, numel):b.end].zero_()
        self.reduce(b, self.buffer[b.start:b.end])

    def end_step(self) -> None:
        """After the reductions completed: the next backward starts counting afresh."""
        self.arrivals.reset()
        self.launched = [False] * len(self.launched)
        self._fenced = False  # the peers may still read this step's values

    def chunks(self, rank: int) -> list[torch.Tensor]:
        return [self.buffer[b.owned(rank)[0]:b.owned(rank)[1]]
                for b in self.group.partition.buckets]

    def zero(self) -> None:
        self.written = [False] * len(self.written)
        self.scaled = [False] * len(self.scaled)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


class TiedIntoFullGrads:
    """``gpt.TiedGradSink`` of a stage whose gradients are ``FullGrads`` (stages 0, 1; mixed in
    before ``Strategy``, which sets ``_tied`` via ``_tied_weight``): under
    ``zero.split_tied_grad`` the tied embedding's two gradient parts go straight into the full
    local gradient (no dense V×h tensor; the same 2Ψ reduced afterwards)."""

    def head(self, grad_logits: torch.Tensor, x: torch.Tensor) -> None:
        self.grads.add_head(self._tied, grad_logits, x, launch=self._is_last)

    def lookup(self, rows: torch.Tensor, grads: torch.Tensor) -> None:
        self.grads.add_lookup(self._tied, rows, grads, launch=self._is_last)


class ParamGather:
    """The all-gather of one flat group's updated chunks into ``g.flat`` (stages 1, 2).

    Buckets are launched in index order (``launch``, or ``publish`` for all of them at once)
    on their own ``inflight`` queue, so bucket k has landed once at most ``launched - k - 1``
    gathers are still in flight (waited oldest first). Readers wait for what they read:
    ``wait_through(k)`` for buckets 0..k, ``wait_all`` for everything; ``module_hooks`` puts a
    forward pre-hook on every module holding parameters of the group that waits for the last
    bucket its own parameters reach. A parameter read inside the forward of a module other
    than its owner must come after the owner's forward (GPT's tied head reads ``wte.weight``
    after ``wte`` ran), or the gather must be waited with ``wait_all`` first.
    ``pool`` stages the input where the transport needs it (``gather_pool``).
    """

    def __init__(self, g: FlatParams, transport: Transport, pool: BufferPool | NoBuffers,
                 inflight: InFlight):
        self.group, self.transport, self.pool, self.inflight = g, transport, pool, inflight
        self.launched = len(g.partition.buckets)  # nothing pending: every bucket landed

    def launch(self, index: int) -> None:
        """Start bucket ``index``'s all-gather; bucket 0 opens a new round."""
        if index == 0:
            self.wait_all()
            self.launched = 0
        assert index == self.launched, "buckets are gathered in index order"
        b = self.group.partition.buckets[index]
        buf = self.pool.acquire()
        works = self.transport.all_gather_in_place(self.group.flat[b.start:b.end], buf[:b.chunk])
        self.inflight.launch(works, lambda: self.pool.release(buf))
        self.launched += 1

    def publish(self) -> None:
        """Gather every bucket and wait: the parameters are current on return."""
        for k in range(len(self.group.partition.buckets)):
            self.launch(k)
        self.wait_all()

    def wait_through(self, index: int) -> None:
        while len(self.inflight) and self.launched - len(self.inflight) <= index:
            self.inflight.wait_oldest()

    def wait_all(self) -> None:
        self.inflight.wait_all()

    def module_hooks(self, model: nn.Module) -> list:
        """Forward pre-hooks waiting for the buckets of each module's own parameters."""
        part, hooks = self.group.partition, []
        for m in model.modules():
            ends = [part.buckets_of(s.offset, s.numel)[-1].index
                    for s in (self.group.slot_of.get(id(p)) for p in m.parameters(recurse=False))
                    if s is not None and s.numel]
            if ends:
                last = max(ends)
                hooks.append(m.register_forward_pre_hook(
                    lambda _m, _args, last=last: self.wait_through(last)))
        return hooks


class GatheredAfterStep:
    """The ``Strategy`` methods of a stage whose parameters a ``ParamGather`` all-gathers after
    the step (stages 1 and 2; mixed in before ``Strategy``). The stage's ``__init__`` calls
    ``_attach_param_gather`` once its flat parameters and all-gather pool exist."""

    def _attach_param_gather(self, flat: FlatParams, transport: Transport, pool: BufferPool,
                             inflight: InFlight) -> None:
        # where the transport offers memory the peers map (CPU ranks on one host), the flat
        # parameters live there: a gather reads the peers' updated chunks in place (no copy
        # into the slots), and Adam writes the own chunks only after ``fence`` (the peers
        # have read the last ones)
        shared = transport.shared_buffer(flat.flat.numel(), flat.flat.dtype)
        if shared is not None:
            flat.rehome(shared)
        self._shared_flat = shared is not None
        self.param_gather = ParamGather(flat, transport, pool, inflight)
        self._module_hooks = self.param_gather.module_hooks(self.module)

    def _before_update(self) -> None:
        self.wait_params()
        if self._shared_flat:  # the peers have read this rank's chunks: overwrite them
            self.param_gather.transport.fence(self.param_gather.group.flat)

    def _publish(self) -> None:
        self.param_gather.publish()

    def _chunk_publisher(self):
        on = self.zero.overlap_param_gather
        if on is None:  # automatic, strategy built directly: by the device it runs on
            on = self.param_gather.group.flat.device.type == "cuda"
        return self.param_gather.launch if on else None

    def wait_params(self) -> None:
        self.param_gather.wait_all()

    def remove_hooks(self) -> None:
        super().remove_hooks()
        for h in self._module_hooks:
            h.remove()
        self._module_hooks = []
