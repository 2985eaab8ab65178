"""Per-device kernel model of today's GPUs: how long a GEMM, a flash-attention call, a
memory-bound kernel and a collective's bytes take on one device, from the kernel-level facts of
``zero_repro.gpus`` (each GPU's) and ``scale.kernel_sources`` (no one GPU's): nothing fitted,
nothing taken from end-to-end training runs. The paper's V100 stack keeps its own Fig 2
calibration (``scale.perf_model``); this model is the modern stack's.

Every efficiency is a ``Band`` (low, mid, high) over its sources: low and high the smallest and
largest source, mid their median (attention on Hopper: the midpoint of the FlashAttention-2
and FlashAttention-3-class kernels, which PyTorch's SDPA may dispatch to either of by version).
A ``point`` (low | mid | high) picks one edge of every band at once: the estimate's uncertainty.

    GEMM (M, N, K) x batch     t = 2·M·N·K·batch / (peak · e_gemm) + t_start,
                                   floored by its bytes 2·(MK + KN + MN)·batch / (hbm · e_hbm)
    flash attention            t = F / (peak · e_attn[direction, causal]) + t_start,
                                   F_fwd = 4·b·a·s²·d (x 1/2 causal), F_bwd = 2.5 · F_fwd
    memory-bound kernels       t = bytes / (hbm · e_hbm)
    ring collective            bandwidth = line rate per direction · e_link (NVLink, PCIe or
                                   the network, ``LINK_OF``)

e_gemm is the best-shape efficiency of cuBLAS bf16 matmuls (MAMF / TPD); the model has no tile
or wave quantization: shapes with M, N, K >= 2048 reproduce the sources within 12%
(``GEMM_ERROR``), 1024^3-class shapes are slower than it says (launch- and tail-bound; no
training shape here is that small). t_start = 2.5 us per kernel (RRZE's back-to-back kernel
start-up on H200; stands in for every device).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from zero_repro import gpus
from zero_repro.scale import kernel_sources as S
from zero_repro.scale.paper.clusters import list_clusters, load_cluster

POINTS = ("low", "mid", "high")
GEMM_ERROR = 0.12  # stated error of the GEMM model against its sources, M, N, K >= 2048
FLASH_BWD_FACTOR = 2.5  # backward = 2 GEMMs of the forward's + recompute of P (FA convention)


@dataclass(frozen=True)
class Band:
    """An efficiency as (low, mid, high) with where it comes from; ``proxy`` names the device
    whose numbers stand in when the device itself has none."""
    low: float
    mid: float
    high: float
    sources: tuple = ()
    proxy: str = ""

    def at(self, point: str) -> float:
        if point not in POINTS:
            raise ValueError(f"point {point!r}: use one of {POINTS}")
        return {"low": self.low, "mid": self.mid, "high": self.high}[point]


def band(values, sources, proxy: str = "") -> Band:
    """min, median, max of ``values``."""
    v = sorted(values)
    return Band(v[0], statistics.median(v), v[-1], tuple(sources), proxy)


@dataclass(frozen=True)
class DeviceKernels:
    """The kernel model of one GPU (``zero_repro.gpus`` key): efficiencies by kind, each a Band."""
    key: str
    spec: gpus.Gpu
    gemm: Band
    attn: dict  # (direction, causal) -> Band; direction fwd | bwd
    hbm: Band
    links: dict  # nvlink | pcie | network -> Band
    attention_kernel: str  # what the flash path is, in words


# ------------------------------------------------------------------------------ the bands
def _points_band(g: gpus.Gpu, kind: str) -> Band:
    pts = [p for p in g.of(kind) if not p.check_only]
    if not pts:
        raise ValueError(f"GPU {g.key!r} has no {kind} point: add one with its source to "
                         f"zero_repro/gpus/{g.key}.py")
    return band([p.value / g.ref(p) for p in pts], [p.source for p in pts])


_ATTN_KEYS = tuple((d, c) for d in ("fwd", "bwd") for c in (False, True))
_FLASH_WORDS = {"fa1": "memory-efficient SDPA (no flash kernel on sm70)",
                "fa2": "FlashAttention-2 (SDPA flash backend)",
                "fa2_fa3": "FlashAttention-2 .. FlashAttention-3 class (SDPA flash / cuDNN)"}


def _attention(g: gpus.Gpu) -> tuple[dict, str]:
    """(direction, causal) -> Band, and the kernel's name, by the GPU's generation's attention
    class (module doc)."""
    gen = g.gen
    if gen.flash == "fa2_fa3":
        return _measured_attention(g), _FLASH_WORDS[gen.flash]
    if gen.flash == "fa1":
        b = band(S.FA1_RANGE, ("FA2abs: FlashAttention-1 class 25-40% (A100)",), gen.proxy)
    else:
        b = band(S.FA2_A100_RANGE, ("FA2abs: 50-73% of peak on A100",), gen.proxy)
    return {k: b for k in _ATTN_KEYS}, _FLASH_WORDS[gen.flash]


def _measured_attention(g: gpus.Gpu) -> dict:
    """From the attention points of the GPU's generation: low and high the FlashAttention-2
    and FlashAttention-3-class kernels' edges, mid the midpoint of their medians."""
    same = [h for h in gpus.known().values() if h.generation == g.generation
            and any(p.kind.startswith("attn") for p in h.points)]
    if not same:
        raise ValueError(f"GPU {g.key!r}: no GPU of generation {g.generation} has flash-"
                         f"attention points; add them to zero_repro/gpus/{g.key}.py")
    src = g if g in same else same[0]
    out = {}
    for d, causal in _ATTN_KEYS:
        kind = f"attn_{d}" + ("_causal" if causal else "")
        fa2 = [p for p in src.of(kind) if p.kernel == "fa2"]
        fa3 = [p for p in src.of(kind) if p.kernel == "fa3"]
        lo = band([p.value / src.ref(p) for p in fa2], ())
        hi = band([p.value / src.ref(p) for p in fa3], ())
        out[(d, causal)] = Band(lo.low, (lo.mid + hi.mid) / 2, hi.high,
                                tuple(p.source for p in fa2 + fa3),
                                "" if src is g else src.key)
    return out


