"""A100-SXM4-80GB (Ampere): 312 TFLOPS bf16 dense, 2039 GB/s HBM2e, 108 SMs (NVIDIA A100
datasheet r4; A100 architecture whitepaper). Memory: datasheet 80 GB HBM2e; reported 81920 MiB
total by nvidia-smi (A100-SXM4-80GB, drivers 510-550, public logs); CUDA's totalGlobalMem is
lower, 81221.8 MiB (a deviceQuery log of an A100-SXM4-80GB): the allocator's universe is the
latter. Kernel points: the abbreviations of ``zero_repro.scale.kernel_sources``.
"""
from zero_repro.gpus import Gpu, Point

GPU = Gpu(
    "a100_80gb", "A100-SXM4-80GB", "ampere", peak_tflops=312.0, hbm_gbps=2039.0, sm_count=108,
    memory_gb=80, memory_mib=81920, cuda_name=(("A100",), ("PCIE",)),
    points=(
        Point("gemm", (1024, 10240, 5120), 271.2, "MAMF (torch 2.6.0+cu126)", "A100 SXM",
              ref=312.0),
        Point("gemm", (6912, 16384, 2048), 267.9, "MAMF, earlier revision (CUDA 12.1)",
              "A100 SXM", ref=312.0),
        Point("gemm", (8192, 8192, 8192), 264.53, "TPD (A100 SXM4 80GB, torch 2.8.0)"),
        Point("hbm", ("scale",), 1737.0, "RRZE a100_80.txt"),
        Point("hbm", ("triad",), 1794.0, "RRZE a100_80.txt"),
    ))
