"""Hierarchical sharding at scale (FSDP2's HSDP, MiCS, ZeRO++'s hpZ): the DP collectives of one
step on the 2-D mesh, their bytes split by link (inside a node, between nodes), and their time
over the cluster's links (paper §7's volumes; the memory: ``paper.table1``).

Layout (``runtime.comm.topology``): the N_d DP ranks of one TP rank, dp_rank = replicate_rank·G
+ shard_rank; a node holds k = gpus_per_node / tp consecutive DP ranks of each TP rank (k = 1
when TP spans nodes). Collectives per rank and step, Ψ elements of one TP shard, R = N_d / G:

    stage 0         all-reduce of Ψ over N_d
    stages 1-2      reduce-scatter of Ψ over G, all-reduce of the owned Ψ/G over R, all-gather
                    of Ψ over G (G = N_d: plain ZeRO, no all-reduce)
    stage 3         all-gather of Ψ over G forward and again backward, reduce-scatter over G,
                    all-reduce of Ψ/G over R
    stage 3 + hpZ   all-gather over N_d forward (each rank keeps its slice of the node's
                    secondary shard from it), all-gather over the node's k ranks backward (from
                    the secondary shard: NVLink only), reduce-scatter over N_d (arXiv:2306.10209
                    §3.2; DeepSpeed@edaa7221 stage3.py L2577 drops the secondary after each step,
                    partition_parameters.py L1310 gathers from it where it exists)

A ring of n ranks moves (n-1)/n·S per rank for a reduce-scatter or all-gather of S elements
and 2(n-1)/n·S for an all-reduce (§7, whose count takes (n-1)/n -> 1: ``paper_volume``).
Split by link: the ring visits the ranks in order, a node's members contiguously, so a ring
over c nodes crosses a node boundary c times (c = 1: never): c of its n links are network
links, and per rank (a node's bytes over its NICs shared by its ranks) c/n of the volume is
inter-node, the rest rides NVLink. A smaller G therefore saves inter-node bytes only where its
shard group fits in a node: a ring over 2 or 64 nodes sends the same bytes out of each node.

Time (``dp_terms``, the modern step's DP term when G < N_d or hpZ): each collective a ring over
its group's bottleneck link -- NVLink inside a node; between nodes the node's NICs shared by the
groups of that kind touching the node -- with the modern step's overlap: the replicas'
all-reduce runs once per step after backward (this runtime's order) and is exposed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from zero_repro.scale import collectives as CL
from zero_repro.scale import kernels as K
from zero_repro.scale import perf_model as P

OPS = {"rs": "reduce-scatter", "ag": "all-gather", "ar": "all-reduce"}


@dataclass(frozen=True)
class Mesh:
    """The DP mesh of one TP rank: N_d ranks, shard groups of G, k DP ranks per node, and the
    TP ranks sharing a node (``tp_on_node``: their groups share its NICs)."""
    n_d: int
    shard_size: int
    per_node: int
    tp_on_node: int = 1

    def __post_init__(self):
        if self.n_d < 1 or self.shard_size < 1 or self.n_d % self.shard_size:
            raise ValueError(f"shard_size={self.shard_size} must divide n_d={self.n_d}")
        if self.per_node < 1:
            raise ValueError(f"per_node={self.per_node}: a node holds at least one DP rank")

    def groups(self, kind: str) -> list[range]:
        """The DP ranks of every group of ``kind``: dp | shard | replicate | node."""
        n, g, k = self.n_d, self.shard_size, self.per_node
        if kind == "dp":
            return [range(n)]
        if kind == "shard":
            return [range(j, j + g) for j in range(0, n, g)]
        if kind == "replicate":
            return [range(s, n, g) for s in range(g)]
        if kind == "node":
            return [range(j, min(n, j + k)) for j in range(0, n, k)]
        raise ValueError(f"group kind {kind!r}: dp, shard, replicate or node")

    def geometry(self, kind: str) -> tuple[int, float, int]:
        """(ranks n, inter-node fraction c/n averaged over the groups, most groups spanning
        nodes that touch one node, times the TP ranks on it) of the groups of ``kind``."""
        groups, touch = self.groups(kind), {}
        frac = 0.0
        for grp in groups:
            nodes = {d // self.per_node for d in grp}
            if len(nodes) > 1:
                frac += len(nodes) / len(grp)
                for nd in nodes:
                    touch[nd] = touch.get(nd, 0) + 1
        return (len(groups[0]), frac / len(groups),
                max(touch.values(), default=0) * self.tp_on_node)


@dataclass(frozen=True)
class Collective:
    """One collective of the step, per rank: its op (rs | ag | ar), group kind, ranks n, the
    full buffer S (elements), phase (forward | backward | step), and the elements this rank
    moves inside its node and between nodes (ring, module doc)."""
    op: str
    group: str
    n: int
    elements: float
    phase: str
    intra: float
    inter: float

    @property
    def volume(self) -> float:
        return self.intra + self.inter


def _schedule(stage: int, g: int, n_d: int, hpz: bool) -> list[tuple[str, str, float, str]]:
    """(op, group kind, fraction of Ψ in the buffer, phase) of a step (module doc)."""
    if hpz:
        if stage != 3:
            raise ValueError(f"hpZ at stage {stage}: hpZ is stage 3's (the parameters' gathers)")
        return [("ag", "dp", 1.0, "forward"), ("ag", "node", 1.0, "backward"),
                ("rs", "dp", 1.0, "backward")]
    if stage == 0:
        return [("ar", "dp", 1.0, "backward")]
    rep = [("ar", "replicate", 1.0 / g, "step")] if g < n_d else []
    if stage in (1, 2):
        return [("rs", "shard", 1.0, "backward"), *rep, ("ag", "shard", 1.0, "step")]
    if stage == 3:
        return [("ag", "shard", 1.0, "forward"), ("ag", "shard", 1.0, "backward"),
                ("rs", "shard", 1.0, "backward"), *rep]
    raise ValueError(f"stage={stage} must be 0, 1, 2 or 3")


def collectives(psi: float, stage: int, mesh: Mesh, hpz: bool = False) -> list[Collective]:
    """The DP collectives of one step on ``mesh`` (module doc), per rank, in elements."""
    out = []
    for op, kind, part, phase in _schedule(stage, mesh.shard_size, mesh.n_d, hpz):
        n, frac, _ = mesh.geometry(kind)
        size = psi * part
        vol = (2 if op == "ar" else 1) * (n - 1) / n * size
        out.append(Collective(op, kind, n, size, phase, vol * (1 - frac), vol * frac))
    return out


def paper_volume(psi: float, stage: int, mesh: Mesh, hpz: bool = False) -> float:
    """§7's elements per rank and step ((n-1)/n -> 1): 2Ψ (stages 0-2), 3Ψ (stage 3, hpZ
    too), + 2Ψ/G over the replicas when G < N_d."""
    return sum((2 if op == "ar" else 1) * psi * part
               for op, _, part, _ in _schedule(stage, mesh.shard_size, mesh.n_d, hpz))


def comm_ledger(psi: float, stage: int, n_d: int, shard_size: int | None = None,
                per_node: int | None = None, hpz: bool = False, lp_bytes: int = 2) -> dict:
    """Bytes per rank and step over DP inside a node (``intra``) and between nodes
    (``inter``), and each collective (``collectives``: op, group, n, intra, inter in bytes, and
    ``paper``: §7's count of it, (n-1)/n -> 1, the convention of ``comm``'s ledger per group);
    ``per_node`` DP ranks per node (default: all on one node)."""
    mesh = Mesh(n_d, shard_size or n_d, per_node or n_d)
    rows = collectives(psi, stage, mesh, hpz)
    return {"intra": lp_bytes * sum(c.intra for c in rows),
            "inter": lp_bytes * sum(c.inter for c in rows),
            "collectives": [{"op": OPS[c.op], "group": c.group, "n": c.n, "phase": c.phase,
                             "intra": lp_bytes * c.intra, "inter": lp_bytes * c.inter,
                             "paper": lp_bytes * c.elements * (2 if c.op == "ar" else 1)}
                            for c in rows]}


# --------------------------------------------------------------------------- the time model
def mesh_of(w: P.Workload, gpus_per_node: int) -> Mesh:
    """The DP mesh of a workload (``Workload.shard_size``: 0 = all N_d)."""
    k = max(1, gpus_per_node // w.tp)
    return Mesh(w.dp, w.shard_size or w.dp, k, max(1, min(w.tp, gpus_per_node)))


def hierarchical(w: P.Workload) -> bool:
    """A workload whose DP collectives are not plain ZeRO's over one group."""
    return w.hpz or (w.shard_size not in (0, w.dp) and w.stage >= 1)


