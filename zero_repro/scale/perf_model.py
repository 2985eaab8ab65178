"""Closed-form time per iteration (compute + alpha-beta communication over the real topology) and
TFLOPs/GPU for a ZeRO / Megatron training point (paper §7-8 communication, §10 Figures 2, 3, 4,
8). ``step_time(workload, hardware, params)``, ``simulate``:

    T = T_compute + T_tp + T_dp,exposed + T_Pa + T_cpu + T_step

* Compute: a roofline of the 2019 Megatron layer on one GPU: every GEMM at the tensor-core roof
  (``peak``: V100 125 TFLOPs, NVIDIA Tesla V100 datasheet) times ``e_max`` with a wave tail, the
  memory-bound kernels (scores' mask/softmax/dropout, LayerNorm/bias/dropout/residual, GELU, the
  fp32 loss: ``memory_bound_bytes``) at the HBM roof (``hbm_bw``: V100 900 GB/s, same datasheet):
      T_compute = Σ_GEMMs 2MNK / (peak · e_max) · (1 + w_half / (M·N))  +  bytes_mem / hbm_bw
  with w_half = ½ · SMs · 128·128 output elements: half a wave of cuBLAS's large fp16 tile on
  average (NVIDIA "Matrix Multiplication Background" guide §2.3, §3.2; V100: 80 SMs, 655,360).
  ΣFLOPs = F/MP, F Megatron's convention with recompute (``zero_repro.runtime.model.flops``; a
  Llama shape, ``Workload.ffn`` / ``kv_heads``: ``flops_per_iteration_shape``, its GEMMs from
  the same shapes; its memory-bound kernels counted with the GPT layer's bytes per element).
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
  backward synchronous (``pa_cpu_sync``: both synchronous, as 2019 Megatron's pageable copies).
* The 2020 stack's per-step terms that do not shrink with the batch (each a Workload field, set
  from ``scale.dryrun.stack.switches``): ``step_commit``, the ZeRO step's memory-bound passes
  (overflow check, gradient norm, flatten, casts, Adam, copies) at the HBM roof, bytes per
  element in ``STEP_BYTES`` (DeepSpeed's code at that commit); ``rooted_reduce``, stage 2's
  gradient reduction as one rooted ``dist.reduce`` per destination rank (DeepSpeed@f2ac7eafd
  deepspeed_zero_optimizer.py L616-629, e67a3def0 L653-666): a ring reduce moves its whole
  slice over every link, so the bucket costs S/B instead of (n-1)/n·S/B, plus n(n-1)α.

Not modelled: pipeline bubbles, allocator stalls and fragmentation, stragglers, the host's
launch gaps after each synchronisation (no sourced number). Alternatives tried and their errors:
``results/fig2_throughput/notes.md``.
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
    # ZeRO-Offload (zero.offload_optimizer=cpu): AdamW on the host, the shard over PCIe
    # (the modern step model's terms, ``scale.offload_time``; the paper2020 model has none)
    offload: bool = False
    # ZeRO-3 Offload (zero.offload_param=cpu): stage 3's parameter shard on the host, copied
    # to the device at each gather (``scale.offload_time``)
    offload_param: bool = False
    # ZeRO-Offload's delayed parameter update (zero.offload_dpu): the host step hidden behind
    # the next step's forward and backward (``scale.offload_time``)
    offload_dpu: bool = False
    # hierarchical sharding (zero.shard_size = G, 0: all N_d) and ZeRO++'s hpZ at stage 3: the
    # modern step model's DP terms (``scale.hsdp``; the paper2020 model has none)
    shard_size: int = 0
    hpz: bool = False
    # the 2020 stack's per-step terms (module doc): the ZeRO step's passes at this DeepSpeed
    # commit ("" = not modelled), rooted reduces for stage 2, synchronous P_a+cpu copies
    step_commit: str = ""
    rooted_reduce: bool = False
    pa_cpu_sync: bool = False

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
    """The fitted parameters (the GEMM tail ``w_half`` comes from the hardware)."""
    e_max: float = 0.5  # fraction of the tensor-core peak reached by saturated GEMMs
    comm_eff: float = 0.5  # fraction of link bandwidth the collectives achieve


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
TILE_ELEMS = 128 * 128  # output elements of one cuBLAS fp16 tensor-core tile (see module doc)


def w_half(hw: Hardware) -> float:
    """Half a wave of output tiles on ``hw``'s SMs (module doc); 0 when the SM count is unknown."""
    return 0.5 * hw.sm_count * TILE_ELEMS


