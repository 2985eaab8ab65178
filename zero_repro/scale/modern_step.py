"""Time of one training step of today's stack on one GPU, term by term, from the per-device
kernel model (``scale.kernels``): bf16 parameters with an fp32 master and AdamW, flash attention
with causal FLOPs, activation checkpointing none | selective | full, the ZeRO stage's collectives
over the cluster's links with their overlap. The paper's 2020 stack is ``scale.perf_model``
(calibrated on Fig 2); this model has no fitted parameter.

    T = T_gemm,fwd + T_gemm,bwd + T_attn,fwd + T_attn,bwd + T_mem,fwd + T_mem,bwd
        + T_recompute + T_optimizer + T_tp + T_dp,exposed + T_Pa + T_cpu + T_host + T_pcie

* GEMMs: every linear of the blocks and the LM head on this GPU's TP shard (``gemm_shapes``):
  forward (tokens x out x in), input gradient and weight gradient (``kernels.gemm_seconds``).
* Attention, flash (``Modern.attention``): one fused call per layer forward and one backward
  over b·a/t heads (``kernels.attention_seconds``): causal FLOPs 2·b·a·s²·d forward (half of
  the full product), backward 2.5x. Unfused: q·kᵀ and p·v as batched GEMMs over the whole
  s x s (masked products computed) plus the scores' traffic at the memory roof
  (``SCORE_BYTES``).
* Memory-bound kernels (``LAYER_BYTES``): bytes per element counted op by op from this
  runtime's layers (``runtime.model.llama`` / ``gpt``, no dropout) as eager PyTorch runs them
  (the band's low and middle), or one fused kernel per operation (torch.compile, fused norms:
  the band's high edge), at e_hbm of the HBM roof.
* Recompute: the blocks' forward (GEMMs, attention, memory-bound) once more for the fraction
  of blocks checkpointed (``recompute_fraction``): full 1, none 0, selective 1/k --
  torchtitan's layer-level selective AC, every k-th block checkpointed (default k = 2), the
  other blocks keep all their activations.
* Optimizer: AdamW over this rank's fp32 shard at the HBM roof, ``ADAM_BYTES`` per element;
  with ZeRO-Offload (``Workload.offload``) none on the device: the host step and the PCIe
  copies' exposed part instead (``scale.offload_time``: T_host, T_pcie).
* TP: 2 all-reduces of b·s·h per block forward, 2 backward, 2 per recomputed block, + 2 for the
  embedding and head; not overlapped.
* DP (ZeRO stage): bytes as §7 (stages 0-2: 2Ψ, 3: 3Ψ per rank and step), ring closed forms
  (``perf_model``) over the group's bottleneck link at e_link (NVLink / PCIe in a node, the
  NICs between nodes shared by the node's groups). Overlap: a collective hidden behind a
  compute window W over u units (buckets, or the blocks for stage 3) is exposed
  max(T - W, T / u): the first unit's transfer is never hidden, a comm-bound step exposes the
  excess. Stage 0: the all-reduce behind backward; stage 1: reduce-scatter and all-gather
  after backward, exposed; stage 2: reduce-scatter behind backward, all-gather exposed;
  stage 3: the forward all-gather behind forward, backward all-gather + reduce-scatter behind
  backward (FSDP's prefetch). Hierarchical sharding (``Workload.shard_size`` G < N_d) and
  hpZ: the same overlap over the shard, replicate and node groups (``scale.hsdp``, each group's
  calls at its own size and link); the optimizer over the Ψ/G shard.
  backward (FSDP's prefetch). Each call at its message size (``Modern.collectives``):
  ``nccl`` NCCL's ring cost model with its protocol switch (``scale.collectives``: latency
  per ring step, LL / LL128 / Simple, the bus bandwidth falling with the message; a DP call
  is a bucket, stage 3's a block), ``ring`` the closed forms with one α per step.
* Overlap slowdown (``Modern.overlap_slowdown``): the DP collectives' hidden seconds H slow
  the compute they overlap by s·H, s per GPU generation (``scale.overlap``).

Model FLOPs (MFU; PaLM App. B's convention: 6·N_matmul per token + 12·l·h·s attention, the
attention product counted in full) and hardware FLOPs (HFU: + the recomputed forward) come from
``runtime.model.flops``. ``band`` evaluates every term with every kernel efficiency at its low
and its high edge: the estimate's uncertainty.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from zero_repro.scale import collectives as CL
from zero_repro.scale import hsdp as H
from zero_repro.scale import kernels as K
from zero_repro.scale import overlap as OV
from zero_repro.scale import offload_time as OT
from zero_repro.scale import perf_model as P
from zero_repro.scale.hardware import Hardware

AC_MODES = ("none", "selective", "full")
ATTENTION = ("flash", "unfused")
COLLECTIVE_MODELS = ("nccl", "ring")
# bytes per element of the memory-bound kernels (bf16 = 2 B, fp32 = 4 B; an op reads its inputs
# and writes its output), forward and backward, per group of elements of one block on one GPU:
# hidden b·s·h, rope b·s·(h+k)/t, kv b·s·2h/t (the key/value heads repeated to the query heads
# before the kernel, GQA only), mlp b·s·f/t (GPT: qkv b·s·3h/t, mlp b·s·4h/t).
#   llama, eager (runtime.model.llama op by op): RMSNorm fwd x.float 6, pow 8, mean 4, ·rstd 8,
#     .to 6, ·w 4 = 36; its bwd (the autograd Function's 13 ops) 100; residual add 6 / grad sum 6
#     -> hidden (2·36 + 2·6, 2·100 + 2·6) = (84, 212) | rope x·cos 4, -x2 2, cat 4, ·sin 4, add 6
#     = 20, bwd 20 | kv repeat write 2, bwd sum 2 | mlp silu 4, mul 6 = 10; bwd 2 muls 6 + 6,
#     silu 6, the fused gate|up gradient's copy 8 = 26
#   llama, fused (one kernel per op): RMSNorm 4 / 6, residual 6 / 6 -> hidden (20, 24) | rope
#     (4, 4) | kv (2, 2) | mlp silu·mul read 4 write 2 = 6, bwd read 6 write 4 = 10
#   gpt (aten's fused LayerNorm and GELU even in eager): hidden 2 LayerNorms 4+4, 2 row-parallel
#     bias adds 4+4, 2 residual adds 6+6 = 28; bwd LayerNorm 6+6, bias grads 2+2, residual
#     sums 6+6 = 28 | qkv bias 4; bwd 2 | mlp bias 4 + GELU 4 = 8; bwd bias grad 2 + GELU 6 = 8
#   logits b·s·V/t (once), eager: .float 6, max 4, sub 8, exp 8, sum 4 = 30; bwd softmax grad 8,
#     ·grad 8, .to 6 = 22; fused: (14, 14) (upcast 6 + log-softmax 8; grad 8 + downcast 6)
_LLAMA = {"eager": {"hidden": (84, 212), "rope": (20, 20), "kv": (2, 2), "mlp": (10, 26)},
          "fused": {"hidden": (20, 24), "rope": (4, 4), "kv": (2, 2), "mlp": (6, 10)}}
_GPT = {"hidden": (28, 28), "qkv": (4, 2), "mlp": (8, 8)}
LAYER_BYTES = {"llama": _LLAMA, "gpt": {"eager": _GPT, "fused": _GPT}}
LOGIT_BYTES = {"eager": (30, 22), "fused": (14, 14)}
# unfused attention, per score element b·(a/t)·s²: the 2019 layer's traffic (perf_model.MEM_BYTES
# "scores") less its dropout (5 B forward, 5 B backward)
SCORE_BYTES = (P.MEM_BYTES["scores"][0] - 5, P.MEM_BYTES["scores"][1] - 5)
# AdamW per fp32 shard element: read master, m, v (12) and the lp gradient (2), write master,
# m, v (12) and the lp parameter (2), + the clip's norm read of the gradient (2)
ADAM_BYTES = 30.0


@dataclass(frozen=True)
class Modern:
    """The modern stack's switches: activation checkpointing, attention kernel, causal mask."""
    ac: str = "full"  # none | selective | full
    every: int = 2  # selective: every k-th block checkpointed
    attention: str = "flash"  # flash | unfused
    causal: bool = True
    collectives: str = "nccl"  # nccl (scale.collectives) | ring (closed forms, one α a step)
    overlap_slowdown: bool = True  # compute slowed by the collectives it hides (scale.overlap)

    def __post_init__(self):
        if self.ac not in AC_MODES:
            raise ValueError(f"ac={self.ac!r}: use one of {AC_MODES}")
        if self.attention not in ATTENTION:
            raise ValueError(f"attention={self.attention!r}: use one of {ATTENTION}")
        if self.collectives not in COLLECTIVE_MODELS:
            raise ValueError(f"collectives={self.collectives!r}: use one of "
                             f"{COLLECTIVE_MODELS}")
        if self.every < 1:
            raise ValueError(f"selective AC every={self.every}: give a positive block period")


