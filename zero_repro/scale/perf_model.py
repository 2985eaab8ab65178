"""Closed-form time per iteration (compute + alpha-beta communication over the real topology) and
TFLOPs/GPU for a ZeRO / Megatron training point (paper §7-8 communication analysis, §10
throughput figures 2, 3, 4, 8).

    T = T_compute + T_tp + T_dp,exposed + T_Pa + T_cpu

* Compute. FLOPs per GPU = F/MP with F the Megatron convention (``zero_repro.runtime.model.flops``:
  96·B·s·l·h²·(1 + s/(6h) + V/(16lh)) with recompute; a Llama shape, ``Workload.ffn`` /
  ``kv_heads``: ``flops_per_iteration_shape``). They run at peak · eff, with a
  saturating efficiency in the GEMM work per memory-bound attention-score element,
      eff = e_max · x / (x + x_half),   x = 72·h²·(1 + s/(6h)) / (a·s)
  Equivalently each score element (a·b·s²/MP per block) costs x_half GEMM-FLOP-equivalents.
  (Tried and rejected, see calibrate.py: x = tokens·h/MP, and x = FLOPs per activation byte.)
* Collectives: ring closed forms (n ranks, S bytes = the full buffer, per-rank bandwidth B,
  per-step latency α):  all-reduce 2(n-1)/n·S/B + 2(n-1)α;  reduce-scatter and all-gather
  (n-1)/n·S/B + (n-1)α. B is the bottleneck link of the group on the topology: NVSwitch per GPU
  per direction inside a node; across nodes the node's NICs are shared by the groups that have
  members on the node (MP=16 on a 16-GPU node: 16 DP groups, one GPU each, share 800 Gb/s).
  The fitted efficiency ``comm_eff`` multiplies the inter-node (InfiniBand) and PCIe
  bandwidths; NVSwitch runs at its per-direction spec (one η on every link fits Fig 2 worse:
  max error 19% instead of 15%, with η ≈ 0.44).
* TP (Megatron): per block 2 all-reduces of b·s·h forward, 2 backward, 2 more in the recompute
  (6 = the paper's "12·s·h per block" volume, §8), + 2 for the vocab-parallel embedding/head;
  over NVSwitch when MP <= GPUs/node, else over InfiniBand (the baseline's collapse >= 40B).
* DP: stage 0 all-reduces the lp gradients (Megatron 2019: after backward; PyTorch DDP with
  ``overlap_comm``: bucketed during backward);
  stages 1-2 reduce-scatter the gradients and all-gather the updated lp parameters after the
  step. With ``overlap_comm`` the reduce-scatter hides behind backward compute (exposed =
  max(0, T_rs - T_backward)); the all-gather is always exposed (the next forward needs it).
  Stage 3: all-gather in forward and in backward + reduce-scatter, overlapped likewise.
* P_a: one all-gather of b·s·h per block in backward over the TP group (§8).
  P_a+cpu: 2x the partitioned checkpoint bytes over PCIe (§8); the device->host copy overlaps
  the forward, the host->device copy in backward is synchronous.

Not modelled: the optimizer step (memory bound, < 3% at these sizes), pipeline bubbles,
allocator stalls/fragmentation, stragglers.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from zero_repro.runtime.model.flops import flops_per_iteration, flops_per_iteration_shape
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
    # model shape beyond GPT-2's (``runtime.model.llama``): SwiGLU width (0: GPT's 4h GELU MLP)
    # and key/value heads (0: one per query head); a SwiGLU model has an untied head, no
    # biases and no learned positions
    ffn: int = 0
    kv_heads: int = 0

    @property
    def dp(self) -> int:
        return self.gpus // self.tp

    @property
    def kv_width(self) -> int:
        return (self.kv_heads or self.heads) * (self.hidden // self.heads)

    @property
    def params(self) -> float:
        h, l = self.hidden, self.n_layer
        if self.ffn:  # Llama (flops.param_count)
            block = 2 * h * h + 2 * h * self.kv_width + 3 * h * self.ffn + 2 * h
            return float(l * block + 2 * self.vocab * h + h)
        return 12.0 * l * h * h + 13.0 * l * h + (self.vocab + self.seq) * h + 2 * h

    def flops(self, n_layer: int, vocab: int, recompute: bool) -> float:
        """``flops_per_iteration`` of one micro-batch (GPT), or its shape form (SwiGLU, GQA)."""
        if self.ffn:
            return flops_per_iteration_shape(self.batch_per_gpu, self.seq, n_layer, self.hidden,
                                             vocab, recompute, kv_width=self.kv_width,
                                             ffn=self.ffn, gated=True)
        return flops_per_iteration(self.batch_per_gpu, self.seq, n_layer, self.hidden, vocab,
                                   recompute)


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
    block_flops = w.flops(1, 0, False) / w.tp
    scores = float(w.batch_per_gpu) * w.heads * w.seq * w.seq / w.tp
    x = block_flops / scores
    return p.e_max * x / (x + p.x_half)


def flops_per_gpu(w: Workload) -> float:
    return w.flops(w.n_layer, w.vocab, w.checkpointing) / w.tp


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