def _links(g: gpus.Gpu) -> dict:
    def from_table(name, proxy=""):
        vals = S.LINK[name]
        return band([v for v, _ in vals], [s for _, s in vals], proxy)
    return {"nvlink": from_table(g.gen.nvlink, g.gen.proxy), "pcie": from_table("pcie"),
            "network": from_table("network")}


def device_kernels(key: str) -> DeviceKernels:
    """The kernel model of GPU ``key`` (``zero_repro.gpus``); ValueError naming the known
    GPUs for an unknown one."""
    g = gpus.gpu(key)
    attn, kernel = _attention(g)
    return DeviceKernels(key, g, _points_band(g, "gemm"), attn, _points_band(g, "hbm"),
                         _links(g), kernel)


def device_for(cluster_name: str, gpu: str = "") -> str:
    """The GPU key of a cluster: ``gpu`` when given, else the one ``conf/cluster/<name>.yaml``
    names (``gpu:``)."""
    if gpu:
        return gpus.gpu(gpu).key
    key = load_cluster(cluster_name).gpu if cluster_name in list_clusters() else ""
    if not key:
        raise ValueError(f"cluster {cluster_name!r} names no GPU: name it with --gpu "
                         f"({', '.join(sorted(gpus.known()))})")
    return key


# ------------------------------------------------------------------------------ the kernels
def gemm_seconds(dk: DeviceKernels, peak: float, hbm: float, m: float, n: float, k: float,
                 batch: float = 1.0, point: str = "mid") -> float:
    """One (batched) GEMM call: compute at e_gemm·peak, floored by its bytes at the memory
    roof, plus the kernel start (module doc). ``peak`` FLOP/s, ``hbm`` bytes/s."""
    compute = 2.0 * m * n * k * batch / (peak * dk.gemm.at(point))
    memory = 2.0 * (m * k + k * n + m * n) * batch / (hbm * dk.hbm.at(point))
    return max(compute, memory) + S.KERNEL_START_S


def attention_flops(b: float, heads: float, s: float, d: float, causal: bool,
                    direction: str) -> float:
    """FLOPs of a flash-attention call as its benchmarks count them (module doc)."""
    f = 4.0 * b * heads * s * s * d * (0.5 if causal else 1.0)
    return f * (FLASH_BWD_FACTOR if direction == "bwd" else 1.0)


def attention_seconds(dk: DeviceKernels, peak: float, b: float, heads: float, s: float,
                      d: float, causal: bool, direction: str, point: str = "mid") -> float:
    """One flash-attention call over b·heads heads of length s, head size d."""
    f = attention_flops(b, heads, s, d, causal, direction)
    return f / (peak * dk.attn[(direction, causal)].at(point)) + S.KERNEL_START_S


def memory_seconds(dk: DeviceKernels, hbm: float, nbytes: float, point: str = "mid") -> float:
    """Memory-bound kernels moving ``nbytes`` through device memory."""
    return nbytes / (hbm * dk.hbm.at(point))


def link_efficiency(dk: DeviceKernels, link: str, point: str = "mid") -> float:
    """Fraction of a link's per-direction line rate NCCL's ring collectives reach."""
    return dk.links[link].at(point)


def intra_link(dk: DeviceKernels) -> str:
    """The link GPUs of one node share: NVLink / NVSwitch, or PCIe on the L40S."""
    return "nvlink" if dk.spec.nvlink else "pcie"


def sources_table() -> list[dict]:
    """Every kernel-level input as rows (device, kind, shape, value, efficiency, source), for
    the results notes and the JSON."""
    return [{"device": k, "kind": p.kind, "shape": list(p.shape), "value": p.value,
             "efficiency": round(p.value / gpus.gpu(k).ref(p), 4), "source": p.source,
             "measured_on": p.measured_on or k, "check_only": p.check_only}
            for k, p in S.points()]