def recompute_fraction(m: Modern) -> float:
    """Fraction of the blocks whose forward runs again in backward."""
    return {"none": 0.0, "full": 1.0, "selective": 1.0 / m.every}[m.ac]


# ------------------------------------------------------------------------------ compute
def gemm_shapes(w: P.Workload) -> tuple[list, list]:
    """(block GEMMs, LM-head GEMMs) of one layer / the head on one GPU as (M, N, K, pass):
    pass fwd | bwd (input and weight gradient)."""
    tok, h, t = float(w.batch_per_gpu) * w.seq, w.hidden, w.tp
    qkv = (h + 2 * w.kv_width) / t
    mlp = ((2 * w.ffn / t, h), (h, w.ffn / t)) if w.ffn else ((4 * h / t, h), (h, 4 * h / t))
    block = []
    for n, k in ((qkv, h), (h, h / t), *mlp):
        block += [(tok, n, k, "fwd"), (tok, k, n, "bwd"), (n, k, tok, "bwd")]
    v = w.vocab / t
    head = [(tok, v, h, "fwd"), (tok, h, v, "bwd"), (v, h, tok, "bwd")]
    return block, head


def _gemms(shapes, hw: Hardware, dk, point: str) -> dict:
    out = {"fwd": 0.0, "bwd": 0.0}
    for m, n, k, ps in shapes:
        out[ps] += K.gemm_seconds(dk, hw.peak_flops, _hbm(hw, dk), m, n, k, point=point)
    return out


