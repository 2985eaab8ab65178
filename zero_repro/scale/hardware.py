"""Cluster hardware specs as data, loaded from ``conf/cluster/*.yaml`` (the one source of
truth, read by ``zero_repro.scale.paper.clusters``; schema: ``zero_repro.config.ClusterConfig``), plus
the unit conversions the performance model needs (paper §10.1: DGX-2 nodes of 16 V100-32GB, NVSwitch 300 GB/s, 800 Gbps internode).

Conventions of the YAML fields (vendor figures, as printed on data sheets and in the paper):
  * ``intra_node_gbps`` GB/s per GPU over NVLink/NVSwitch, counting *both* directions (V100
    NVLink2: 6 links x 25 GB/s x 2 = 300). A ring collective streams one direction per link,
    so the usable per-direction bandwidth is half of it.
  * ``inter_node_gbps`` Gb/s per node, per direction (sum of the node's compute NICs).
  * ``pcie_gbps`` GB/s host<->device per direction.
  * ``hbm_gbps`` GB/s device memory bandwidth (datasheet; the memory roof of the perf model).
  * ``sm_count`` streaming multiprocessors per device (the perf model's GEMM wave tail).
  * ``device_memory_gb`` in GB = 1e9 bytes, as the paper computes (32 GB V100: Table 2 uses 32e9).
"""
from __future__ import annotations

import platform
from dataclasses import dataclass

from zero_repro.config import ClusterConfig
from zero_repro.scale.paper.clusters import list_clusters, load_cluster

__all__ = ["Hardware", "cpu_model", "hardware", "list_clusters", "load_cluster"]


@dataclass(frozen=True)
class Hardware:
    """SI-unit view of a ClusterConfig used by the performance model."""
    name: str
    gpus_per_node: int
    device_bytes: float  # bytes of device memory (GB = 1e9)
    peak_flops: float  # FLOP/s dense half precision per GPU
    intra_bw: float  # bytes/s per GPU per direction inside a node
    inter_bw_node: float  # bytes/s per node per direction between nodes
    pcie_bw: float  # bytes/s per GPU per direction host<->device
    hbm_bw: float = 0.0  # bytes/s device memory bandwidth (0 = unknown)
    sm_count: int = 0  # streaming multiprocessors per device (0 = unknown)

    @classmethod
    def from_config(cls, c: ClusterConfig) -> "Hardware":
        return cls(name=c.name, gpus_per_node=c.gpus_per_node,
                   device_bytes=c.device_memory_gb * 1e9, peak_flops=c.peak_tflops * 1e12,
                   intra_bw=c.intra_node_gbps * 1e9 / 2, inter_bw_node=c.inter_node_gbps * 1e9 / 8,
                   pcie_bw=c.pcie_gbps * 1e9, hbm_bw=c.hbm_gbps * 1e9,
                   sm_count=c.sm_count)

    def scaled(self, intra: float = 1.0, inter: float = 1.0, pcie: float = 1.0,
               flops: float = 1.0) -> "Hardware":
        """A what-if copy with bandwidths/peak multiplied (used by monotonicity checks)."""
        return Hardware(self.name, self.gpus_per_node, self.device_bytes,
                        self.peak_flops * flops, self.intra_bw * intra,
                        self.inter_bw_node * inter, self.pcie_bw * pcie, self.hbm_bw,
                        self.sm_count)


def hardware(name: str) -> Hardware:
    """``Hardware`` for ``conf/cluster/<name>.yaml``."""
    return Hardware.from_config(load_cluster(name))


def cpu_model() -> str:
    """This machine's CPU model name (``/proc/cpuinfo``; else what ``platform`` knows), for the
    ``hardware`` column of locally measured points."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
