"""Time of one NCCL ring collective at its message size (the modern step model's DP and TP
collectives, ``scale.modern_step``; paper §7's volumes, cut into the calls the stage makes):
NCCL's own cost model, a latency plus bytes over a protocol's share of the bus bandwidth,
with the protocol NCCL picks (the fastest), so the bus bandwidth falls with the message size
the way nccl-tests curves do. The per-rank message shrinks as N_d grows (stage 3 gathers a
unit of Ψ_unit elements, Ψ_unit/N_d from each rank) while the ring's steps grow with N_d.

For a ring over n ranks on N nodes, S bytes the collective's whole buffer (an all-gather's
output, a reduce-scatter's input; NCCL's nBytes · nRanks), protocol p:

    t_p = lat_p + f · S / (B_bus · eta_p)            f = (n-1)/n (AG, RS), 2(n-1)/n (AR)
    lat_p = base_p + (k - k_net) · max(hw_p[intra], net_overhead_p) + k_net · hw_p[net]
    k = n - 1 ring steps (AG, RS), 2(n - 1) (AR); k_net = N - 1 (AG, RS), 2N (AR)
    t = min_p t_p over the protocols the era's NCCL has and the link allows

B_bus is the group's per-rank bus bandwidth at large messages (``modern_step.links``: the
link's line rate x its measured NCCL efficiency, ``kernel_sources.LINK``); eta_p the
protocol's share of it. Constants (microseconds), all from NVIDIA/nccl@b6475625
src/graph/tuning.cc (``ncclTopoTuneModel``), Ring rows:

  * base latency LL 6.6, LL128 14.0, Simple 8.4 (``baseLat``);
  * per-step hardware latency (``hwLat``) NVLink LL 0.6 / LL128 1.9 / Simple 3.4, PCIe 1.0 /
    2.5 / 5.7, network 2.7 / 4.0 / 14.0; an inter-node ring launches every step with the
    network's post overhead (``getNetOverhead``: 1 us on Intel hosts, x 3 for Simple);
  * bandwidth share: LL 1/4 (all-reduce or more than one node; else 1/3), LL128 0.92
    (120/128 of each line is data; 0.7 with one rank per node, ppn < 2), Simple 1;
  * LL128 is on by default only where the intra-node path is NVLink (not on PCIe-only nodes);
    NCCL before 2.5 had no LL128 (``ERA_PROTOCOLS["2020"]``: the paper's NCCL 2.4.8).

Not modelled: the tree and NVLS algorithms (NCCL's all-reduce may pick them: NVLS's
all-reduce reaches a higher bus bandwidth on Hopper, NVIDIA/nccl-tests #212), NCCL's cap on
LL's bandwidth (``llMaxBws``), the number of channels growing with the message. Check against
a published curve: NVIDIA/nccl#583 (2 x A100-SXM4-40GB over NVLink, all_reduce_perf): 10.1 us
for 32 B; the model's smallest all-reduce there is 7.8 us (LL: 6.6 + 2 x 0.6).
"""
from __future__ import annotations

import math

PROTOCOLS = ("LL", "LL128", "Simple")
BASE_LAT_US = {"LL": 6.6, "LL128": 14.0, "Simple": 8.4}
HW_LAT_US = {"nvlink": {"LL": 0.6, "LL128": 1.9, "Simple": 3.4},
             "pcie": {"LL": 1.0, "LL128": 2.5, "Simple": 5.7},
             "network": {"LL": 2.7, "LL128": 4.0, "Simple": 14.0}}
NET_OVERHEAD_US = 1.0  # getNetOverhead, Intel x86 hosts; x 3 for Simple
LL128_SHARE = 0.92
LL128_PPN1_SHARE = 0.7  # one rank per node: it sends and receives through the NIC
ERA_PROTOCOLS = {"modern": PROTOCOLS, "2020": ("LL", "Simple")}
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
SOURCE = "NVIDIA/nccl@b6475625 src/graph/tuning.cc (ncclTopoTuneModel: baseLat, hwLat, ring)"


