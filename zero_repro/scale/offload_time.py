"""Time of ZeRO-Offload's part of a step (Ren et al. 2021, §4; ``runtime.zero.offload``) for the
modern step model (``scale.modern_step``): the host AdamW and the PCIe copies, per rank.

With S = this rank's shard (Ψ/t/N_d, stage 0: Ψ/t), lp bytes per training-dtype element:

    T_host = S / R_host,   R_host = min(c · r_core, e_dram · B_dram / HOST_BYTES)
    T_pcie = lp·S / (B_pcie · e_pcie)                           each way (D2H gradients, H2D
                                                                parameters: two copy engines)
    every stage: the D2H runs in backward as buckets land (the device keeps no gradient store:
                 ``runtime.zero.offload.HostGradShards``): exposed max(T_pcie - W_bwd, T_pcie / u)
    step phase: max(T_host, T_pcie) + the last chunk's H2D = T_host + ``pcie_exposed``'s share

With ZeRO-3 Offload (``zero.offload_param=cpu``, stage 3) the parameter shard lives on the host:
every gather first copies this rank's chunk to the device, T_param = g·lp·S / (B_pcie · e_pcie)
with g = 2 gathers per step (forward, backward), on the H2D engine beside the all-gathers and,
like them, prefetched a unit ahead: exposed max(T_param - W, T_param / u) over the forward and
backward window W; the step's H2D of the updated parameters is a host copy then (into the host
shard), so the step phase loses its last H2D. Without the optimizer offloaded only T_param
applies (the optimizer steps on the device).

(u the gradient buckets, stage 3 the blocks; c host cores per GPU, B_dram the host DRAM
bandwidth per GPU, B_pcie the host<->device bandwidth per direction: the cluster's
``host_cores``, ``host_memory_gbps``, ``pcie_gbps``). The host step is not overlapped with the
device's compute, except with the delayed parameter update (``zero.offload_dpu``, §4.2: the host
step of step t runs beside step t+1's forward and backward, W): its exposed part is then
max(T_host - W, 0). Sources of the rates:

  * r_core, the cluster's host core: the host step's compute rate measured here with the data
    in cache (``HOST_ADAM_CACHE``: ``python -m zero_repro.lab.host_adam --elements 256K
    --threads 1 --repeats 9``, three runs, results/offload/host_adam_cache_run*.json; the
    kernel is vectorised: at ATEN_CPU_CAPABILITY=default it runs 12x slower, results/offload/
    notes.md), scaled by the fp32 lanes a core retires per cycle and its clock:

        r_core = r_cache · (L_c · f_c) / (L_here · f_here)

    L the lanes (FMA pipes x vector width / 32; here an AMD EPYC Zen 4 core, two 256-bit FMA
    pipes that also run AVX-512 double-pumped: L = 16, measured AVX2 within 10% of AVX-512),
    f the clock: the band's low end takes the cluster's base clock over this machine's highest
    turbo, the high end the cluster's turbo over this machine's base, the middle the means
    (``HERE_CLOCK``: a KVM guest of a Zen 4 EPYC, TSC 2.6 GHz; the EPYC 9004 parts' turbo up to
    3.7 GHz and more). A cluster that does not give its lanes and clock
    (``host_fp32_lanes``, ``host_ghz``) takes ``HOST_ADAM_PER_CORE``: this machine's own core
    streaming a 64M-element shard from DRAM (``python -m zero_repro.lab.host_adam --elements
    64M --threads 1 --repeats 7``; four runs; slowest and fastest repeat, median of medians),
    and the estimate says so. On every cluster in ``conf/cluster/`` the host's DRAM binds
    before its cores (the estimate prints both sides of the min).
  * HOST_BYTES: the host step's DRAM traffic per element: read the lp gradient 2, master 4,
    m 4, v 4; write master 4, m 4, v 4, the lp parameter 2 = 28 B (the fp32 scratch block
    stays in cache).
  * e_dram (``DRAM_EFFICIENCY``): the fraction of the DRAM channels' line rate a streaming
    kernel reaches; STREAM triad measures 74-78% of the wire rate on the DDR4 system of TI's
    SPRAD45A (section 3.1.2); the band 0.6-0.8 widens it for many-core server sockets (not
    measured here).
  * e_pcie: ``kernels.link_efficiency(dk, "pcie")`` (BAM54: 12 of 16 GB/s Gen3, 25 of 32 GB/s
    Gen4 measured).
"""
from __future__ import annotations

import math

from zero_repro.scale import kernels as K