def shard_ranks(w: P.Workload) -> int:
    """The ranks the optimizer states are partitioned over: G (hpZ: all N_d)."""
    return w.dp if w.hpz or not w.shard_size else w.shard_size


def _link(mesh: Mesh, kind: str, intra: float, net: float) -> tuple[float, float]:
    """(per-rank ring bandwidth, per-step latency) of a group of ``kind`` (module doc)."""
    _, frac, sharing = mesh.geometry(kind)
    if frac == 0:
        return intra, P.ALPHA_INTRA
    return min(intra, net / max(1, sharing)), P.ALPHA_INTER


def collective_seconds(w: P.Workload, hw, dk, point: str, model: str = "nccl"
                       ) -> list[tuple[Collective, float]]:
    """Each DP collective of the step with its seconds over its group's link, one call per
    bucket (stage 3: per block): ``model`` ``nccl`` NCCL's per-call cost over the nodes the
    group spans (``scale.collectives``, as ``modern_step.collective`` times plain ZeRO's),
    ``ring`` the ring closed forms with one latency per ring step."""
    mesh = mesh_of(w, hw.gpus_per_node)
    link = "nvlink" if K.intra_link(dk) == "nvlink" else "pcie"
    names = {"rs": "reduce_scatter", "ag": "all_gather", "ar": "all_reduce"}
    intra = hw.intra_bw * K.link_efficiency(dk, K.intra_link(dk), point)
    net = hw.inter_bw_node * K.link_efficiency(dk, "network", point)
    psi = w.params / w.tp
    calls = w.n_layer if w.stage == 3 else max(1, math.ceil(psi / w.bucket_elems))
    ring = {"rs": P.ring_reduce_scatter_time, "ag": P.ring_all_gather_time,
            "ar": P.ring_all_reduce_time}
    out = []
    for c in collectives(psi, w.stage, mesh, w.hpz):
        bw, alpha = _link(mesh, c.group, intra, net)
        if model == "nccl":
            nodes = len({d // mesh.per_node for d in mesh.groups(c.group)[0]})
            out.append((c, CL.calls_time(names[c.op], c.elements * w.lp_bytes, calls, c.n, bw,
                                         nodes, link) if c.n > 1 else 0.0))
            continue
        lat = (calls - 1) * (c.n - 1) * alpha * (2 if c.op == "ar" else 1)
        t = ring[c.op](c.elements * w.lp_bytes, c.n, bw, alpha) + (lat if c.n > 1 else 0.0)
        out.append((c, t))
    return out


def dp_terms(w: P.Workload, hw, dk, windows: tuple, point: str, exposed,
             model: str = "nccl") -> dict:
    """(exposed, total) seconds of the DP collectives on the mesh, the modern step's overlap
    (``exposed(t, window, units)``): gathers in forward behind forward, the backward's
    gathers and reduce-scatters behind backward, the rest after backward (module doc)."""
    timed = collective_seconds(w, hw, dk, point, model)
    units = w.n_layer if w.stage == 3 else max(1, math.ceil(w.params / w.tp / w.bucket_elems))
    fwd = sum(t for c, t in timed if c.phase == "forward")
    bwd = sum(t for c, t in timed if c.phase == "backward")
    after = sum(t for c, t in timed if c.phase == "step")
    if w.stage == 1:  # stage 1 reduces after backward (``modern_step.dp_terms``)
        out = bwd + after
    else:
        out = ((exposed(fwd, windows[0], units) if fwd else 0.0)
               + (exposed(bwd, windows[1], units) if bwd else 0.0) + after)
    return {"dp_exposed": out, "dp_total": fwd + bwd + after}