def gemm_shapes(w: Workload) -> list[tuple[float, float, float, int, float]]:
    """(M, N, K, calls, batch) of every GEMM of one iteration on one GPU: it runs ``calls``
    times, each a batched call of ``batch`` M×K·K×N products. Per block: QKV, proj, fc, fc2
    forward (twice with activation recompute), their input- and weight-gradient GEMMs, the
    attention products q·kᵀ and p·v over b·a/MP heads (forward, recompute, two gradients
    each); the LM head once forward, twice backward. Their FLOPs sum to ``flops_per_gpu``."""
    b, s, h, t, l = w.batch_per_gpu, w.seq, w.hidden, w.tp, w.n_layer
    tok, d, heads = float(b) * s, h / w.heads, float(b) * w.heads / t
    fwd = 2 if w.checkpointing else 1
    qkv = (h + 2 * w.kv_width) / t  # fused q, k, v (GQA: k, v of the key/value heads' width)
    if w.ffn:  # SwiGLU: gate and up fused, then down
        mlp = ((2 * w.ffn / t, h), (h, w.ffn / t))
    else:  # GPT's 4h GELU MLP
        mlp = ((4 * h / t, h), (h, 4 * h / t))
    out = []
    for n, k in ((qkv, h), (h, h / t), *mlp):
        out += [(tok, n, k, fwd * l, 1.0), (tok, k, n, l, 1.0), (n, k, tok, l, 1.0)]
    for m, n, k in ((s, s, d), (s, d, s)):
        out.append((m, n, k, (fwd + 2) * l, heads))
    v = w.vocab / t
    out += [(tok, v, h, 1, 1.0), (tok, h, v, 1, 1.0), (v, h, tok, 1, 1.0)]
    return out


def gemm_time(w: Workload, hw: Hardware, p: PerfParams) -> float:
    """Σ 2MNK·batch/(peak·e_max)·(1 + w_half/(M·N·batch)) over ``gemm_shapes`` (module doc):
    the matrices of a batched call share its waves."""
    rate, tail = hw.peak_flops * p.e_max, w_half(hw)
    return sum(calls * 2.0 * m * n * k * bt / rate * (1.0 + tail / (m * n * bt))
               for m, n, k, calls, bt in gemm_shapes(w))


def compute_efficiency(w: Workload, hw: Hardware, p: PerfParams) -> float:
    """The GEMMs' effective fraction of the tensor-core peak: F/MP / (peak · ``gemm_time``)."""
    return flops_per_gpu(w) / (hw.peak_flops * gemm_time(w, hw, p))


# Bytes per element moved by the memory-bound kernels of the 2019 Megatron layer, forward and
# backward (fp16 = 2 B; an elementwise op reads its inputs and writes its output; a dropout
# also writes its 1-byte mask). The op sequence is the paper harness's
# (DeepSpeedExamples@405ce794 Megatron-LM mpu/transformer.py, mirrored op by op in
# ``scale.dryrun.stack.megatron2019``). Elements per block on one GPU (t = MP):
#   scores b·(a/t)·s²: fwd QKᵀ out 2, /sqrt(d) 4, ·mask 4, -10000(1-mask) 4, softmax 4,
#                      dropout 5, read by P·V 2 = 25;  bwd dP out 2, read for dV 2,
#                      dropout 5, softmax 6, ·mask 4, /sqrt(d) 4, read for dQ and dK 4 = 27
#   hidden b·s·h (replicated on every TP rank): fwd 2 LayerNorms 4+4, 2 bias adds after the
#                      row-parallel all-reduce 4+4, 2 dropouts 5+5, 2 residual adds 6+6 = 38;
#                      bwd 2 LayerNorm 6+6, 2 bias grads 2+2, 2 dropouts 5+5, 2 gradient
#                      sums at the residual junctions 6+6 = 38
#   mlp b·s·4h/t:      fwd bias 4 + jit-fused tanh-GELU (read 2, write 2 + 6 saved
#                      intermediates 12) = 20;  bwd bias grad 2 + fused GELU bwd 16 = 18
#   qkv b·s·3h/t:      fwd bias add 4; bwd bias grad 2
#   logits b·s·V/t fp32 (once, not recomputed): fwd fp16->fp32 6, clone 8, max 4, sub 8,
#                      exp 8, sum 4, div 8 = 46;  bwd mul 8, fp32->fp16 6 = 14
MEM_BYTES = {"scores": (25, 27), "hidden": (38, 38), "mlp": (20, 18), "qkv": (4, 2),
             "logits": (46, 14)}


