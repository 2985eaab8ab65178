"""How fast, for the estimate (``scale.estimate``): step time, tokens/s, MFU / HFU and the traffic
per rank and step of one configuration, by one of two time models (``Timing.model``):

  * ``modern`` (default): today's stack on the cluster's GPU (``scale.modern_step`` over the
    per-device kernel model ``scale.kernels``): flash attention with causal FLOPs, activation
    checkpointing none | selective | full, bf16 with an fp32 master, the stage's collectives
    with their overlap; every term kept, a band from the kernel inputs' spread;
  * ``paper2020``: the paper's V100 stack calibrated on its Fig 2 (``scale.perf_model`` with
    ``calibrate``'s e_max and comm_eff), every stage; with ZeRO-Offload the host step and the
    PCIe copies of ``scale.offload_time`` added (host work, the calibrated comm_eff on PCIe
    as the model's own P_a+cpu copies), and the compute slowed by the DP collectives it
    hides (``scale.overlap``, the GPU's band: the hidden seconds are the DP term without
    overlap less the term with it; Fig 2's calibration ran without overlap, nothing counted
    twice). The 2020 stack reduces its gradients after backward, as its harness ran DeepSpeed
    0.2 and 2019 Megatron (``era.OVERLAP_COMM_2020``): no DP collective is hidden there, so
    the slowdown is 0 unless a caller's workload overlaps (``_paper2020``).

The GPU of a cluster (``gpu_of``): ``Timing.gpu``, else the one the cluster names
(``ClusterConfig.gpu``), else the one GPU of ``zero_repro.gpus`` whose dense peak and memory
size the cluster states; none: the paper2020 model, said so in the result.
Traffic per rank and step: DP 2Ψ (stages 0-2) or 3Ψ (stage 3) elements (§7; + 2Ψ/G over the
replicas with ``zero.shard_size`` G < N_d), split by link with the ring's (n-1)/n inside a node
and between nodes (``scale.hsdp``); TP the all-reduces of b·s·h (counted 2n each, ``comm``'s
convention). Hierarchical sharding and hpZ are timed by the modern model only.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from zero_repro import config as C
from zero_repro import gpus
from zero_repro.runtime.model import flops
from zero_repro.scale import hsdp as H
from zero_repro.scale import kernels as K
from zero_repro.scale import modern_step as M
from zero_repro.scale import offload_time as OT
from zero_repro.scale import overlap as OV
from zero_repro.scale import calibrate, era, perf_model
from zero_repro.scale.hardware import Hardware
from zero_repro.validation import shard_size_of

MODELS = ("modern", "paper2020")


@dataclass(frozen=True)
class Timing:
    """Which time model and the modern stack's switches (``modern_step.Modern``); ``ac``
    follows the ZeRO-R setting (``ac_of``)."""
    model: str = "modern"
    gpu: str = ""  # zero_repro.gpus key; "": the cluster's (``gpu_of``)
    attention: str = "flash"  # flash | unfused
    every: int = 2  # selective AC: every k-th block checkpointed
    collectives: str = "nccl"  # modern: nccl | ring (``modern_step.Modern``)
    overlap_slowdown: bool = True  # compute slowed by hidden collectives (``scale.overlap``)

    def __post_init__(self):
        if self.model not in MODELS:
            raise ValueError(f"time model {self.model!r}: use one of {MODELS}")
        if self.gpu and self.gpu not in gpus.known():
            raise ValueError(f"--gpu {self.gpu!r}: use one of {sorted(gpus.known())}")
        M.Modern(attention=self.attention, every=self.every,
                 collectives=self.collectives)  # validates


def ac_of(zero_r: str) -> str:
    """The activation-checkpointing mode of a ZeRO-R setting (``scale.estimate.ZERO_R`` names
    and ``selective``)."""
    return {"none": "none", "selective": "selective"}.get(zero_r, "full")


def gpu_of(c: C.ClusterConfig, gpu: str = "") -> str:
    """The cluster's device (module doc); "" when it cannot be told."""
    if gpu:
        return K.device_for(c.name, gpu)
    if c.gpu:
        return gpus.gpu(c.gpu).key
    match = [k for k, s in gpus.known().items()
             if abs(s.peak_tflops - c.peak_tflops) <= 0.01 * s.peak_tflops
             and (c.device_memory_gb <= 0 or abs(s.memory_gb - c.device_memory_gb) <= 2)]
    return match[0] if len(match) == 1 else ""


