"""The kernel-level facts the modern step model (``scale.kernels``, ``scale.modern_step``) is built
from that belong to no one GPU, and the sources every GPU's points cite. Each GPU's own points
(GEMM, flash attention, streaming memory) live with its datasheet facts in ``zero_repro.gpus``.
Nothing here is fitted and nothing comes from an end-to-end training-throughput table (FSDP /
DeepSpeed / Megatron / torchtitan / llm-foundry runs are what the estimate is judged against,
never what it is built from).

A number is a *point*: (GPU, what, shape, measured value, source). Efficiencies are fractions
of the GPU's dense bf16/fp16 tensor-core peak or of its memory / link line rate. Where a GPU has
no public kernel benchmark its generation names the device whose numbers stand in
(``zero_repro.gpus.Generation.proxy``); the band then carries that device's spread.

Sources (abbreviations used in the tables):
  MAMF    stas00/ml-engineering compute/accelerator/README.md@744d01e1, "Maximum Achievable
          Matmul FLOPS comparison table" (bf16 torch.mm, mean of 100 iterations after 50 warmup,
          best shape of a brute-force search) and the same table's earlier revisions
  TPD     zzc0721/torch-performance-test-data database.md@9d828276 (torch.mm of square bf16 /
          fp16 matrices 1024..10240, 30 iterations after 10 warmup, best size) and its issue #79
          (H100 per size)
  FA1791  Dao-AILab/flash-attention PR #1791 (hopper/benchmark_attn.py on H100 SXM, head dim
          128, seqlen 8192; causal FLOPs counted as half)
  FA2abs  FlashAttention-2 (Dao 2023, arXiv:2307.08691) abstract: "reaching 50-73% of the
          theoretical maximum FLOPs/s on A100"; the same abstract: FlashAttention(-1) "reaching
          only 25-40%"
  FA3abs  FlashAttention-3 (Shah et al. 2024, arXiv:2407.08608) abstract: "up to 740 TFLOPs/s
          (75% utilization)" fp16 forward on H100
  TB2391  pytorch/benchmark PR #2391 (commit ff65cb67): FA3 forward on H100, head dim 128,
          B·S = 16k, 620.7 TFLOPS at seqlen 16384, 614.2 at 8192
  RRZE    RRZE-HPC/gpu-benches@1038c5d0 gpu-stream/*.txt (max over occupancy of the "scale"
          kernel A = B·c and the "triad" kernel); gpu-small-kernels/h200.txt (a 64 kB SCALE
          kernel takes ~2.5 us back to back: the per-kernel start-up cost)
  NT212   NVIDIA/nccl-tests #212 (NCCL maintainer): H100 NVLink 450 GB/s line rate, ~370 GB/s
          effective bus bandwidth for non-all-reduce collectives
  NT326   NVIDIA/nccl-tests #326 (NCCL maintainer): all_gather busBw ~360 GB/s "exactly what
          we'd expect on H100"
  NT149   NVIDIA/nccl-tests #149: 8 x A100-SXM4-80GB over NVLink, busBw ~200 GB/s
  NT228   NVIDIA/nccl-tests #228: A100-SXM4-80GB, busBw 220 GB/s once P2P is on
  NT290   NVIDIA/nccl-tests #290 (NCCL maintainer): 46-48 GB/s per 400 Gb/s NDR NIC
  NT119   NVIDIA/nccl-tests #119: 3 nodes of 8 x A100-40GB, 4 x HDR 200 Gb/s per node: 84.8
          GB/s average, 96 GB/s peak of the 100 GB/s line rate
  BAM54   ZaidQureshi/bam #54: measured peak of PCIe Gen4 x16 25 GB/s (of 32), Gen3 x16
          12 GB/s (of 16)
"""
from __future__ import annotations

from zero_repro.gpus import Point, known

# the A100 range of FlashAttention-2 (its abstract, over the paper's benchmark grid: head dim
# 64/128, causal or not, seqlen 512-16k, forward and backward)
FA2_A100_RANGE = (0.50, 0.73)
# FlashAttention-1 class kernels (the memory-efficient SDPA kernel; the only fused kernel on
# Volta): 25-40% (FA2abs, about FlashAttention on A100)
FA1_RANGE = (0.25, 0.40)

KERNEL_START_S = 2.5e-6  # RRZE gpu-small-kernels/h200.txt: 64 kB at ~26 GB/s back to back

# -------------------------------------------------------------------------------- links
# fraction of the per-direction line rate NCCL's ring collectives reach (bus bandwidth)
LINK = {
    "nvlink_ampere": ((200.0 / 300.0, "NT149"), (220.0 / 300.0, "NT228")),
    "nvlink_hopper": ((360.0 / 450.0, "NT326"), (370.0 / 450.0, "NT212")),
    "pcie": ((12.0 / 16.0, "BAM54 (Gen3)"), (25.0 / 32.0, "BAM54 (Gen4)")),
    "network": ((84.8 / 100.0, "NT119 average"), (46.0 / 50.0, "NT290 low"),
                (96.0 / 100.0, "NT119 peak"), (48.0 / 50.0, "NT290 high")),
}


def points(kind: str = "") -> tuple[tuple[str, Point], ...]:
    """(GPU key, point) of every GPU's points (of ``kind`` when given), GPUs in key order."""
    return tuple((k, p) for k, g in sorted(known().items()) for p in g.points
                 if not kind or p.kind == kind)
