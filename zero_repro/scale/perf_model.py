"""Closed-form time per iteration (compute + alpha-beta communication over the real topology) and
TFLOPs/GPU for a ZeRO / Megatron training point (paper §7-8 communication, §10 Figures 2, 3, 4,
8). ``step_time(workload, hardware, params)``, ``simulate``:

    T = T_compute + T_tp + T_dp,exposed + T_Pa + T_cpu

* Compute: F/MP FLOPs per GPU (F: Megatron's convention with recompute,
  ``zero_repro.runtime.model.flops``) at peak · eff, eff = e_max · x / (x + x_half) with
  x = 72·h²·(1 + s/(6h)) / (a·s), the GEMM work per memory-bound attention-score element.
* Collectives: ring closed forms (n ranks, S bytes of the full buffer, per-rank bandwidth B,
  per-step latency α): all-reduce 2(n-1)/n·S/B + 2(n-1)α; reduce-scatter and all-gather
  (n-1)/n·S/B + (n-1)α. B is the group's bottleneck link: NVSwitch per GPU per direction inside
  a node; across nodes the node's NICs shared by the groups with members on it (MP 16 on a
  16-GPU node: 16 DP groups of one GPU each share 800 Gb/s). The fitted
  ``comm_eff`` scales the InfiniBand and PCIe bandwidths; NVSwitch runs at its spec.
* TP: per block 2 all-reduces of b·s·h forward, 2 backward, 2 in the recompute (the paper's
  "12·s·h per block", §8) + 2 for the vocab-parallel embedding/head; over NVSwitch when MP <=
  GPUs per node, else over InfiniBand (the baseline's collapse at >= 40B).
* DP: stage 0 all-reduces the lp gradients (Megatron 2019: after backward; PyTorch DDP with
  ``overlap_comm``: bucketed during backward); stages 1-2 reduce-scatter them (hidden behind
  backward with ``overlap_comm``: exposed = max(0, T_rs - T_backward)) and all-gather the lp
  parameters after the step (always exposed); stage 3 all-gathers in forward and in backward
  and reduce-scatters, overlapped likewise.
* P_a: one TP all-gather of b·s·h per block in backward (§8); P_a+cpu: 2x the partitioned
  checkpoint bytes over PCIe, the device->host copy overlapping forward, host->device in
  backward synchronous.

Not modelled: the optimizer step, pipeline bubbles, allocator stalls and fragmentation,
stragglers. Alternatives tried and their errors: ``results/fig2_throughput/notes.md``.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from zero_repro.runtime.model.flops import flops_per_iteration
from zero_repro.scale.paper.buckets import REDUCE_BUCKET
from zero_repro.scale.hardware import Hardware

# Per-step latencies of a ring (NCCL-like), not fitted: they matter only for the baseline's
# hundreds-of-ranks TP rings; the ZeRO points are bandwidth bound.
ALPHA_INTRA = 5e-6
ALPHA_INTER = 10e-6


@dataclass(frozen=True)
class Workload:
    """One training point: model shape, parallel layout and ZeRO/ZeRO-R switches."""
    n_layer: int
    hidden: int
    heads: int
    gpus: int
    tp: int  # Megatron tensor-parallel degree (the paper's MP)
    batch_per_gpu: int  # micro-batch per data-parallel rank (all MP ranks share it)
    seq: int = 1024
    vocab: int = 50257
    stage: int = 2
    checkpointing: bool = True
    p_a: bool = False
    p_a_cpu: bool = False
    overlap_comm: bool = False  # DeepSpeed's default in the paper's era
    lp_bytes: int = 2
    dropout: bool = True
    bucket_elems: float = float(REDUCE_BUCKET)  # DP collective call size (latency only)

    @property
    def dp(self) -> int:
        return self.gpus // self.tp

    @property
    def params(self) -> float:
        h, l = self.hidden, self.n_layer
        return 12.0 * l * h * h + 13.0 * l * h + (self.vocab + self.seq) * h + 2 * h


@dataclass(frozen=True)
class PerfParams:
    """The (at most three) fitted parameters."""
    e_max: float = 0.7  # fraction of peak reached by large GEMMs
    x_half: float = 1.2e4  # GEMM FLOPs per attention-score element at half efficiency
    comm_eff: float = 0.7  # fraction of link bandwidth the collectives achieve


# ------------------------------------------------------------------------------- collectives
def ring_all_reduce_time(nbytes: float, n: int, bw: float, alpha: float = 0.0) -> float:
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * alpha


def ring_reduce_scatter_time(nbytes: float, n: int, bw: float, alpha: float = 0.0) -> float:
    """``nbytes`` = the full (unscattered) buffer."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / bw + (n - 1) * alpha


def ring_all_gather_time(nbytes: float, n: int, bw: float, alpha: float = 0.0) -> float:
    """``nbytes`` = the full (gathered) buffer."""
    return ring_reduce_scatter_time(nbytes, n, bw, alpha)


def group_link(hw: Hardware, n: int, members_per_node: int, groups_per_node: int,
               comm_eff: float) -> tuple[float, float]:
    """(per-rank ring bandwidth in bytes/s, per-step latency) of a group on the topology.

    A ring over nodes crosses each node boundary once per direction; the ``groups_per_node``
    groups with members on a node share its NICs, and intra-node hops use NVSwitch.
    """
    if n <= members_per_node:
        return hw.intra_bw, ALPHA_INTRA
    return min(hw.intra_bw, hw.inter_bw_node / groups_per_node * comm_eff), ALPHA_INTER