# Bytes per parameter element moved by the ZeRO step's memory-bound passes (an fp16 element 2 B,
# fp32 4, fp64 8; an elementwise op reads its inputs and writes its output), keyed by the
# DeepSpeed commit (``Workload.step_commit``). (per element of this rank's partition Ψ/(MP·N_d),
# per element of the rank's whole model Ψ/MP).
#   stage 2, both commits: overflow check x.float().sum() 2+4+4 = 10 (f2ac7eafd
#     deepspeed_zero_optimizer.py L1229), norm g.double().norm() 2+8+8 = 18 (L952), flatten
#     2+2 = 4 (L1078); per element of Ψ/MP: the gradient copied into the ipg bucket 2+2 and the
#     list all-gather's flattened output copied back 2+2 = 8.
#   e67a3def0: fused Adam on fp16 gradients writing the fp16 parameters (L1418-1425): read
#     g 2, p m v 12, write p m v 12, p16 2 = 28  -> 60 per partition element
#   f2ac7eafd: .to(fp32) 2+4 (L1078-1080), unscale 4+4 (L1171-1177), fp32 Adam read p g m v
#     16, write p m v 12 (L1095), fp32 -> fp16 copy 4+2 (L1100-1102) -> 80
#   stage 1 (zero_optimizer_stage1.py@f2ac7eafd): overflow x.float().sum() and norm
#     .float().norm() over every gradient, 10 + 10 per element of Ψ/MP (deepspeed_utils.py L89,
#     L158-162), every rank's sub-partitions flattened and copied into the reduce-scatter's
#     staging, the all-gather's output copied back, 4 + 4 + 4 = 12 per element of Ψ/MP
#     (L479, L571-577, L686-690); per partition element: pieces .to(fp32) 2+4, fp32 flatten
#     4+4, unscale 4+4, fp32 Adam 28, fp32 -> fp16 4+2 -> 56
STEP_BYTES = {"e67a3def0": (60.0, 8.0), "f2ac7eafd": (80.0, 8.0), "stage1": (56.0, 32.0)}


def step_pass_time(w: Workload, hw: Hardware) -> float:
    """Seconds of the ZeRO step's memory-bound passes (``STEP_BYTES``) at the HBM roof."""
    if not w.step_commit or w.stage not in (1, 2) or hw.hbm_bw <= 0:
        return 0.0
    part, whole = STEP_BYTES["stage1" if w.stage == 1 else w.step_commit]
    psi = w.params / w.tp
    return (part * psi / max(1, w.dp) + whole * psi) / hw.hbm_bw


def memory_bound_bytes(w: Workload) -> float:
    """HBM bytes of the memory-bound kernels of one iteration on one GPU (``MEM_BYTES``): the
    blocks' forward runs twice with activation checkpointing, the loss once."""
    b, s, h, t = float(w.batch_per_gpu), w.seq, w.hidden, w.tp
    f = w.ffn or 4 * h  # a Llama shape: its MLP width, the GPT layer's bytes per element
    elems = {"scores": b * (w.heads / t) * s * s, "hidden": b * s * h, "mlp": b * s * f / t,
             "qkv": b * s * (h + 2 * w.kv_width) / t}
    fwd_passes = 2 if w.checkpointing else 1
    block = sum(n * (MEM_BYTES[k][0] * fwd_passes + MEM_BYTES[k][1]) for k, n in elems.items())
    return w.n_layer * block + b * s * w.vocab / t * sum(MEM_BYTES["logits"])


def flops_per_gpu(w: Workload) -> float:
    return w.flops(w.n_layer, w.vocab, w.checkpointing) / w.tp


# -------------------------------------------------------------------------------- the model
def step_time(w: Workload, hw: Hardware, p: PerfParams) -> dict[str, float]:
    """Seconds per iteration by component, plus ``total`` and ``tflops_per_gpu``."""
    eta = p.comm_eff
    f_gpu = flops_per_gpu(w)
    t_gemm = gemm_time(w, hw, p)
    t_mem = memory_bound_bytes(w) / hw.hbm_bw if hw.hbm_bw > 0 else 0.0
    t_compute = t_gemm + t_mem
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
        d2h = ckpt / pcie if w.pa_cpu_sync else max(0.0, ckpt / pcie - t_fwd)
        t_cpu = d2h + ckpt / pcie
    t_step = step_pass_time(w, hw)

    total = t_compute + t_tp + t_dp + t_pa + t_cpu + t_step
    return {"compute": t_compute, "gemm": t_gemm, "memory_bound": t_mem, "tp_comm": t_tp, "dp_comm": t_dp, "pa_comm": t_pa,
            "cpu_offload": t_cpu, "zero_step": t_step, "total": total,
            "tflops_per_gpu": f_gpu / total / 1e12}


def _dp_exposed(w: Workload, hw: Hardware, eta: float, t_fwd: float, t_bwd: float) -> float:
    """Exposed data-parallel communication of one iteration (see module doc)."""
    if w.dp <= 1:
        return 0.0
    grad_bytes = w.params / w.tp * w.lp_bytes
    bw, alpha = dp_link(w, hw, eta)
    calls = max(1, math.ceil(w.params / w.tp / w.bucket_elems))
    rs = ring_reduce_scatter_time(grad_bytes, w.dp, bw, alpha) + (calls - 1) * (w.dp - 1) * alpha
    if w.rooted_reduce and w.stage == 2:  # one rooted ring reduce per destination rank
        rs = grad_bytes / bw + calls * w.dp * (w.dp - 1) * alpha
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
