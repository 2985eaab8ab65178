"""The kernel-level facts the modern step model (``scale.kernels``, ``scale.modern_step``) is built
from, one table per kind, every number with its source. Nothing here is fitted and nothing comes
from an end-to-end training-throughput table (FSDP / DeepSpeed / Megatron / torchtitan /
llm-foundry runs are what the estimate is judged against, never what it is built from).

A number is a *point*: (device, what, shape, measured value, source). Efficiencies are fractions
of the device's dense bf16/fp16 tensor-core peak (``SPECS``) or of its memory / link line rate.
Where a device has no public kernel benchmark the table says ``proxy`` and names the device whose
numbers stand in; the band then carries that device's spread.

Devices (``SPECS``; vendor datasheets, dense peak without sparsity):
  v100      Tesla V100-SXM2/3 32GB: 125 TFLOPS fp16, 900 GB/s HBM2, 80 SMs (V100 datasheet)
  a100_40gb A100-SXM4-40GB: 312 TFLOPS bf16, 1555 GB/s HBM2, 108 SMs (A100 datasheet r4)
  a100_80gb A100-SXM4-80GB: 312 TFLOPS bf16, 2039 GB/s HBM2e, 108 SMs (A100 datasheet r4)
  h100_sxm  H100-SXM5-80GB: 989 TFLOPS bf16, 3350 GB/s HBM3, 132 SMs (H100 datasheet)
  h200_sxm  H200-SXM-141GB: 989 TFLOPS bf16, 4800 GB/s HBM3e, 132 SMs (H200 datasheet)
  l40s      L40S-48GB: 362.05 TFLOPS bf16, 864 GB/s GDDR6, 142 SMs (L40S datasheet)

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

from dataclasses import dataclass


@dataclass(frozen=True)
class Spec:
    """A device's vendor figures: dense bf16/fp16 tensor peak, memory bandwidth, SMs."""
    name: str
    peak_tflops: float
    hbm_gbps: float
    sm_count: int
    generation: str  # volta | ampere | ada | hopper (which kernels exist: flash needs >= ampere)
    memory_gb: float  # datasheet size, GB


SPECS = {
    "v100": Spec("Tesla V100-SXM 32GB", 125.0, 900.0, 80, "volta", 32),
    "a100_40gb": Spec("A100-SXM4-40GB", 312.0, 1555.0, 108, "ampere", 40),
    "a100_80gb": Spec("A100-SXM4-80GB", 312.0, 2039.0, 108, "ampere", 80),
    "h100_sxm": Spec("H100-SXM5-80GB", 989.0, 3350.0, 132, "hopper", 80),
    "h200_sxm": Spec("H200-SXM-141GB", 989.0, 4800.0, 132, "hopper", 141),
    "l40s": Spec("L40S-48GB", 362.05, 864.0, 142, "ada", 48),
}


@dataclass(frozen=True)
class Point:
    """One kernel-level measurement: on ``device`` (a ``SPECS`` key, or the device it was
    measured on when that is another one: ``measured_on``), ``kind`` at ``shape``, ``value``
    (TFLOPS, or GB/s), from ``source``."""
    device: str
    kind: str  # gemm | attn_fwd | attn_bwd | attn_fwd_causal | attn_bwd_causal | hbm | link
    shape: tuple
    value: float
    source: str
    measured_on: str = ""  # the board the number was measured on, when not ``device`` itself
    check_only: bool = False  # a shape-dependence check, not an input of the device's band