def tp_link(w: Workload, hw: Hardware, comm_eff: float) -> tuple[float, float]:
    g = hw.gpus_per_node
    if w.tp <= g:
        return group_link(hw, w.tp, w.tp, g // w.tp, comm_eff)
    return group_link(hw, w.tp, g, 1, comm_eff)  # the node's GPUs all belong to one TP group


def dp_link(w: Workload, hw: Hardware, comm_eff: float) -> tuple[float, float]:
    g = hw.gpus_per_node
    k = max(1, g // w.tp)  # members of one DP group per node (TP groups packed in nodes)
    return group_link(hw, w.dp, k, g // k, comm_eff)


# ---------------------------------------------------------------------------------- compute
def compute_efficiency(w: Workload, p: PerfParams) -> float:
    """eff = e_max·x/(x + x_half), x = GEMM FLOPs of a block per attention-score element.

    Per GPU a block does 72·b·s·h²·(1 + s/(6h))/MP GEMM FLOPs (fwd+bwd) and touches
    a·b·s²/MP score elements in memory-bound kernels (mask, softmax, dropout); MP cancels:
    x = 72·h²·(1 + s/(6h))/(a·s). Wide models run closer to e_max, small ones (1.5B: h=1600,
    s=1024) lose ~40% to the s² attention traffic.
    """
    block_flops = flops_per_iteration(w.batch_per_gpu, w.seq, 1, w.hidden, 0, False) / w.tp
    scores = float(w.batch_per_gpu) * w.heads * w.seq * w.seq / w.tp
    x = block_flops / scores
    return p.e_max * x / (x + p.x_half)


def flops_per_gpu(w: Workload) -> float:
    return flops_per_iteration(w.batch_per_gpu, w.seq, w.n_layer, w.hidden, w.vocab,
                               w.checkpointing) / w.tp


# -------------------------------------------------------------------------------- the model
def step_time(w: Workload, hw: Hardware, p: PerfParams) -> dict[str, float]:
    """Seconds per iteration by component, plus ``total`` and ``tflops_per_gpu``."""
    eta = p.comm_eff
    f_gpu = flops_per_gpu(w)
    t_compute = f_gpu / (hw.peak_flops * compute_efficiency(w, p))
    # forward : backward : recompute = 1 : 2 : 1 with checkpointing, 1 : 2 without
    parts = 4.0 if w.checkpointing else 3.0
    t_fwd, t_bwd_window = t_compute / parts, t_compute * (parts - 1) / parts

    # Megatron TP all-reduces of b·s·h activations
    act_msg = float(w.batch_per_gpu) * w.seq * w.hidden * w.lp_bytes
    n_tp = w.n_layer * (6 if w.checkpointing else 4) + 2
    tp_bw, tp_alpha = tp_link(w, hw, eta)
    t_tp = n_tp * ring_all_reduce_time(act_msg, w.tp, tp_bw, tp_alpha)

    t_dp = _dp_exposed(w, hw, eta, t_fwd, t_bwd_window)

    t_pa = 0.0
    if w.p_a and w.checkpointing:
        t_pa = w.n_layer * ring_all_gather_time(act_msg, w.tp, tp_bw, tp_alpha)
    t_cpu = 0.0
    if w.p_a_cpu:
        ckpt = w.n_layer * act_msg / (w.tp if w.p_a else 1)
        pcie = hw.pcie_bw * eta
        t_cpu = max(0.0, ckpt / pcie - t_fwd) + ckpt / pcie

    total = t_compute + t_tp + t_dp + t_pa + t_cpu
    return {"compute": t_compute, "tp_comm": t_tp, "dp_comm": t_dp, "pa_comm": t_pa,
            "cpu_offload": t_cpu, "total": total,
            "tflops_per_gpu": f_gpu / total / 1e12}


def _dp_exposed(w: Workload, hw: Hardware, eta: float, t_fwd: float, t_bwd: float) -> float:
    """Exposed data-parallel communication of one iteration (see module doc)."""
    if w.dp <= 1:
        return 0.0
    grad_bytes = w.params / w.tp * w.lp_bytes
    bw, alpha = dp_link(w, hw, eta)
    calls = max(1, math.ceil(w.params / w.tp / w.bucket_elems))
    rs = ring_reduce_scatter_time(grad_bytes, w.dp, bw, alpha) + (calls - 1) * (w.dp - 1) * alpha
    ag = ring_all_gather_time(grad_bytes, w.dp, bw, alpha) + (calls - 1) * (w.dp - 1) * alpha
    hide = (lambda t, window: max(0.0, t - window)) if w.overlap_comm else (lambda t, _: t)
    if w.stage == 0:  # ring all-reduce = reduce-scatter + all-gather; DDP buckets can overlap
        return hide(rs + ag, t_bwd)
    if w.stage == 1:
        return rs + ag  # full gradients are reduced after backward, params gathered after step
    if w.stage == 2:
        return hide(rs, t_bwd) + ag
    # stage 3: gather params in forward and again in backward, reduce-scatter grads
    return hide(ag, t_fwd) + hide(ag + rs, t_bwd)


def simulate(w: Workload, hw: Hardware, p: PerfParams) -> dict:
    """``step_time`` plus the workload fields, for records."""
    out = dict(asdict(w))
    out.update(step_time(w, hw, p))
    out["dp"] = w.dp
    return out
