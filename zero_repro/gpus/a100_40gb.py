"""A100-SXM4-40GB (Ampere): 312 TFLOPS bf16 dense, 1555 GB/s HBM2, 108 SMs (NVIDIA A100 datasheet
r4, nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf; A100 architecture whitepaper). Memory:
datasheet 40 GB HBM2; reported 40536 MiB (nvidia-smi, drivers 450-535; CUDA total 39.586 GiB =
40536 MiB in JuliaPerf GPUInspector's DGX-A100 docs); driver 570 prints 40960 MiB
(Slusheeking/nextgen docs/SYSTEM_HARDWARE.md). Kernel points: the abbreviations of
``zero_repro.scale.kernel_sources``; the 40 GB board has the 80 GB board's GA100 and clocks, so
MAMF's A100 SXM rows stand in too.
"""
from zero_repro.gpus import Gpu, Point

GPU = Gpu(
    "a100_40gb", "A100-SXM4-40GB", "ampere", peak_tflops=312.0, hbm_gbps=1555.0, sm_count=108,
    memory_gb=40, memory_mib=40536, cuda_name=(("A100",), ("PCIE",)),
    points=(
        Point("gemm", (8192, 8192, 8192), 246.33, "TPD (A100 40GB, torch 2.2.0)"),
        Point("gemm", (1024, 10240, 5120), 271.2, "MAMF (torch 2.6.0+cu126)", "A100 SXM",
              ref=312.0),
        Point("gemm", (6912, 16384, 2048), 267.9, "MAMF, earlier revision (CUDA 12.1)",
              "A100 SXM", ref=312.0),
        Point("hbm", ("scale",), 1382.0, "RRZE a100_40.txt"),
        Point("hbm", ("triad",), 1375.0, "RRZE a100_40.txt"),
    ))
