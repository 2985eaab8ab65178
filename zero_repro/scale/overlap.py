"""Compute slowed by the communication it hides (the time models' ``overlap_slowdown`` term,
``scale.modern_step`` and ``scale.estimate_time``): while an NCCL collective runs beside the
forward or backward, its kernels hold SMs (one CTA per channel) and share HBM bandwidth, so
the compute they overlap runs slower than alone. For a collective hidden for H seconds behind
compute (H = its time less its exposed part, ``modern_step.exposed``):

    T_overlap_slowdown = s · H

s is the fractional slowdown of compute kernels while a collective runs beside them, a band
per GPU generation from kernel-level measurements (never from end-to-end runs):

  * low: the SMs NCCL's channels take, c / SMs (a GEMM of whole waves loses that share and
    nothing else): c = 16 collective channels on today's NCCL -- NVIDIA/nccl#892's NCCL log on
    8 x H800 ("16 coll channels"); on the Volta generation the paper's NCCL 2.4.8 builds 12
    NVSwitch channels (6 NVLinks, doubled: NVIDIA/nccl@v2.4.8 transport/p2p.cc, as
    ``dryrun.stack.outside`` counts them); SMs the GPU's datasheet (``zero_repro.gpus``).
    H100 16/132 = 0.12, A100 16/108 = 0.15, V100 12/80 = 0.15;
  * mid: 18.9%, the average compute slowdown under overlapped communication measured on A100
    and H100 (and MI250 / MI210) by Characterizing Compute-Communication Overlap in
    GPU-Accelerated Distributed Deep Learning (arXiv:2507.03114, abstract), at least the low;
  * high: 40.0%, that study's maximum. Worse happens: a GEMM of exactly one wave of 132 tiles
    beside a 24-block all-gather on H100 ran nearly 2x slower (NVIDIA developer forum,
    "Compute-Communication Overlap Causes Severe GEMM Performance Degradation because of
    Tail Effect", nsys), a wave-quantization case the band does not cover.

Applied to the data-parallel collectives the stage overlaps (stage 0's all-reduce, stage 2's
reduce-scatter, stage 3's gathers and reduce-scatter); TP all-reduces and P_a's gathers are
not overlapped, ZeRO-Offload's PCIe copies run on copy engines (no SMs).
"""
from __future__ import annotations

from zero_repro import gpus
from zero_repro.scale.dryrun.stack.outside import NVSWITCH_CHANNELS

CHANNELS = 16  # NCCL collective channels = CTAs, today's NCCL (module doc)
CHANNELS_OF = {"volta": NVSWITCH_CHANNELS}  # NCCL 2.4.8 on the DGX-2's NVSwitch
MEASURED_MEAN = 0.189  # arXiv:2507.03114: average compute slowdown when overlapped
MEASURED_MAX = 0.400  # the same study's maximum
SOURCES = ("NVIDIA/nccl#892 (16 coll channels); NVIDIA/nccl@v2.4.8 transport/p2p.cc (12 "
           "NVSwitch channels, V100)", "arXiv:2507.03114 (18.9% mean, 40.0% max compute slowdown)")


def band(gpu: str) -> dict:
    """{"low", "mid", "high"} fractional compute slowdown while overlapped, GPU ``gpu``
    (``zero_repro.gpus`` key; module doc)."""
    g = gpus.gpu(gpu)
    if g.sm_count <= 0:
        raise ValueError(f"GPU {gpu!r} states no SM count: add sm_count to zero_repro/gpus/")
    low = CHANNELS_OF.get(g.generation, CHANNELS) / g.sm_count
    return {"low": low, "mid": max(low, MEASURED_MEAN), "high": max(low, MEASURED_MAX)}


def slowdown(gpu: str, hidden_s: float, point: str = "mid") -> float:
    """Seconds the compute loses to ``hidden_s`` seconds of overlapped collectives. ``point``
    low | mid | high is the time model's band point: its slow edge ("low" throughput) takes
    the largest slowdown."""
    s = band(gpu)
    return max(0.0, hidden_s) * {"low": s["high"], "mid": s["mid"], "high": s["low"]}[point]
