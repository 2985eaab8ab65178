"""H200-SXM-141GB (Hopper; the H100 SXM5's GH100 die with 141 GB HBM3e): 989 TFLOPS bf16 dense,
4800 GB/s HBM3e, 132 SMs (NVIDIA H200 Tensor Core GPU datasheet). Memory: datasheet 141 GB;
reported 143771 MiB total (nvidia-smi "NVIDIA H200", drivers 550-570, public logs) = 140.4 GiB.
Kernel points: the abbreviations of ``zero_repro.scale.kernel_sources``; attention: the H100's
(the generation's).
"""
from zero_repro.gpus import Gpu, Point

GPU = Gpu(
    "h200_sxm", "H200-SXM-141GB", "hopper", peak_tflops=989.0, hbm_gbps=4800.0, sm_count=132,
    memory_gb=141, memory_mib=143771, cuda_name=(("H200",), ("NVL", "PCIE")),
    points=(
        Point("gemm", (1024, 15360, 4096), 828.6, "MAMF (GH200 900 W, 141 GiB HBM3e)",
              "GH200", ref=989.0),
        Point("gemm", (8192, 8192, 8192), 790.29, "TPD (H200, docker)"),
        Point("hbm", ("scale",), 3174.0, "RRZE gh200.txt (GH200, 4000 GB/s HBM3)",
              "GH200 HBM3", ref=4000.0),
        Point("hbm", ("triad",), 3783.0, "RRZE gh200.txt", "GH200 HBM3", ref=4000.0),
    ))