def _hbm(hw: Hardware, dk) -> float:
    return hw.hbm_bw if hw.hbm_bw > 0 else dk.spec.hbm_gbps * 1e9


def attention_time(w: P.Workload, hw: Hardware, dk, m: Modern, point: str) -> dict:
    """Seconds of one layer's attention, forward and backward (module doc)."""
    b, s, d = float(w.batch_per_gpu), float(w.seq), w.hidden / w.heads
    heads = w.heads / w.tp
    if m.attention == "flash":
        return {ps: K.attention_seconds(dk, hw.peak_flops, b, heads, s, d, m.causal, ps, point)
                for ps in ("fwd", "bwd")}
    hbm, bh = _hbm(hw, dk), b * heads
    one = K.gemm_seconds(dk, hw.peak_flops, hbm, s, s, d, bh, point)  # q·kᵀ; p·v alike
    scores = bh * s * s
    return {"fwd": 2 * one + K.memory_seconds(dk, hbm, scores * SCORE_BYTES[0], point),
            "bwd": 4 * one + K.memory_seconds(dk, hbm, scores * SCORE_BYTES[1], point)}


def kernels_of(point: str) -> str:
    """eager at the band's low edge and middle, fused at its high edge (module doc)."""
    return "fused" if point == "high" else "eager"


