"""Topology: the 2-D tensor-parallel x data-parallel grid (paper §8, "ZeRO with MP").

World size W = tp * dp. Tensor-parallel ranks are *contiguous* (rank = dp_rank * tp + tp_rank)
so that a TP group sits inside one node, where its per-layer all-reduces ride NVSwitch/NVLink,
while DP collectives cross nodes (as in the paper's 400-GPU runs: MP 16 inside a DGX-2,
DP 25 across nodes). Each TP rank has its own DP group: ZeRO partitions a TP shard across the
DP ranks that hold that same shard.

The DP mesh (``dp_mesh``, FSDP2's 2-D mesh for HSDP, ZeRO++'s hpZ / MiCS shard groups): the N_d
DP ranks of one TP rank as ``shard`` x ``replicate`` groups, N_d = G · R. A shard group is G
consecutive DP ranks (dp_rank = replicate_rank · G + shard_rank: with TP inside, G · tp
consecutive global ranks, one node when that is the node's GPU count); a replicate group is the
R DP ranks holding the same shard. ZeRO shards its states over the shard group and keeps R
replicas; G = N_d (R = 1) is plain ZeRO: the shard group is the DP group itself.

No module globals: the groups live on the Topology object, which is passed explicitly.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from zero_repro.runtime.comm import comm
from zero_repro.validation import shard_size_of


def grid_coords(rank: int, tp: int) -> tuple[int, int]:
    """rank -> (dp_rank, tp_rank)."""
    return rank // tp, rank % tp


def grid_rank(dp_rank: int, tp_rank: int, tp: int) -> int:
    return dp_rank * tp + tp_rank


def check_grid(world_size: int, tp: int) -> int:
    """Validate the grid and return dp. Raises ValueError with the fix in the message."""
    if tp < 1 or world_size < 1:
        raise ValueError(f"parallel.tp={tp} and world size {world_size} must be positive")
    if world_size % tp:
        raise ValueError(
            f"world size {world_size} is not divisible by parallel.tp={tp}: choose a world size "
            f"that is a multiple of {tp} (e.g. parallel.world_size={tp * max(1, world_size // tp)})"
            f" or a tp that divides {world_size}")
    return world_size // tp


@dataclass
class Topology:
    world_size: int
    rank: int
    tp: int
    dp: int
    dp_rank: int
    tp_rank: int
    world: comm.Group
    tp_group: comm.Group
    dp_group: comm.Group
    ledger: comm.CommLedger
    meshes: dict = field(default_factory=dict, repr=False)  # G -> DPMesh (``dp_mesh``)
    # ranks sharing one node (``zero.shard_size=node``; the ledger's inter-node groups)
    per_node: int = 0

    @classmethod
    def build(cls, tp: int = 1, ledger: comm.CommLedger | None = None,
              ranks_per_node: int | None = None) -> "Topology":
        """Build from the initialised default process group (or a single process).
        ``ranks_per_node``: the ranks sharing a node (a config's ``validation.ranks_per_node``,
        as the trainer passes it); default the launcher's environment (``comm.ranks_per_node``).
        The ledger then knows which groups cross nodes (``comm.CommLedger.inter_node``)."""
        ledger = ledger if ledger is not None else comm.CommLedger()
        world_size, rank = comm.world_size(), comm.world_rank()
        dp = check_grid(world_size, tp)
        dp_rank, tp_rank = grid_coords(rank, tp)
        per_node = ranks_per_node or comm.ranks_per_node()
        ledger.node_size = per_node
        world = comm.new_group("world", range(world_size), ledger, rank)
        tp_group = dp_group = None
        # every process must create every group, in the same order
        for d in range(dp):
            g = comm.new_group("tp", [grid_rank(d, t, tp) for t in range(tp)], ledger, rank)
            tp_group = g or tp_group
        for t in range(tp):
            g = comm.new_group("dp", [grid_rank(d, t, tp) for d in range(dp)], ledger, rank)
            dp_group = g or dp_group
        return cls(world_size, rank, tp, dp, dp_rank, tp_rank, world, tp_group, dp_group, ledger,
                   per_node=per_node)

    def dp_mesh(self, shard_size: int | str | None = None, hpz: bool = False) -> "DPMesh":
        """The DP ranks as shard x replicate groups (module docstring) for ``zero.shard_size``
        (``validation.shard_size_of``; ``hpz``: hpZ's secondary, "all" meaning "node");
        collective the first time a G is asked for (every process creates every group, in the
        same order), kept on the topology after. G = N_d: the DP group shards, the replicate
        group is this rank alone. Otherwise the ledger names the groups ``dp_shard`` and
        ``dp_replicate`` (G = 1: the replicate group has the DP group's ranks, the shard group
        is this rank alone)."""
        g = shard_size_of(shard_size, self.dp, self.per_node // self.tp, hpz=hpz)
        if g not in self.meshes:
            self.meshes[g] = self._build_mesh(g)
        return self.meshes[g]

    def _build_mesh(self, g: int) -> "DPMesh":
        r, tp, me = self.dp // g, self.tp, self.rank
        if r == 1:  # plain ZeRO: the DP group shards (its ledger name stays "dp")
            return DPMesh(self.dp_group, comm.single_group("dp_replicate", self.ledger))
        shard = replicate = None
        for t in range(tp):
            for k in range(r):
                grp = comm.new_group("dp_shard", [grid_rank(k * g + s, t, tp) for s in range(g)],
                                     self.ledger, me)
                shard = grp or shard
        for t in range(tp):
            for s in range(g):
                grp = comm.new_group("dp_replicate",
                                     [grid_rank(k * g + s, t, tp) for k in range(r)],
                                     self.ledger, me)
                replicate = grp or replicate
        for grp in (shard, replicate):
            grp.models = self.dp_group.models  # a dry run's modelled transport, as on DP
        return DPMesh(shard, replicate)

    def model_transport(self, backend: str) -> None:
        """A dry run (``fake`` groups) accounts the bucket transport of ``backend`` on every
        group (``comm.Group.models``): the gloo one for a CPU configuration."""
        for g in (self.world, self.tp_group, self.dp_group,
                  *(grp for m in self.meshes.values() for grp in (m.shard, m.replicate))):
            if g is not None:
                g.models = backend

    def describe(self) -> dict:
        return {"world_size": self.world_size, "rank": self.rank, "tp": self.tp, "dp": self.dp,
                "dp_rank": self.dp_rank, "tp_rank": self.tp_rank}


@dataclass(frozen=True)
class DPMesh:
    """One rank's view of the DP mesh: the group its ZeRO states are sharded over (G ranks)
    and the group holding the same shard (R = N_d / G replicas)."""

    shard: comm.Group
    replicate: comm.Group

    @property
    def n_d(self) -> int:
        """All DP ranks, N_d = G · R: the gradient mean's divisor."""
        return self.shard.size * self.replicate.size

    @property
    def shard_size(self) -> int:
        return self.shard.size

    @property
    def replicas(self) -> int:
        return self.replicate.size

    def describe(self) -> dict:
        return {"shard_size": self.shard.size, "replicas": self.replicate.size,
                "shard_rank": self.shard.rank, "replicate_rank": self.replicate.rank}