def steps(coll: str, n: int, nodes: int) -> tuple[int, int]:
    """(ring steps, of them over the network) of one collective (module doc)."""
    if coll not in COLLECTIVES:
        raise ValueError(f"collective {coll!r}: use one of {COLLECTIVES}")
    if coll == "all_reduce":
        return 2 * (n - 1), (2 * nodes if nodes > 1 else 0)
    return n - 1, nodes - 1


def share(coll: str, protocol: str, nodes: int, ppn: float = 2.0) -> float:
    """The protocol's share of the bus bandwidth (module doc); ``ppn`` ranks per node."""
    if protocol == "LL":
        return 0.25 if (nodes > 1 or coll == "all_reduce") else 1.0 / 3.0
    if protocol == "LL128":
        return LL128_SHARE if ppn >= 2 else LL128_PPN1_SHARE
    return 1.0


def latency_us(coll: str, protocol: str, n: int, nodes: int, intra: str) -> float:
    """Microseconds of a ring collective's latency term (module doc); ``intra`` nvlink | pcie."""
    k, k_net = steps(coll, n, nodes)
    hop = HW_LAT_US[intra][protocol]
    if nodes > 1:
        hop = max(hop, NET_OVERHEAD_US * (3 if protocol == "Simple" else 1))
    return BASE_LAT_US[protocol] + (k - k_net) * hop + k_net * HW_LAT_US["network"][protocol]


def protocols(intra: str, era: str = "modern") -> tuple[str, ...]:
    """The protocols NCCL may pick: the era's, LL128 only over NVLink (module doc)."""
    if era not in ERA_PROTOCOLS:
        raise ValueError(f"NCCL era {era!r}: use one of {sorted(ERA_PROTOCOLS)}")
    return tuple(p for p in ERA_PROTOCOLS[era] if p != "LL128" or intra == "nvlink")


def times(coll: str, nbytes: float, n: int, bus_bw: float, nodes: int = 1,
          intra: str = "nvlink", era: str = "modern") -> dict:
    """Seconds of one ring collective of ``nbytes`` (the whole buffer) over ``n`` ranks on
    ``nodes`` nodes at bus bandwidth ``bus_bw`` (bytes/s) for every protocol allowed."""
    if n <= 1 or nbytes <= 0:
        return {p: 0.0 for p in protocols(intra, era)}
    f = (2.0 if coll == "all_reduce" else 1.0) * (n - 1) / n
    return {p: latency_us(coll, p, n, nodes, intra) * 1e-6
            + f * nbytes / (bus_bw * share(coll, p, nodes, n / max(1, nodes)))
            for p in protocols(intra, era)}


def time(coll: str, nbytes: float, n: int, bus_bw: float, nodes: int = 1,
         intra: str = "nvlink", era: str = "modern") -> float:
    """Seconds of one ring collective with the protocol NCCL picks (the fastest)."""
    return min(times(coll, nbytes, n, bus_bw, nodes, intra, era).values())


def protocol(coll: str, nbytes: float, n: int, bus_bw: float, nodes: int = 1,
             intra: str = "nvlink", era: str = "modern") -> str:
    """The protocol NCCL's model picks for this call."""
    t = times(coll, nbytes, n, bus_bw, nodes, intra, era)
    return min(t, key=t.get)


def bus_bandwidth(coll: str, nbytes: float, n: int, bus_bw: float, nodes: int = 1,
                  intra: str = "nvlink", era: str = "modern") -> float:
    """nccl-tests' busbw of one call (bytes/s): f · S / t (module doc), the curve against
    the message size."""
    if n <= 1:
        return math.inf
    f = (2.0 if coll == "all_reduce" else 1.0) * (n - 1) / n
    return f * nbytes / time(coll, nbytes, n, bus_bw, nodes, intra, era)


def calls_time(coll: str, total_bytes: float, calls: int, n: int, bus_bw: float,
               nodes: int = 1, intra: str = "nvlink", era: str = "modern") -> float:
    """Seconds of ``total_bytes`` moved as ``calls`` equal collectives (buckets, units)."""
    calls = max(1, int(calls))
    return calls * time(coll, total_bytes / calls, n, bus_bw, nodes, intra, era)