def layer_bytes(w: P.Workload, kind: str = "eager") -> tuple[float, float]:
    """(forward, backward) bytes of one block's memory-bound kernels on one GPU, ``kind``
    eager | fused (``LAYER_BYTES``)."""
    b, s, h, t = float(w.batch_per_gpu), w.seq, w.hidden, w.tp
    if w.ffn:
        elems = {"hidden": b * s * h, "rope": b * s * (h + w.kv_width) / t,
                 "kv": b * s * 2 * h / t if w.kv_width < h else 0.0, "mlp": b * s * w.ffn / t}
        table = LAYER_BYTES["llama"][kind]
    else:
        elems = {"hidden": b * s * h, "qkv": b * s * 3 * h / t, "mlp": b * s * 4 * h / t}
        table = LAYER_BYTES["gpt"][kind]
    return (sum(n * table[k][0] for k, n in elems.items()),
            sum(n * table[k][1] for k, n in elems.items()))


def compute_terms(w: P.Workload, hw: Hardware, dk, m: Modern, point: str = "mid") -> dict:
    """Compute by kind (seconds): GEMMs, attention, memory-bound kernels, forward and
    backward, the recompute and the optimizer step."""
    hbm, l = _hbm(hw, dk), w.n_layer
    block, head = gemm_shapes(w)
    gb, gh = _gemms(block, hw, dk, point), _gemms(head, hw, dk, point)
    at = attention_time(w, hw, dk, m, point)
    kind = kernels_of(point)
    lf, lb = layer_bytes(w, kind)
    lgf, lgb = LOGIT_BYTES[kind]
    logits = float(w.batch_per_gpu) * w.seq * w.vocab / w.tp
    mem_f = K.memory_seconds(dk, hbm, lf, point)
    block_fwd = gb["fwd"] + at["fwd"] + mem_f
    shard = w.params / w.tp / (H.shard_ranks(w) if w.stage >= 1 else 1)
    return {"gemm_fwd": l * gb["fwd"] + gh["fwd"], "gemm_bwd": l * gb["bwd"] + gh["bwd"],
            "attention_fwd": l * at["fwd"], "attention_bwd": l * at["bwd"],
            "memory_bound_fwd": l * mem_f + K.memory_seconds(dk, hbm, logits * lgf, point),
            "memory_bound_bwd": K.memory_seconds(dk, hbm, l * lb + logits * lgb, point),
            "recompute": recompute_fraction(m) * l * block_fwd,
            "optimizer": 0.0 if w.offload else K.memory_seconds(dk, hbm, shard * ADAM_BYTES,
                                                                point)}


