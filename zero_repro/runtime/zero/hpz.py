"""ZeRO++'s hpZ (hierarchical partitioning, Wang et al. 2023 §3.2), stage 3: ``Secondary``.

Stage 3 keeps its primary parameter shard, its gradients and its optimizer states partitioned
over all N_d DP ranks (16Ψ/N_d bytes); hpZ adds a *secondary* copy of the parameters in the
training dtype, partitioned over only the G ranks of a node (``zero.hpz``, G from
``zero.shard_size``: the DP mesh's shard group, ``Topology.dp_mesh``): 2Ψ/G more bytes per rank
(the ledger's ``params_hpz``). The first gather of a unit after an update reads the primary
shard (all N_d ranks, across nodes); as it lands, each rank copies its G-way chunk of every
bucket out of the gathered unit (``fill``: no communication). Until the shards change again the
backward's gathers (and an activation-checkpoint recompute's) read the secondary, inside the
node (``gather``): per step the inter-node gathers move Ψ (forward) instead of 2Ψ, the
intra-node ones Ψ more. Any change of the primary shard (the optimizer's update, a checkpoint
load, ``gathered(writeback=True)``) makes the secondary stale (``stage3_p.Units``), so it is
never read before a primary gather refilled it: bit-identical to stage 3 without hpZ.

Layout: a bucket of a unit's flat buffer holds N_d·c elements (``partition``); G divides N_d,
so its G-way chunk for shard rank s is the flat range [start + s·size/G, start + (s+1)·size/G),
and it sits at ``start / G`` of this group's part of the secondary store (one store per
strategy, from the shard group's transport ``buffer``: its peers may read it in place).

DeepSpeed's mechanism, modelled here (not its code): ``deepspeed/runtime/zero/
partition_parameters.py`` (``_partition_param_sec``: the secondary slice copied from the whole
parameter when it is partitioned again after use; ``_all_gather``: the intra-node
``zero_param_process_group`` used when a secondary tensor exists) and ``deepspeed/runtime/zero/stage3.py``
(``invalidate_secondary_tensor`` after the optimizer step), deepspeedai/DeepSpeed@edaa7221.
"""
from __future__ import annotations

import torch

from zero_repro.runtime.comm import comm
from zero_repro.runtime.comm.transport import Transport
from zero_repro.runtime.zero.flat_buffer import FlatParams
from zero_repro.runtime.zero.partition import Bucket


class Secondary:
    """The secondary shards of ``groups`` over the G-rank ``group`` (module docstring)."""

    def __init__(self, group: comm.Group, transport: Transport, groups: list[FlatParams],
                 dtype: torch.dtype):
        self.group, self.transport = group, transport
        self.size, self.rank = group.size, group.rank
        for g in groups:
            if any(b.size % self.size for b in g.partition.buckets):
                raise ValueError(f"zero.hpz: unit {g.name}'s buckets are not divisible by the "
                                 f"secondary group of {self.size} ranks (it must divide N_d)")
        total = sum(g.partition.padded_numel // self.size for g in groups)
        self.store = transport.buffer(total, dtype)  # (sum padded / G,) persistent
        self.views: dict[int, torch.Tensor] = {}
        at = 0
        for g in groups:
            n = g.partition.padded_numel // self.size
            self.views[id(g)] = self.store[at:at + n]
            at += n

    @property
    def nbytes(self) -> int:
        return self.store.numel() * self.store.element_size()

    def _mine(self, g: FlatParams, b: Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's secondary chunk of bucket ``b``, where it sits in ``g``'s flat)."""
        c = b.size // self.size
        sec = self.views[id(g)][b.start // self.size:b.start // self.size + c]
        lo = b.start + self.rank * c
        return sec, g.flat[lo:lo + c]

    def fill(self, g: FlatParams, buckets: list[Bucket] | None = None,
             flat: torch.Tensor | None = None) -> None:
        """Copy this rank's G-way chunks out of ``g``'s gathered flat buffer (or of ``flat``,
        a bucket's slice buffer, for one bucket)."""
        with torch.no_grad():
            for b in buckets if buckets is not None else g.partition.buckets:
                sec, src = self._mine(g, b)
                if flat is not None:
                    c = b.size // self.size
                    src = flat[self.rank * c:(self.rank + 1) * c]
                sec.copy_(src)

    def gather_bucket(self, g: FlatParams, b: Bucket, out: torch.Tensor):
        """All-gather bucket ``b`` of ``g`` from the secondary chunks into ``out`` (b.size
        elements), inside the shard group; returns the work."""
        sec, _ = self._mine(g, b)
        return self.transport.all_gather(out, sec)

    def gather(self, g: FlatParams) -> list:
        """Start the gathers of every bucket of ``g`` into its (materialised) flat buffer."""
        return [self.gather_bucket(g, b, g.flat[b.start:b.end]) for b in g.partition.buckets]
