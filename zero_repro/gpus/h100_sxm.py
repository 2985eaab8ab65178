"""H100-SXM5-80GB (Hopper): 989 TFLOPS bf16 dense, 3350 GB/s HBM3, 132 SMs (NVIDIA H100 Tensor Core
GPU datasheet; H100 architecture whitepaper). Memory: datasheet 80 GB HBM3; reported 81559 MiB
total (nvidia-smi "NVIDIA H100 80GB HBM3", drivers 535-550, public logs). PCIe and NVL variants
have a lower peak: not matched by ``cuda_name``. Kernel points: the abbreviations of
``zero_repro.scale.kernel_sources``. Flash attention at head dim 128, seqlen 8192, TFLOPS on the
kernel's own FLOP count (forward 4·b·heads·s²·d, causal half, backward 2.5 x forward): PyTorch
SDPA's flash backend is FlashAttention-2 ("Fav2"); the FlashAttention-3 class (FA3, cuDNN's SDPA)
the others. They stand in for every Hopper GPU.
"""
from zero_repro.gpus import Gpu, Point

GPU = Gpu(
    "h100_sxm", "H100-SXM5-80GB", "hopper", peak_tflops=989.0, hbm_gbps=3350.0, sm_count=132,
    memory_gb=80, memory_mib=81559, cuda_name=(("H100",), ("NVL", "PCIE")),
    points=(
        Point("gemm", (2048, 2048, 13312), 794.5, "MAMF (torch 2.7.0+cu126)"),
        Point("gemm", (6144, 17920, 2816), 792.1, "MAMF, earlier revision (CUDA 12.1)"),
        Point("gemm", (1024, 8192, 15360), 758.6, "MAMF, earlier revision (2.5.1+cu124)"),
        Point("gemm", (2816, 15616, 4096), 738.6, "MAMF, earliest revision (CUDA 12.1)"),
        Point("gemm", (2048, 2048, 2048), 676.59, "TPD issue #79 (torch 2.7.0+cu128)",
              check_only=True),
        Point("gemm", (4096, 4096, 4096), 788.72, "TPD issue #79", check_only=True),
        Point("gemm", (8192, 8192, 8192), 797.51, "TPD issue #79 (its best size)"),
        Point("gemm", (10240, 10240, 10240), 719.72, "TPD issue #79 (at its power limit)",
              check_only=True),
        Point("gemm", (8192, 8192, 8192), 783.66, "TPD (second H100, torch 2.8.0)"),
        Point("attn_fwd", (8192, 128), 369.9, "FA1791 Fav2 (main)", kernel="fa2"),
        Point("attn_fwd", (8192, 128), 371.1, "FA1791 Fav2 (branch)", kernel="fa2"),
        Point("attn_bwd", (8192, 128), 290.6, "FA1791 Fav2 (main)", kernel="fa2"),
        Point("attn_bwd", (8192, 128), 288.9, "FA1791 Fav2 (branch)", kernel="fa2"),
        Point("attn_fwd_causal", (8192, 128), 284.1, "FA1791 Fav2 (main)", kernel="fa2"),
        Point("attn_fwd_causal", (8192, 128), 281.4, "FA1791 Fav2 (branch)", kernel="fa2"),
        Point("attn_bwd_causal", (8192, 128), 287.1, "FA1791 Fav2 (main)", kernel="fa2"),
        Point("attn_bwd_causal", (8192, 128), 289.1, "FA1791 Fav2 (branch)", kernel="fa2"),
        Point("attn_fwd", (8192, 128), 659.1, "FA1791 Fav3 (main)", kernel="fa3"),
        Point("attn_fwd", (8192, 128), 614.2, "TB2391 flash_v3", kernel="fa3"),
        Point("attn_bwd", (8192, 128), 553.9, "FA1791 Fav3 (main)", kernel="fa3"),
        Point("attn_bwd", (8192, 128), 563.5, "FA1791 Fav3 (branch)", kernel="fa3"),
        Point("attn_fwd_causal", (8192, 128), 630.0, "FA1791 Fav3 (main)", kernel="fa3"),
        Point("attn_bwd_causal", (8192, 128), 531.6, "FA1791 Fav3 (main)", kernel="fa3"),
        Point("hbm", ("scale",), 1704.0, "RRZE h100_pcie.txt (H100 PCIe, 2000 GB/s)",
              "H100 PCIe", ref=2000.0),
        Point("hbm", ("triad",), 1832.0, "RRZE h100_pcie.txt", "H100 PCIe", ref=2000.0),
    ))
