"""Topology: the 2-D tensor-parallel x data-parallel grid (paper §8, "ZeRO with MP").

World size W = tp * dp. Tensor-parallel ranks are *contiguous* (rank = dp_rank * tp + tp_rank)
so that a TP group sits inside one node, where its per-layer all-reduces ride NVSwitch/NVLink,
while DP collectives cross nodes (as in the paper's 400-GPU runs: MP 16 inside a DGX-2,
DP 25 across nodes). Each TP rank has its own DP group: ZeRO partitions a TP shard across the
DP ranks that hold that same shard.

No module globals: the groups live on the Topology object, which is passed explicitly.
"""
from __future__ import annotations

from dataclasses import dataclass

from zero_repro.runtime.comm import comm


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

    @classmethod
    def build(cls, tp: int = 1, ledger: comm.CommLedger | None = None) -> "Topology":
        """Build from the initialised default process group (or a single process)."""
        ledger = ledger if ledger is not None else comm.CommLedger()
        world_size, rank = comm.world_size(), comm.world_rank()
        dp = check_grid(world_size, tp)
        dp_rank, tp_rank = grid_coords(rank, tp)
        world = comm.new_group("world", range(world_size), ledger, rank)
        tp_group = dp_group = None
        # every process must create every group, in the same order
        for d in range(dp):
            g = comm.new_group("tp", [grid_rank(d, t, tp) for t in range(tp)], ledger, rank)
            tp_group = g or tp_group
        for t in range(tp):
            g = comm.new_group("dp", [grid_rank(d, t, tp) for d in range(dp)], ledger, rank)
            dp_group = g or dp_group
        return cls(world_size, rank, tp, dp, dp_rank, tp_rank, world, tp_group, dp_group, ledger)

    def model_transport(self, backend: str) -> None:
        """A dry run (``fake`` groups) accounts the bucket transport of ``backend`` on every
        group (``comm.Group.models``): the gloo one for a CPU configuration."""
        for g in (self.world, self.tp_group, self.dp_group):
            if g is not None:
                g.models = backend

    def describe(self) -> dict:
        return {"world_size": self.world_size, "rank": self.rank, "tp": self.tp, "dp": self.dp,
                "dp_rank": self.dp_rank, "tp_rank": self.tp_rank}