HOST_BYTES = 28.0  # DRAM bytes per element of the host step (module docstring)
# elements/s of one core, the host step over a DRAM-resident shard (measured: module doc)
HOST_ADAM_PER_CORE = {"low": 0.50e9, "mid": 0.96e9, "high": 1.00e9}
HOST_ADAM_SOURCE = ("measured here: python -m zero_repro.lab.host_adam --elements 64M "
                    "--threads 1 --repeats 7 (results/offload/notes.md)")
# elements/s of one core here with the shard in cache (compute-bound): the slowest run's median,
# the median of the three runs' medians, the fastest repeat (module docstring)
HOST_ADAM_CACHE = {"low": 1.226e9, "mid": 1.347e9, "high": 1.378e9}
HERE_LANES = 16  # Zen 4: two 256-bit FMA pipes (AVX-512 double-pumped)
HERE_CLOCK = (2.6e9, 3.7e9)  # base (the guest's TSC) and turbo of this machine's core, Hz
DRAM_EFFICIENCY = {"low": 0.6, "mid": 0.7, "high": 0.8}


def core_rate(lanes: float, clock: tuple[float, float], point: str = "mid") -> float:
    """Elements/s of one host core of a cluster whose core retires ``lanes`` fp32 lanes per
    cycle at ``clock`` = (base, turbo) Hz (module docstring); this machine's own DRAM-bound
    core (``HOST_ADAM_PER_CORE``) when the cluster does not say."""
    if lanes <= 0 or clock[0] <= 0:
        return HOST_ADAM_PER_CORE[point]
    base, turbo = clock[0], max(clock)
    f_c = {"low": base, "mid": (base + turbo) / 2, "high": turbo}[point]
    f_here = {"low": HERE_CLOCK[1], "mid": sum(HERE_CLOCK) / 2, "high": HERE_CLOCK[0]}[point]
    return HOST_ADAM_CACHE[point] * lanes * f_c / (HERE_LANES * f_here)


def host_rate(cores: float, dram_bytes_s: float, point: str = "mid", lanes: float = 0.0,
              clock: tuple[float, float] = (0.0, 0.0)) -> float:
    """Elements/s of the host step for one GPU's share of the host (module docstring); 0 when
    the cluster does not say its host cores."""
    if cores <= 0:
        return 0.0
    rate = cores * core_rate(lanes, clock, point)
    if dram_bytes_s > 0:
        rate = min(rate, DRAM_EFFICIENCY[point] * dram_bytes_s / HOST_BYTES)
    return rate


def shard_elements(w) -> float:
    """This rank's optimizer shard (``perf_model.Workload``)."""
    return w.params / w.tp / (w.dp if w.stage >= 1 else 1)


PARAM_GATHERS = 2  # a stage-3 unit is gathered in forward and again in backward


def pcie_bytes(w) -> float:
    """Bytes over PCIe per rank and step, both directions together."""
    s = w.lp_bytes * shard_elements(w)
    grads_and_step = (1.0 if getattr(w, "offload_param", False) else 2.0) * s
    return (grads_and_step if w.offload else 0.0) + \
        (PARAM_GATHERS * s if getattr(w, "offload_param", False) else 0.0)


def terms(w, hw, dk, bwd_window: float, point: str = "mid",
          fwd_window: float = 0.0) -> dict:
    """``host_adam`` and ``pcie_exposed`` seconds of ``w`` (0 without offload) and the PCIe
    copies' total ``pcie_total`` (module docstring)."""
    param = bool(getattr(w, "offload_param", False))
    if not w.offload and not param:
        return {"host_adam": 0.0, "pcie_exposed": 0.0, "pcie_total": 0.0}
    s = shard_elements(w)
    bw = hw.pcie_bw * K.link_efficiency(dk, "pcie", point)
    t_copy = w.lp_bytes * s / bw if bw > 0 else math.inf
    units = w.n_layer if w.stage == 3 else max(1, math.ceil(w.params / w.tp / w.bucket_elems))
    t_host, exposed, total = 0.0, 0.0, 0.0
    if w.offload:
        rate = host_rate(hw.host_cores, hw.host_mem_bw, point, hw.host_lanes, hw.host_clock)
        t_host = s / rate if rate > 0 else math.inf
        d2h = max(t_copy - bwd_window, t_copy / units)  # gradients leave during backward
        h2d = 0.0 if param else t_copy / units  # the last chunk back (param: a host copy)
        exposed += d2h + max(t_host, 0.0 if param else t_copy) + h2d - t_host
        total += (1 if param else 2) * t_copy
        if getattr(w, "offload_dpu", False):  # hidden behind the next forward and backward
            t_host = max(t_host - (fwd_window + bwd_window), 0.0)
    if param:
        t_param = PARAM_GATHERS * t_copy
        exposed += max(t_param - (fwd_window + bwd_window), t_param / units)
        total += t_param
    return {"host_adam": t_host, "pcie_exposed": exposed, "pcie_total": total}