# ------------------------------------------------------------------------ communication
def links(w: P.Workload, hw: Hardware, dk, point: str) -> dict:
    """Per-rank ring bandwidth (bytes/s) and per-step latency of the TP and DP groups."""
    g = hw.gpus_per_node
    intra = hw.intra_bw * K.link_efficiency(dk, K.intra_link(dk), point)
    net = hw.inter_bw_node * K.link_efficiency(dk, "network", point)

    def group(n: int, per_node: int, groups_per_node: int) -> tuple[float, float]:
        if n <= per_node:
            return intra, P.ALPHA_INTRA
        return min(intra, net / groups_per_node), P.ALPHA_INTER

    tp = group(w.tp, w.tp, max(1, g // w.tp)) if w.tp <= g else group(w.tp, g, 1)
    k = max(1, g // w.tp)
    return {"tp": tp, "dp": group(w.dp, k, max(1, g // k))}


def shapes(w: P.Workload, hw: Hardware, dk) -> dict:
    """(ranks, nodes, intra-node link) of the TP and DP groups: TP fills a node first, a DP
    group has g/t members on each node it spans (``scale.collectives``)."""
    g = max(1, hw.gpus_per_node)
    intra = "nvlink" if K.intra_link(dk) == "nvlink" else "pcie"
    k = max(1, g // w.tp)
    return {"tp": (w.tp, max(1, math.ceil(w.tp / g)), intra),
            "dp": (w.dp, max(1, math.ceil(w.dp / k)), intra)}


def collective(w: P.Workload, hw: Hardware, dk, m: "Modern", group: str, coll: str,
               nbytes: float, calls: int, point: str) -> float:
    """Seconds of ``nbytes`` (the whole buffer, summed over the calls) moved by ``calls``
    equal collectives over the TP or DP ``group`` (module doc, ``Modern.collectives``)."""
    bw, alpha = links(w, hw, dk, point)[group]
    n, nodes, intra = shapes(w, hw, dk)[group]
    if n <= 1:
        return 0.0
    if m.collectives == "nccl":
        return CL.calls_time(coll, nbytes, calls, n, bw, nodes, intra)
    ring = {"all_gather": P.ring_all_gather_time, "reduce_scatter": P.ring_reduce_scatter_time,
            "all_reduce": P.ring_all_reduce_time}[coll]
    return calls * ring(nbytes / calls, n, bw, alpha)


def exposed(t: float, window: float, units: int) -> float:
    """A collective of ``t`` seconds behind a compute window, over ``units`` pieces (doc)."""
    return max(t - window, t / max(1, units))


def dp_terms(w: P.Workload, hw: Hardware, dk, windows: tuple, point: str,
             m: "Modern | None" = None) -> dict:
    """(exposed, total) seconds of the stage's data-parallel collectives and the compute's
    ``overlap_slowdown`` from the hidden part (module doc)."""
    m = m or Modern()
    if w.dp <= 1:
        return {"dp_exposed": 0.0, "dp_total": 0.0, "overlap_slowdown": 0.0}
    if H.hierarchical(w):  # shard x replicate groups, hpZ: ``scale.hsdp``
        out = H.dp_terms(w, hw, dk, windows, point, exposed, m.collectives)
        hidden = out["dp_total"] - out["dp_exposed"]
        return {**out, "overlap_slowdown": OV.slowdown(dk.key, hidden, point)
                if m.overlap_slowdown else 0.0}
    psi = w.params / w.tp
    nbytes = psi * w.lp_bytes
    # stage 3: one gather (or scatter) per block; else one call per bucket
    units = w.n_layer if w.stage == 3 else max(1, math.ceil(psi / w.bucket_elems))
    rs = collective(w, hw, dk, m, "dp", "reduce_scatter", nbytes, units, point)
    ag = collective(w, hw, dk, m, "dp", "all_gather", nbytes, units, point)
    fwd, bwd = windows
    if w.stage == 0:
        out, total = exposed(rs + ag, bwd, units), rs + ag
    elif w.stage == 1:
        out, total = rs + ag, rs + ag
    elif w.stage == 2:
        out, total = exposed(rs, bwd, units) + ag, rs + ag
    else:
        out, total = exposed(ag, fwd, units) + exposed(ag + rs, bwd, units), 2 * ag + rs
    slow = OV.slowdown(dk.key, total - out, point) if m.overlap_slowdown else 0.0
    return {"dp_exposed": out, "dp_total": total, "overlap_slowdown": slow}


def tp_terms(w: P.Workload, hw: Hardware, dk, m: Modern, point: str) -> dict:
    """TP all-reduces, P_a's gathers and P_a+cpu's copies (seconds, not overlapped)."""
    act = float(w.batch_per_gpu) * w.seq * w.hidden * w.lp_bytes
    frac = recompute_fraction(m)
    n = int(round(w.n_layer * (4 + 2 * frac))) + 2
    out = {"tp_comm": collective(w, hw, dk, m, "tp", "all_reduce", n * act, n, point),
           "pa_comm": 0.0, "cpu_offload": 0.0}
    if w.p_a and frac > 0:
        k = max(1, int(round(frac * w.n_layer)))
        out["pa_comm"] = collective(w, hw, dk, m, "tp", "all_gather", k * act, k, point)
    if w.p_a_cpu:
        ckpt = frac * w.n_layer * act / (w.tp if w.p_a else 1)
        pcie = hw.pcie_bw * K.link_efficiency(dk, "pcie", point)
        out["cpu_offload"] = ckpt / pcie  # host -> device in backward; the copy out overlaps
    return out


# ------------------------------------------------------------------------------ the step
TERMS = ("gemm_fwd", "gemm_bwd", "attention_fwd", "attention_bwd", "memory_bound_fwd",
         "memory_bound_bwd", "recompute", "optimizer", "tp_comm", "dp_exposed", "pa_comm",
         "cpu_offload", "host_adam", "pcie_exposed", "overlap_slowdown")


def step_terms(w: P.Workload, hw: Hardware, dk, m: Modern, point: str = "mid") -> dict:
    """Every term of the step (seconds, ``TERMS``), ``dp_total`` (the DP collectives whether
    hidden or not) and ``total`` at one ``point`` of the kernel bands."""
    c = compute_terms(w, hw, dk, m, point)
    windows = (c["gemm_fwd"] + c["attention_fwd"] + c["memory_bound_fwd"],
               c["gemm_bwd"] + c["attention_bwd"] + c["memory_bound_bwd"] + c["recompute"])
    out = {**c, **tp_terms(w, hw, dk, m, point), **dp_terms(w, hw, dk, windows, point, m),
           **OT.terms(w, hw, dk, windows[1], point, fwd_window=windows[0])}
    out["total"] = sum(out[k] for k in TERMS)
    return out


def flops(w: P.Workload, m: Modern) -> dict:
    """Model FLOPs (MFU) and hardware FLOPs (HFU) of one step on one GPU (module doc)."""
    model = w.flops(w.n_layer, w.vocab, False) / w.tp
    full = w.flops(w.n_layer, w.vocab, True) / w.tp
    return {"model": model, "hardware": model + recompute_fraction(m) * (full - model)}


def step(w: P.Workload, hw: Hardware, dk, m: Modern) -> dict:
    """The step at the band's middle (every term), its low / high totals, tokens/s, MFU and
    HFU with their bands, and the three largest terms."""
    mid = step_terms(w, hw, dk, m, "mid")
    slow, fast = step_terms(w, hw, dk, m, "low")["total"], step_terms(w, hw, dk, m,
                                                                       "high")["total"]
    f = flops(w, m)
    tokens = float(w.batch_per_gpu) * w.seq * w.dp  # per step, the whole cluster

    def rates(t: float) -> dict:
        return {"tokens_per_s": tokens / t, "mfu": f["model"] / (hw.peak_flops * t),
                "hfu": f["hardware"] / (hw.peak_flops * t)}

    top = sorted(((k, mid[k]) for k in TERMS), key=lambda kv: -kv[1])[:3]
    return {"terms": {k: mid[k] for k in TERMS}, "dp_total": mid["dp_total"],
            "pcie_total": mid["pcie_total"],
            "host_rate": (OT.host_rate(hw.host_cores, hw.host_mem_bw, "mid", hw.host_lanes,
                                       hw.host_clock) if w.offload else 0.0),
            "step_s": mid["total"], "step_s_band": (fast, slow), **rates(mid["total"]),
            "band": {"low": rates(slow), "high": rates(fast)},
            "largest": [(k, v, v / mid["total"]) for k, v in top],
            "flops": f, "recompute_fraction": recompute_fraction(m)}