def workload(cfg: C.Config, hpz: bool | None = None) -> perf_model.Workload:
    """The performance models' view of ``cfg`` (the runtime reduces each bucket as backward
    fills it: ``overlap_comm``); ``hpz``: ZeRO++'s hpZ at stage 3 (None: ``cfg.zero.hpz``
    where the config has it)."""
    m, p, zr = cfg.model, cfg.parallel, cfg.zero_r
    hpz = getattr(cfg.zero, "hpz", False) if hpz is None else hpz
    llama = m.family == "llama"
    return perf_model.Workload(
        n_layer=m.n_layer, hidden=m.n_embd, heads=m.n_head, gpus=p.world_size, tp=p.tp,
        batch_per_gpu=cfg.train.micro_batch_size, seq=m.seq_len,
        vocab=C.padded_vocab(m, p.tp), stage=cfg.zero.stage,
        checkpointing=zr.activation_checkpointing, p_a=zr.partition_activations,
        p_a_cpu=zr.cpu_checkpointing, overlap_comm=True,
        lp_bytes=4 if cfg.zero.dtype == "fp32" else 2, dropout=m.dropout > 0,
        bucket_elems=float(cfg.zero.reduce_bucket_size),
        ffn=C.ffn_width(m) if llama else 0, kv_heads=C.kv_heads(m) if llama else 0,
        offload=cfg.zero.offload_optimizer == "cpu",
        offload_param=cfg.zero.offload_param == "cpu", offload_dpu=cfg.zero.offload_dpu,
        shard_size=shard_of(cfg), hpz=bool(hpz) and cfg.zero.stage == 3)


