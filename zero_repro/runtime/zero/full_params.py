"""The whole parameters of a ZeRO-wrapped model (paper §5: each rank holds 1/N_d of the
model states; these put them back together): the export (``full_state_dict``: the model's own
keys, fp32 from the master, gathered bucket by bucket; ``full_parameters``) and the write-back
of ``strategy.gathered(writeback=True)`` (``write_back``: what was written into the whole
parameters reaches this rank's shard of the fp32 master and of the training-dtype parameters).

Functions of a ``Strategy`` (``s``), which exposes them as methods. Memory: one bucket (stages
0-2) or one unit's bucket at a time on the device, the whole model in host memory on the ranks
that keep an export; the write-back holds one chunk's comparison mask at a time.
"""
from __future__ import annotations

import torch

from zero_repro.runtime.comm import comm
from zero_repro.runtime.zero.flat_buffer import FlatParams
from zero_repro.runtime.zero.partition import intersect


@torch.no_grad()
def full_state_dict(s, dtype: torch.dtype | None = torch.float32,
                    rank0_only: bool = True, tp_full: bool = True) -> dict:
    """The model's own ``state_dict()`` with every parameter whole, on the CPU (collective
    over the world: every rank calls it). Keys are the model's (tied weights under every
    name the model gives them, buffers included), so a fresh model loads it with
    ``strict=True``. ``dtype``: float32 (default; trainable parameters from the fp32
    master, not rounded through the training dtype) or None for the training dtype.
    ``tp_full``: TP-sliced parameters (a model with ``tp_partition_dims`` and
    ``full_shapes``) gathered over TP to their TP=1 shapes. ``rank0_only``: other ranks
    get ``{}``. Memory: one bucket (stages 0-2) or one unit's bucket at a time on the
    device; the whole model in host memory on the ranks that keep it."""
    s.wait_params()
    # DP rank 0 of every TP group collects (its TP group then gathers over TP); the world's
    # rank 0 keeps
    collect = not rank0_only or s.dp_rank == 0
    keep = not rank0_only or s.topo.rank == 0
    values: dict[int, torch.Tensor] = {}
    enabled, s.topo.ledger.enabled = s.topo.ledger.enabled, False
    try:
        lp = s.params.chunks()
        fp32 = dtype == torch.float32 or dtype is None and s.dtype == torch.float32
        # the master may be in host memory (ZeRO-Offload): gathered on the device
        chunks = [s.opt.master_chunk(i, c).float().to(s.device) if fp32 else c
                  for i, c in enumerate(lp)]
        i = 0
        for g in s.groups:
            n = len(g.partition.buckets)
            _export_group(s, g, chunks[i:i + n], values, collect)
            i += n
        for g, shards in _frozen_groups(s):
            cast = [c.float() if fp32 else c for c in shards]
            _export_group(s, g, cast, values, collect)
        if tp_full and collect:
            _tp_gather(s, values)
    finally:
        s.topo.ledger.enabled = enabled
    if not keep:
        return {}
    out = {}
    for k, v in s.module.state_dict(keep_vars=True).items():
        t = values.get(id(v))
        out[k] = t if t is not None else v.detach().to("cpu", copy=True)
    return out


def _frozen_groups(s) -> list[tuple[FlatParams, list[torch.Tensor]]]:
    """(group, this rank's chunks of it) of every frozen group."""
    flat = getattr(s, "frozen_flat", None)
    if flat is not None:
        return [(flat, flat.owned_chunks(0))]
    out = []
    for u in getattr(s.params, "units", ()):
        for g, shard in u.parts[1 if u.group is not None else 0:]:
            out.append((g, [shard[b.shard_offset:b.shard_offset + b.chunk]
                            for b in g.partition.buckets]))
    return out