# ---------------------------------------------------------------------------------- GEMMs
# bf16 (fp16 on V100) torch.mm, (M, N, K); TFLOPS
GEMM = (
    Point("a100_80gb", "gemm", (1024, 10240, 5120), 271.2, "MAMF (torch 2.6.0+cu126)",
          "A100 SXM"),
    Point("a100_80gb", "gemm", (6912, 16384, 2048), 267.9, "MAMF, earlier revision (CUDA 12.1)",
          "A100 SXM"),
    Point("a100_80gb", "gemm", (8192, 8192, 8192), 264.53, "TPD (A100 SXM4 80GB, torch 2.8.0)"),
    Point("a100_40gb", "gemm", (8192, 8192, 8192), 246.33, "TPD (A100 40GB, torch 2.2.0)"),
    # the 40 GB board has the 80 GB board's GA100 and clocks: MAMF's A100 SXM rows stand in too
    Point("a100_40gb", "gemm", (1024, 10240, 5120), 271.2, "MAMF (torch 2.6.0+cu126)",
          "A100 SXM"),
    Point("a100_40gb", "gemm", (6912, 16384, 2048), 267.9, "MAMF, earlier revision (CUDA 12.1)",
          "A100 SXM"),
    Point("h100_sxm", "gemm", (2048, 2048, 13312), 794.5, "MAMF (torch 2.7.0+cu126)"),
    Point("h100_sxm", "gemm", (6144, 17920, 2816), 792.1, "MAMF, earlier revision (CUDA 12.1)"),
    Point("h100_sxm", "gemm", (1024, 8192, 15360), 758.6, "MAMF, earlier revision (2.5.1+cu124)"),
    Point("h100_sxm", "gemm", (2816, 15616, 4096), 738.6, "MAMF, earliest revision (CUDA 12.1)"),
    Point("h100_sxm", "gemm", (2048, 2048, 2048), 676.59, "TPD issue #79 (torch 2.7.0+cu128)",
          check_only=True),
    Point("h100_sxm", "gemm", (4096, 4096, 4096), 788.72, "TPD issue #79", check_only=True),
    Point("h100_sxm", "gemm", (8192, 8192, 8192), 797.51, "TPD issue #79 (its best size)"),
    Point("h100_sxm", "gemm", (10240, 10240, 10240), 719.72, "TPD issue #79 (at its power "
          "limit)", check_only=True),
    Point("h100_sxm", "gemm", (8192, 8192, 8192), 783.66, "TPD (second H100, torch 2.8.0)"),
    Point("h200_sxm", "gemm", (1024, 15360, 4096), 828.6, "MAMF (GH200 900 W, 141 GiB HBM3e)",
          "GH200"),
    Point("h200_sxm", "gemm", (8192, 8192, 8192), 790.29, "TPD (H200, docker)"),
    Point("l40s", "gemm", (8192, 8192, 8192), 269.15, "TPD (L40S, bf16, best square size)"),
    Point("l40s", "gemm", (8192, 8192, 8192), 264.02, "TPD (L40S, fp16, best square size)"),
    Point("v100", "gemm", (8192, 8192, 8192), 94.84, "TPD (V100-SXM2-16GB fp16, torch 2.7.1)"),
    Point("v100", "gemm", (8192, 8192, 8192), 88.92, "TPD (V100S-32GB PCIe fp16; its fraction "
          "of its own 130 TFLOPS peak stands in)", "V100S"),
)
# peaks of boards measured in place of a ``SPECS`` device (the efficiency is value / this)
MEASURED_PEAK = {"V100S": 130.0, "GH200": 989.0, "A100 SXM": 312.0}

