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
  * ``host_memory_gb``, ``host_cores``, ``host_memory_gbps``: a node's host RAM (GB = 1e9 B),
    CPU cores and DRAM channels' line rate (GB/s) divided by ``gpus_per_node`` (ZeRO-Offload's
    host memory verdict and host step, ``scale.offload_time``).
  * ``device_memory_gb`` the datasheet size in GB = 1e9 bytes, as the paper's closed-form
    Tables 1/2 compute (32 GB V100: 32e9); ``nominal_bytes``. Nothing physical uses it.
  * ``device_memory_mib`` the total the device reports (nvidia-smi / NVML, MiB = 2^20 B; each
    yaml cites its source): ``device_bytes``, what an allocator on it can ever hold (V100-32GB:
    32510 MiB = 31.75 GiB = 34.09e9 B). What the CUDA context and NCCL take out of it is the
    software stack's (``dryrun.stack.outside``).
"""
from __future__ import annotations

import platform
from dataclasses import dataclass

from zero_repro.config import ClusterConfig
from zero_repro.scale.paper.clusters import list_clusters, load_cluster

__all__ = ["Hardware", "cpu_model", "device_bytes", "hardware", "list_clusters", "load_cluster"]


@dataclass(frozen=True)
class Hardware:
    """SI-unit view of a ClusterConfig used by the performance model."""
    name: str
    gpus_per_node: int
    device_bytes: float  # bytes of device memory as the device reports it (device_bytes())
    peak_flops: float  # FLOP/s dense half precision per GPU
    intra_bw: float  # bytes/s per GPU per direction inside a node
    inter_bw_node: float  # bytes/s per node per direction between nodes
    pcie_bw: float  # bytes/s per GPU per direction host<->device
    nominal_bytes: float = 0.0  # datasheet size, GB = 1e9 (closed-form Tables 1/2 only)
    hbm_bw: float = 0.0  # bytes/s device memory bandwidth (0 = unknown)
    sm_count: int = 0  # streaming multiprocessors per device (0 = unknown)
    # the host per GPU (ZeRO-Offload): RAM bytes, CPU cores, DRAM line rate bytes/s; 0 = unknown
    host_bytes: float = 0.0
    host_cores: float = 0.0
    host_mem_bw: float = 0.0
    # a host core's fp32 lanes per cycle and its clock (base, turbo; Hz): 0 = unknown
    host_lanes: float = 0.0
    host_clock: tuple[float, float] = (0.0, 0.0)

    @classmethod
    def from_config(cls, c: ClusterConfig) -> "Hardware":
        return cls(name=c.name, gpus_per_node=c.gpus_per_node,
                   device_bytes=device_bytes(c), peak_flops=c.peak_tflops * 1e12,
                   intra_bw=c.intra_node_gbps * 1e9 / 2, inter_bw_node=c.inter_node_gbps * 1e9 / 8,
                   pcie_bw=c.pcie_gbps * 1e9, nominal_bytes=c.device_memory_gb * 1e9,
                   hbm_bw=c.hbm_gbps * 1e9, sm_count=c.sm_count,
                   host_bytes=c.host_memory_gb * 1e9, host_cores=c.host_cores,
                   host_mem_bw=c.host_memory_gbps * 1e9, host_lanes=c.host_fp32_lanes,
                   host_clock=(c.host_ghz * 1e9, (c.host_turbo_ghz or c.host_ghz) * 1e9))

    def scaled(self, intra: float = 1.0, inter: float = 1.0, pcie: float = 1.0,
               flops: float = 1.0) -> "Hardware":
        """A what-if copy with bandwidths/peak multiplied (used by monotonicity checks)."""
        return Hardware(self.name, self.gpus_per_node, self.device_bytes,
                        self.peak_flops * flops, self.intra_bw * intra,
                        self.inter_bw_node * inter, self.pcie_bw * pcie, self.nominal_bytes,
                        self.hbm_bw, self.sm_count, self.host_bytes, self.host_cores,
                        self.host_mem_bw, self.host_lanes, self.host_clock)


MIB = 2**20


def device_bytes(c: ClusterConfig) -> float:
    """Bytes of device memory as the device reports them: ``device_memory_mib``·2^20; a
    cluster without it (a what-if size given in GB) falls back to ``device_memory_gb``·1e9.
    0: unknown / unbounded (CPU)."""
    if c.device_memory_mib > 0:
        return c.device_memory_mib * MIB
    return c.device_memory_gb * 1e9


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