def shard_of(cfg: C.Config) -> int:
    """G of ``zero.shard_size`` (``validation.shard_size_of``: ``node`` = the cluster's DP
    ranks per node); 0 at stage 0 (it shards nothing)."""
    if cfg.zero.stage == 0:
        return 0
    tp = max(1, cfg.parallel.tp)
    return shard_size_of(cfg.zero.shard_size, max(1, cfg.parallel.world_size // tp),
                         cfg.cluster.gpus_per_node // tp)


def hardware_for(cfg: C.Config) -> Hardware:
    """The cluster's hardware for ``cfg``'s run: a node's host (ZeRO-Offload's RAM, cores and
    DRAM bandwidth, given per GPU) shared by the ranks the run puts on it (one rank on a node
    of four has the node's host)."""
    hw = Hardware.from_config(cfg.cluster)
    per_node = max(1, cfg.cluster.gpus_per_node)
    f = per_node / max(1, min(cfg.parallel.world_size, per_node))
    return dataclasses.replace(hw, host_bytes=hw.host_bytes * f, host_cores=hw.host_cores * f,
                               host_mem_bw=hw.host_mem_bw * f)


def traffic(cfg: C.Config, w: perf_model.Workload, recompute: float) -> dict:
    """DP and TP bytes per rank and step (module doc), the DP bytes inside a node and between
    nodes (ring); PCIe bytes of ZeRO-Offload (both directions)."""
    m, b, lp = cfg.model, w.batch_per_gpu, w.lp_bytes
    psi = w.params / w.tp
    mesh = H.mesh_of(w, cfg.cluster.gpus_per_node)
    dp_elems = H.paper_volume(psi, w.stage, mesh, w.hpz) if w.dp > 1 else 0.0
    split = H.comm_ledger(psi, w.stage, w.dp, mesh.shard_size, mesh.per_node, w.hpz, lp)
    n_tp = (m.n_layer * (4 + 2 * recompute) + 2) if w.tp > 1 else 0
    return {"dp_bytes": dp_elems * lp, "dp_intra_bytes": split["intra"],
            "dp_inter_bytes": split["inter"], "tp_bytes": n_tp * 2.0 * b * m.seq_len * m.n_embd * lp,
            "pcie_bytes": OT.pcie_bytes(w)}


def performance(cfg: C.Config, hw: Hardware, params: perf_model.PerfParams | None,
                timing: Timing | None = None, zero_r: str = "ckpt",
                hpz: bool | None = None) -> dict:
    """Step time by component, tokens/s, MFU and the traffic of ``cfg`` (module doc), with
    hpZ where ``hpz`` (``workload``). Empty when the cluster has no peak FLOP/s."""
    if hw.peak_flops <= 0:
        return {}
    timing = timing or Timing()
    gpu = gpu_of(cfg.cluster, timing.gpu) if timing.model == "modern" else ""
    w = workload(cfg, hpz)
    if gpu:
        return _modern(cfg, w, hw, gpu, timing, zero_r)
    if H.hierarchical(w):
        raise ValueError("zero.shard_size < N_d and hpZ are timed by the modern time model "
                         "only: name the GPU (--gpu) and drop --time-model paper2020")
    if timing.model == "paper2020":  # the 2020 stack reduces after backward (module doc)
        w = dataclasses.replace(w, overlap_comm=era.OVERLAP_COMM_2020)
    out = _paper2020(cfg, w, hw, params, gpu_of(cfg.cluster, timing.gpu), timing)
    if timing.model == "modern":
        out["note"] = "no GPU named (--gpu): the paper2020 model"
    return out


def _paper2020(cfg: C.Config, w: perf_model.Workload, hw: Hardware,
               params: perf_model.PerfParams | None, gpu: str = "",
               timing: Timing | None = None) -> dict:
    """``perf_model`` with the Fig 2 calibration (``calibrate.calibration``) unless given,
    plus ZeRO-Offload's host work and the overlap slowdown (module doc)."""
    params = params or calibrate.calibration().params
    t = perf_model.step_time(w, hw, params)
    extra = _paper2020_extra(w, hw, params, gpu, timing or Timing(model="paper2020"), t)
    total = t["total"] + sum(extra.values())
    b, s = w.batch_per_gpu, cfg.model.seq_len
    model_flops = flops.flops_per_iteration_cfg(cfg.model, b * w.dp, recompute=False, tp=w.tp)
    return {"model": "paper2020", "step_s": total, "compute_s": t["compute"],
            "tp_s": t["tp_comm"], "dp_s": t["dp_comm"], "pa_s": t["pa_comm"],
            "offload_s": t["cpu_offload"], "tokens_per_s": b * s * w.dp / total,
            "mfu": model_flops / (w.gpus * hw.peak_flops * total),
            "tflops_per_gpu": t["tflops_per_gpu"] * t["total"] / total,
            "overlap_slowdown_s": extra["overlap_slowdown"],
            "host_s": extra["host_adam"], "pcie_s": extra["pcie_exposed"], "gpu": gpu,
            **traffic(cfg, w, 1.0 if w.checkpointing else 0.0), "batch": b}


def _paper2020_extra(w: perf_model.Workload, hw: Hardware, params: perf_model.PerfParams,
                     gpu: str, timing: Timing, t: dict) -> dict:
    """The overlap slowdown (0 where no GPU is known: its band is per generation) and
    ZeRO-Offload's exposed host step and PCIe copies of the paper2020 model (module doc)."""
    out = {"overlap_slowdown": 0.0, "host_adam": 0.0, "pcie_exposed": 0.0}
    if timing.overlap_slowdown and w.overlap_comm and gpu:
        serial = perf_model.step_time(dataclasses.replace(w, overlap_comm=False), hw, params)
        out["overlap_slowdown"] = OV.slowdown(gpu, serial["dp_comm"] - t["dp_comm"])
    if w.offload or w.offload_param:
        t_fwd = t["compute"] / (4.0 if w.checkpointing else 3.0)
        hw_pcie = dataclasses.replace(hw, pcie_bw=hw.pcie_bw * params.comm_eff)
        ot = OT.terms(w, hw_pcie, _CALIBRATED_PCIE, t["compute"] - t_fwd, "mid", t_fwd)
        out["host_adam"], out["pcie_exposed"] = ot["host_adam"], ot["pcie_exposed"]
    return out


@dataclasses.dataclass(frozen=True)
class _CalibratedLinks:
    """The kernel model's link view with PCIe at efficiency 1: the paper2020 model scales the
    bandwidth by its calibrated comm_eff instead (``_paper2020_extra``)."""
    links: dict


_CALIBRATED_PCIE = _CalibratedLinks({"pcie": K.Band(1.0, 1.0, 1.0)})


def _modern(cfg: C.Config, w: perf_model.Workload, hw: Hardware, gpu: str, timing: Timing,
            zero_r: str) -> dict:
    ac = ac_of(zero_r)
    if ac == "selective":
        w = dataclasses.replace(w, checkpointing=True)
    m = M.Modern(ac=ac, every=timing.every, attention=timing.attention,
                 collectives=timing.collectives, overlap_slowdown=timing.overlap_slowdown)
    r = M.step(w, hw, K.device_kernels(gpu), m)
    terms = r["terms"]
    compute = sum(terms[k] for k in M.TERMS if k not in (
        "tp_comm", "dp_exposed", "pa_comm", "cpu_offload", "pcie_exposed", "host_adam",
        "overlap_slowdown"))
    return {"model": "modern", "gpu": gpu, "ac": ac, "attention": timing.attention,
            "every": timing.every if ac == "selective" else 0,
            "step_s": r["step_s"], "step_s_band": list(r["step_s_band"]), "compute_s": compute,
            "tp_s": terms["tp_comm"], "dp_s": terms["dp_exposed"], "pa_s": terms["pa_comm"],
            "offload_s": terms["cpu_offload"], "dp_total_s": r["dp_total"], "terms": terms,
            "pcie_total_s": r["pcie_total"], "host_rate": r["host_rate"],
            "largest": [list(x) for x in r["largest"]],
            "tokens_per_s": r["tokens_per_s"], "tokens_per_s_gpu": r["tokens_per_s"] / w.gpus,
            "mfu": r["mfu"], "hfu": r["hfu"], "band": r["band"],
            "tflops_per_gpu": r["flops"]["hardware"] / r["step_s"] / 1e12,
            "flops_per_gpu": r["flops"], **traffic(cfg, w, r["recompute_fraction"]),
            "batch": w.batch_per_gpu}


def bandwidth_sweep(cfgs: dict, gbps, params: perf_model.PerfParams | None,
                    timing: Timing | None = None, zero_r: str = "ckpt") -> dict:
    """Step time (s) per stage config of ``cfgs`` (stage -> Config) at each inter-node
    bandwidth in ``gbps`` (Gbit/s per node), the rest of each cluster as it is."""
    out = {}
    for s, cfg in cfgs.items():
        row = []
        for g in gbps:
            c = dataclasses.replace(cfg, cluster=dataclasses.replace(
                cfg.cluster, inter_node_gbps=float(g)))
            row.append(performance(c, hardware_for(c), params, timing, zero_r)["step_s"])
        out[s] = row
    return out