def _export_group(s, g: FlatParams, chunks: list[torch.Tensor],
                  values: dict[int, torch.Tensor], keep: bool) -> None:
    """Gather group ``g`` bucket by bucket from this rank's ``chunks`` (one per bucket)
    into whole CPU tensors, ``values[id(parameter)]`` (filled where ``keep``)."""
    part = g.partition
    if keep:
        dt = chunks[0].dtype if chunks else s.dtype
        for sl, p in zip(g.slots, g.params):
            values[id(p)] = torch.empty(sl.numel, dtype=dt)
    for b, mine in zip(part.buckets, chunks):
        if part.world == 1:
            whole = mine
        else:
            whole = torch.empty(b.size, dtype=mine.dtype, device=mine.device)
            comm.all_gather_into(whole, mine.contiguous(), s.mesh.shard)
        if not keep:
            continue
        for sl, p in zip(g.slots, g.params):
            r = intersect(sl.offset, sl.end, b.start, b.end)
            if r is not None:
                values[id(p)][r[0] - sl.offset:r[1] - sl.offset].copy_(
                    whole[r[0] - b.start:r[1] - b.start])
    if keep:
        for sl, p in zip(g.slots, g.params):
            values[id(p)] = values[id(p)].view(sl.shape)


def _tp_gather(s, values: dict[int, torch.Tensor]) -> None:
    """TP-sliced parameters in ``values`` replaced by their TP=1 tensors (collective over
    the TP group, one parameter at a time on the device)."""
    group = s.topo.tp_group
    dims_fn = getattr(s.module, "tp_partition_dims", None)
    if group is None or group.size == 1 or not callable(dims_fn):
        return
    dims, shapes = dims_fn(), s.module.full_shapes()
    for n, p in s.named + s.frozen:
        d = dims.get(n)
        if d is None:
            continue
        moved = values[id(p)].to(s.device).movedim(d, 0).contiguous()
        buf = torch.empty((group.size,) + tuple(moved.shape), dtype=moved.dtype,
                          device=s.device)
        comm.all_gather_into(buf.view(-1), moved.view(-1), group)
        full = buf.flatten(0, 1).movedim(0, d)
        values[id(p)] = full.narrow(d, 0, shapes[n][d]).to("cpu").contiguous()


@torch.no_grad()
def full_parameters(s) -> dict[str, torch.Tensor]:
    """This TP rank's parameters, unsharded over DP, in fp32 (from the master shard)."""
    s.wait_params()  # the gathers below are issued after the step's, in the same order
    out, i = {}, 0
    lp_chunks = s.params.chunks()
    enabled, s.topo.ledger.enabled = s.topo.ledger.enabled, False
    try:
        for g in s.groups:
            full = torch.zeros(g.partition.padded_numel, dtype=torch.float32,
                               device=g.flat.device)
            for b in g.partition.buckets:
                mine = s.opt.master_chunk(i, lp_chunks[i]).float().to(full.device)
                if g.partition.world == 1:
                    full[b.start:b.end].copy_(mine)
                else:
                    comm.all_gather_into(full[b.start:b.end], mine.contiguous(),
                                         s.mesh.shard)
                i += 1
            for sl in g.slots:
                out[sl.name] = full[sl.offset:sl.end].view(sl.shape).clone()
    finally:
        s.topo.ledger.enabled = enabled
    return {n: out[n] for n in s.names}


@torch.no_grad()
def write_back(s) -> None:
    """After ``gathered(writeback=True)``: every owned chunk's elements that were written
    (they differ from the master cast to the training dtype) become the fp32 master's values
    (the written training-dtype value, exact in fp32); the training-dtype shard takes the
    gathered values (stage 3; stages 0-2 hold them in place), frozen parts included. Elements
    not written keep their fp32 master bit for bit. Local: the caller re-publishes."""
    visible = getattr(s.params, "gathered_chunks", s.params.chunks)()
    for i, (v, lp) in enumerate(zip(visible, s.params.chunks())):
        master = s.opt.master_chunk(i, lp)
        if master.data_ptr() != lp.data_ptr() or master.device != lp.device:
            seen = v.to(master.device)
            written = seen.ne(master.to(seen.dtype))
            master.copy_(torch.where(written, seen.to(master.dtype), master))
        if v.data_ptr() != lp.data_ptr():
            lp.copy_(v)
    frozen_back = getattr(s.params, "write_back_frozen", None)
    if frozen_back is not None:
        frozen_back()