# ------------------------------------------------------------------------ flash attention
# head dim 128, seqlen 8192 unless said; TFLOPS on the kernel's own FLOP count: forward
# 4·b·heads·s²·d (causal: half), backward 2.5 x forward
ATTENTION = (
    # PyTorch SDPA's flash backend is FlashAttention-2 (Ampere, Ada, Hopper)
    Point("h100_sxm", "attn_fwd", (8192, 128), 369.9, "FA1791 Fav2 (main)"),
    Point("h100_sxm", "attn_fwd", (8192, 128), 371.1, "FA1791 Fav2 (branch)"),
    Point("h100_sxm", "attn_bwd", (8192, 128), 290.6, "FA1791 Fav2 (main)"),
    Point("h100_sxm", "attn_bwd", (8192, 128), 288.9, "FA1791 Fav2 (branch)"),
    Point("h100_sxm", "attn_fwd_causal", (8192, 128), 284.1, "FA1791 Fav2 (main)"),
    Point("h100_sxm", "attn_fwd_causal", (8192, 128), 281.4, "FA1791 Fav2 (branch)"),
    Point("h100_sxm", "attn_bwd_causal", (8192, 128), 287.1, "FA1791 Fav2 (main)"),
    Point("h100_sxm", "attn_bwd_causal", (8192, 128), 289.1, "FA1791 Fav2 (branch)"),
    # Hopper kernels of the FlashAttention-3 class (FA3; cuDNN's SDPA is of the same class)
    Point("h100_sxm", "attn_fwd", (8192, 128), 659.1, "FA1791 Fav3 (main)"),
    Point("h100_sxm", "attn_fwd", (8192, 128), 614.2, "TB2391 flash_v3"),
    Point("h100_sxm", "attn_bwd", (8192, 128), 553.9, "FA1791 Fav3 (main)"),
    Point("h100_sxm", "attn_bwd", (8192, 128), 563.5, "FA1791 Fav3 (branch)"),
    Point("h100_sxm", "attn_fwd_causal", (8192, 128), 630.0, "FA1791 Fav3 (main)"),
    Point("h100_sxm", "attn_bwd_causal", (8192, 128), 531.6, "FA1791 Fav3 (main)"),
)
# the A100 range of FlashAttention-2 (its abstract, over the paper's benchmark grid: head dim
# 64/128, causal or not, seqlen 512-16k, forward and backward)
FA2_A100_RANGE = (0.50, 0.73)
# FlashAttention-1 class kernels (the memory-efficient SDPA kernel; the only fused kernel on
# Volta): 25-40% (FA2abs, about FlashAttention on A100)
FA1_RANGE = (0.25, 0.40)

# --------------------------------------------------------------------- memory-bound kernels
# GB/s of a streaming kernel (RRZE gpu-stream: max over occupancy; "scale" 1 load + 1 store,
# "triad" 3 loads + 1 store), against the board's datasheet bandwidth
HBM = (
    Point("a100_40gb", "hbm", ("scale",), 1382.0, "RRZE a100_40.txt"),
    Point("a100_40gb", "hbm", ("triad",), 1375.0, "RRZE a100_40.txt"),
    Point("a100_80gb", "hbm", ("scale",), 1737.0, "RRZE a100_80.txt"),
    Point("a100_80gb", "hbm", ("triad",), 1794.0, "RRZE a100_80.txt"),
    Point("h100_sxm", "hbm", ("scale",), 1704.0, "RRZE h100_pcie.txt (H100 PCIe, 2000 GB/s)",
          "H100 PCIe"),
    Point("h100_sxm", "hbm", ("triad",), 1832.0, "RRZE h100_pcie.txt", "H100 PCIe"),
    Point("h200_sxm", "hbm", ("scale",), 3174.0, "RRZE gh200.txt (GH200, 4000 GB/s HBM3)",
          "GH200 HBM3"),
    Point("h200_sxm", "hbm", ("triad",), 3783.0, "RRZE gh200.txt", "GH200 HBM3"),
    Point("l40s", "hbm", ("scale",), 800.0, "RRZE l40.txt (L40: the L40S's 864 GB/s GDDR6)",
          "L40"),
    Point("l40s", "hbm", ("triad",), 831.0, "RRZE l40.txt", "L40"),
    Point("v100", "hbm", ("scale",), 809.0, "RRZE v100.txt"),
    Point("v100", "hbm", ("triad",), 788.0, "RRZE v100.txt"),
)
MEASURED_BW = {"H100 PCIe": 2000.0, "GH200 HBM3": 4000.0, "L40": 864.0}
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
